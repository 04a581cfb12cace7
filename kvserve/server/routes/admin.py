"""Maintenance and inspection: /reset_prefix_cache, /debug/steps, /debug/engine."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvserve.server.errors import APIError
from kvserve.server.state import state_of

router = APIRouter()


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> JSONResponse:
    """Forget cached prefixes (benchmarks that replay one workload at several rates need it).
    Refused with 409 while any request holds blocks."""
    s = state_of(request).require_serving()
    done = await asyncio.to_thread(s.engine.reset_prefix_cache)
    if not done:
        raise APIError(409, "requests are running; retry when idle", "conflict")
    return JSONResponse({"status": "ok"})


@router.get("/debug/steps")
async def debug_steps(request: Request, since: int = 0) -> dict:
    """The engine loop's per-step timings (kvserve.engine.step_log), from sequence number `since`,
    and the engine limits: what `kvserve simulate --calibrate-server` fits."""
    engine = state_of(request).require_serving().engine
    info = engine.info
    return {
        "num_recorded": engine.step_log.num_recorded,
        "engine": {
            "model_dir": info.model_dir,
            "dtype": info.dtype,
            "quantization": info.quantization,
            "num_blocks": info.num_blocks,
            "block_size": info.block_size,
            "max_model_len": info.max_model_len,
            "max_num_seqs": info.max_num_seqs,
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "enable_prefix_caching": info.enable_prefix_caching,
            "admission": info.admission,
            "num_engine_cores": engine.num_cores,
            "threads": info.threads,
        },
        "steps": engine.step_log.since(since),
    }


@router.get("/debug/engine")
async def debug_engine(request: Request) -> dict:
    """Block-pool state, for tests and operators: all blocks free when nothing runs."""
    s = state_of(request).require_serving()
    return await asyncio.to_thread(s.engine.debug_engine)
