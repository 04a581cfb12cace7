"""The FastAPI application: OpenAI routes, tokenizer routes, health, readiness and metrics.

The HTTP server starts at once; the model loads (and warms up) in a background thread. Until then /health is
200 and /ready is 503, and the API answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.core.errors import InvalidRequestError, KVServeError
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.errors import (
    APIError,
    api_error_handler,
    engine_error_handler,
    validation_error_handler,
)
from kvserve.server.manifest import build_manifest, fingerprint, manifest_hash
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.server.serving import OpenAIServing, ServingOptions
from kvserve.server.web import include_web

logger = logging.getLogger("kvserve.server")


@dataclass
class ServerState:
    """Everything the routes need; `serving` is None until the model is loaded and warmed up."""

    options: ServingOptions
    api_keys: tuple[str, ...] = ()
    engine_options: dict = field(default_factory=dict)
    serving: OpenAIServing | None = None
    engine: AsyncEngine | None = None
    manifest: dict | None = None
    manifest_sha256: str | None = None
    load_error: str | None = None
    shutting_down: bool = False
    metrics: ServerMetrics | None = None


def _load(state: ServerState, engine_factory: Callable[[], LLMEngine]) -> None:
    try:
        engine = engine_factory()
        template = state.options.chat_template or getattr(engine.tokenizer, "chat_template", None)
        state.manifest = build_manifest(
            engine.config.model_dir,
            served_model_name=state.options.served_model_name,
            dtype=engine.config.dtype,
            chat_template=template,
            engine_options=state.engine_options,
        )
        state.manifest_sha256 = manifest_hash(state.manifest)
        engine.on_grammar_compile = state.metrics.grammar_compile.observe
        mask_times = engine.runner.grammar_mask_times_s
        async_engine = AsyncEngine(
            engine, on_step=lambda _: state.metrics.drain_mask_times(mask_times)
        )
        # Warm up: one tiny request through the real path (allocations, first-call overheads).
        async_engine.call_in_engine_thread(_warm_up)
        state.engine = async_engine
        state.serving = OpenAIServing(
            async_engine, state.options, state.metrics, fingerprint(state.manifest_sha256)
        )
        logger.info(
            "ready: %s (manifest %s)", state.options.served_model_name, state.manifest_sha256
        )
    except Exception as exc:  # reported by /ready; the process stays up for inspection
        logger.exception("model load failed")
        state.load_error = f"{type(exc).__name__}: {exc}"


def _warm_up(engine: LLMEngine) -> None:
    engine.add_request("warmup", [0], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def build_app(
    engine_factory: Callable[[], LLMEngine],
    options: ServingOptions,
    api_keys: tuple[str, ...] = (),
    engine_options: dict | None = None,
) -> FastAPI:
    state = ServerState(options=options, api_keys=api_keys, engine_options=engine_options or {})
    state.metrics = ServerMetrics(lambda: state.engine.stats if state.engine else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=_load, args=(state, engine_factory), daemon=True)
        loader.start()
        yield
        state.shutting_down = True
        if state.engine is not None:
            state.engine.shutdown()

    # /docs is served by kvserve.server.web from packaged assets; FastAPI's own pages load a CDN.
    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvserve = state
    include_web(app)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(KVServeError, engine_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    def require_key(request: Request) -> None:
        if not state.api_keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(token, key) for key in state.api_keys):
            raise APIError(
                401,
                "missing or invalid API key (send Authorization: Bearer KEY)",
                "authentication_error",
                code="invalid_api_key",
            )

    def serving() -> OpenAIServing:
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if state.serving is None:
            message = state.load_error or "the model is still loading"
            raise APIError(503, message, "service_unavailable", headers={"Retry-After": "2"})
        return state.serving

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.serving is None or state.shutting_down:
            status = (
                "failed"
                if state.load_error
                else "shutting_down"
                if state.shutting_down
                else "loading"
            )
            return JSONResponse({"status": status, "error": state.load_error}, status_code=503)
        stats = state.engine.stats
        return JSONResponse(
            {
                "status": "ready",
                "model": options.served_model_name,
                "manifest_sha256": state.manifest_sha256,
                "system_fingerprint": state.serving.fingerprint,
                "num_running": stats.num_running,
                "num_waiting": state.engine.num_waiting,
                "num_unfinished": state.engine.num_unfinished,
                "kv_usage": stats.kv_usage,
                "kv_free_blocks": stats.num_free_blocks,
                "kv_total_blocks": stats.num_blocks,
            }
        )

    @app.get("/manifest")
    async def manifest() -> JSONResponse:
        serving()
        return JSONResponse({"sha256": state.manifest_sha256, "manifest": state.manifest})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models() -> dict:
        serving()
        return {
            "object": "list",
            "data": [
                {
                    "id": options.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvserve",
                    "max_model_len": state.engine.engine.max_model_len,
                    "system_fingerprint": state.serving.fingerprint,
                }
            ],
        }

    async def run(job_builder, body, request: Request):
        s = serving()
        job = job_builder(s, body)
        if job.stream:  # Starlette cancels the stream when the client goes away
            return StreamingResponse(s.stream(job), media_type="text/event-stream")
        return JSONResponse(await _unless_disconnected(request, s.complete(job)))

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(OpenAIServing.chat_job, body, request)

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request):
        return await run(OpenAIServing.completion_job, body, request)

    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize(body: TokenizeRequest) -> dict:
        s = serving()
        s.check_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt
            )
            tokens = s.encode(s.render_chat(chat), add_special_tokens=False)
        elif body.prompt is not None:
            tokens = s.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise InvalidRequestError("give `prompt` or `messages`", "prompt")
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": s.engine.engine.max_model_len,
        }

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        s = serving()
        s.check_model(body.model)
        vocab = s.engine.engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", "tokens")
        s._require_tokenizer()
        return {"prompt": s.tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache", dependencies=[Depends(require_key)])
    async def reset_prefix_cache() -> JSONResponse:
        """Forget cached prefixes (benchmarks that replay one workload at several rates need it).
        Refused with 409 while any request holds blocks."""
        s = serving()
        done = await asyncio.to_thread(
            s.engine.call_in_engine_thread, lambda e: e.kv_manager.pool.reset_prefix_cache()
        )
        if not done:
            raise APIError(409, "requests are running; retry when idle", "conflict")
        return JSONResponse({"status": "ok"})

    @app.get("/debug/engine")
    async def debug_engine() -> dict:
        """Block-pool state, for tests and operators: all blocks free when nothing runs."""
        s = serving()

        def check(engine: LLMEngine) -> dict:
            engine.check_invariants()
            return {
                "num_free_blocks": engine.num_free_blocks(),
                "num_blocks": engine.num_blocks,
                "num_requests": engine.num_requests,
                "invariants": "ok",
            }

        return await asyncio.to_thread(s.engine.call_in_engine_thread, check)

    return app


async def _unless_disconnected(request: Request, work, poll_s: float = 0.25):
    """Await `work`, but cancel it (which aborts its engine requests) if the client disconnects first:
    nobody would read the answer, and its cache blocks are better spent on others."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client closed the connection", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()
