"""Liveness, readiness and what the server is: /health, /ready, /manifest, /metrics, /v1/usage,
/v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.state import key_id, state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = state_of(request)
    if state.dead_reason is not None:
        return JSONResponse({"status": "dead", "error": state.dead_reason}, status_code=503)
    if state.load_error is not None:  # the process is on its way out: not healthy
        return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    # With --api-key, a caller without a valid key learns ready or not, nothing else: the details
    # (manifest, queue, cache, engine PIDs, errors) need the key.
    state = state_of(request)
    detailed = request.scope.get("state", {}).get("open_key_id") is not None
    if state.dead_reason is not None:
        body = {"status": "dead", "error": state.dead_reason}
        return JSONResponse(body if detailed else {"status": "dead"}, status_code=503)
    if state.serving is None or state.shutting_down:
        if state.load_error:
            status = "failed"
        else:
            status = "shutting_down" if state.shutting_down else "loading"
        body = {"status": status, "error": state.load_error}
        return JSONResponse(body if detailed else {"status": status}, status_code=503)
    if not detailed:
        return JSONResponse({"status": "ready"})
    stats = state.engine.stats
    return JSONResponse(
        {
            "status": "ready",
            "model": state.options.served_model_name,
            "manifest_sha256": state.manifest_sha256,
            "system_fingerprint": state.serving.fingerprint,
            "num_running": stats.num_running,
            "num_waiting": state.engine.num_waiting,
            "num_unfinished": state.engine.num_unfinished,
            "kv_usage": stats.kv_usage,
            "kv_free_blocks": stats.num_free_blocks,
            "kv_total_blocks": stats.num_blocks,
            "engines": state.engine.core_status,
        }
    )


@router.get("/manifest")
async def manifest(request: Request) -> JSONResponse:
    state = state_of(request)
    state.require_serving()
    return JSONResponse({"sha256": state.manifest_sha256, "manifest": state.manifest})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = state_of(request).metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/usage")
async def usage(request: Request) -> dict:
    """The caller's own metered totals (by its API key id)."""
    return state_of(request).metering.usage(key_id(request))


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = state_of(request)
    serving = state.require_serving()
    return {
        "object": "list",
        "data": [
            {
                "id": state.options.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "kvserve",
                "max_model_len": state.engine.max_model_len,
                "system_fingerprint": serving.fingerprint,
            }
        ],
    }
