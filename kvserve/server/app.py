"""The FastAPI application: OpenAI routes, tokenizer routes, health, readiness and metrics.

The HTTP server starts at once; the model loads (and warms up) in a background thread. Until then /health is
200 and /ready is 503, and the API answers 503. If the engine dies, /health and /ready answer 503 with the
reason, every request gets 503, and `on_fatal` (the CLI: stop the server, exit non-zero) is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.core.errors import ContextLengthError, InvalidRequestError, KVServeError
from kvserve.engine.client import EngineClient
from kvserve.server import access_log
from kvserve.server.errors import (
    APIError,
    api_error_handler,
    engine_error_handler,
    http_exception_handler,
    internal_error_handler,
    validation_error_handler,
)
from kvserve.server.limits import GuardMiddleware
from kvserve.server.manifest import build_manifest, fingerprint, manifest_hash
from kvserve.server.metering import ApiKey, KeyRing, Metering, outcome_of, parse_api_keys
from kvserve.server.metrics import ServerMetrics
from kvserve.server.openai_fields import check_other_fields
from kvserve.server.openapi import install_openapi
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.server.serving import OpenAIServing, ServingOptions
from kvserve.server.web import include_web
from kvserve.server.workers import offload

logger = logging.getLogger("kvserve.server")


@dataclass
class ServerState:
    """Everything the routes need; `serving` is None until the model is loaded and warmed up."""

    options: ServingOptions
    keys: KeyRing = field(default_factory=lambda: KeyRing(()))
    engine_options: dict = field(default_factory=dict)
    serving: OpenAIServing | None = None
    engine: EngineClient | None = None
    manifest: dict | None = None
    manifest_sha256: str | None = None
    load_error: str | None = None
    dead_reason: str | None = None
    shutting_down: bool = False
    metrics: ServerMetrics | None = None
    metering: Metering | None = None
    loop: asyncio.AbstractEventLoop | None = None
    on_fatal: Callable[[], None] | None = None
    # called once from the loader thread: None when the model is loaded and warmed up, else the error
    on_loaded: Callable[[str | None], None] | None = None
    num_cut_at_shutdown: int = 0

    @property
    def limits(self):
        return self.options.limits

    def record_rejection(self, key_id: str | None, error: APIError) -> None:
        """Count and meter an error answered before (or outside) a running job, once."""
        if error.accounted:
            return
        error.accounted = True
        if self.metrics is not None:
            if error.code == NOT_READY_CODE:  # the server's state, not the request's fault
                self.metrics.not_ready.inc()
            else:
                self.metrics.observe_error(error.error_type)
        if self.metering is not None and key_id is not None:
            self.metering.record(key_id, outcome_of(error.status_code, error.code))

    def engine_died(self, reason: str) -> None:
        """On the event loop: the engine thread stopped for good."""
        self.dead_reason = reason
        logger.critical("engine dead: %s; the server stops so a supervisor can restart it", reason)
        if self.on_fatal is not None:
            self.on_fatal()

    def begin_drain(self, grace_period_s: float) -> None:
        """On the event loop, at SIGTERM: refuse new work; when the grace period ends, cut what is left
        (each open stream gets an error event, each waiting response a 503)."""
        if self.shutting_down:
            return
        self.shutting_down = True

        def expire() -> None:
            if self.serving is not None:
                self.num_cut_at_shutdown = self.serving.expire_open_jobs()
                if self.num_cut_at_shutdown:
                    logger.warning("grace period over: %d requests cut", self.num_cut_at_shutdown)

        asyncio.get_running_loop().call_later(grace_period_s, expire)


NOT_READY_CODE = "model_loading"  # a 503 before the model is ready: not a request error


def _load(state: ServerState, client_factory: Callable[[], EngineClient]) -> None:
    outcome = "the load did not finish"  # for state.on_loaded: None once ready, else why not
    try:
        client = client_factory()
        info = client.info
        template = state.options.chat_template or getattr(client.tokenizer, "chat_template", None)
        state.manifest = build_manifest(
            info.model_dir,
            served_model_name=state.options.served_model_name,
            dtype=info.dtype,
            chat_template=template,
            engine_options=state.engine_options,
            kernel_isa=info.kernel_isa,
            bf16_products=info.bf16_products,
        )
        state.manifest_sha256 = manifest_hash(state.manifest)
        client.set_observers(
            grammar_compile=state.metrics.grammar_compile.observe,
            grammar_mask=state.metrics.grammar_mask.observe,
        )

        def on_dead(reason: str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to tell
                state.loop.call_soon_threadsafe(state.engine_died, reason)

        client.on_dead = on_dead
        state.engine = client
        if client.dead:  # died while we were wiring it up
            on_dead(client.dead_reason)
            outcome = f"engine died: {client.dead_reason}"
            return
        client.warm_up()  # one tiny request through the real path on every core
        state.serving = OpenAIServing(
            client,
            state.options,
            state.metrics,
            fingerprint(state.manifest_sha256),
            state.metering,
        )
        logger.info(
            "ready: %s (manifest %s)", state.options.served_model_name, state.manifest_sha256
        )
        outcome = None
    except Exception as exc:  # reported by /ready and on_loaded (the CLI exits non-zero)
        logger.exception("model load failed")
        state.load_error = outcome = f"{type(exc).__name__}: {exc}"
    finally:
        if state.on_loaded is not None:
            state.on_loaded(outcome)


def build_app(
    client_factory: Callable[[], EngineClient],
    options: ServingOptions,
    api_keys: tuple[str | ApiKey, ...] = (),
    engine_options: dict | None = None,
    *,
    on_fatal: Callable[[], None] | None = None,
    on_loaded: Callable[[str | None], None] | None = None,
) -> FastAPI:
    """The app over the engine client `client_factory()` builds (in a background thread, at start).
    `on_loaded(None)` is called from that thread once the model is loaded and warmed up (/ready turns
    200), `on_loaded(error)` if the load failed."""
    keys = tuple(k for k in api_keys if isinstance(k, ApiKey))
    keys += parse_api_keys([k for k in api_keys if not isinstance(k, ApiKey)])
    state = ServerState(
        options=options,
        keys=KeyRing(keys),
        engine_options=engine_options or {},
        on_fatal=on_fatal,
        on_loaded=on_loaded,
    )
    state.metrics = ServerMetrics(
        lambda: state.engine.stats if state.engine else None,
        lambda: state.engine.core_stats if state.engine else [],
    )
    state.metering = Metering(state.metrics.registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        access_log.install()
        loader = threading.Thread(target=_load, args=(state, client_factory), daemon=True)
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
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(GuardMiddleware, state=state)

    def serving() -> OpenAIServing:
        if state.dead_reason is not None:
            raise APIError(503, state.dead_reason, "service_unavailable", code="engine_dead")
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if state.serving is None:
            message = state.load_error or "the model is still loading"
            code = "model_load_failed" if state.load_error else NOT_READY_CODE
            raise APIError(
                503, message, "service_unavailable", code=code, headers={"Retry-After": "2"}
            )
        return state.serving

    def key_id(request: Request) -> str | None:
        return request.scope.get("state", {}).get("key_id")

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.dead_reason is not None:
            return JSONResponse({"status": "dead", "error": state.dead_reason}, status_code=503)
        if state.load_error is not None:  # the process is on its way out: not healthy
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        # With --api-key, a caller without a valid key learns ready or not, nothing else: the
        # details (manifest, queue, cache, engine PIDs, errors) need the key.
        detailed = request.scope.get("state", {}).get("open_key_id") is not None
        if state.dead_reason is not None:
            body = {"status": "dead", "error": state.dead_reason}
            return JSONResponse(body if detailed else {"status": "dead"}, status_code=503)
        if state.serving is None or state.shutting_down:
            status = (
                "failed"
                if state.load_error
                else "shutting_down"
                if state.shutting_down
                else "loading"
            )
            body = {"status": status, "error": state.load_error}
            return JSONResponse(body if detailed else {"status": status}, status_code=503)
        if not detailed:
            return JSONResponse({"status": "ready"})
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
                "engines": state.engine.core_status,
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

    @app.get("/v1/usage")
    async def usage(request: Request) -> dict:
        """The caller's own metered totals (by its API key id)."""
        return state.metering.usage(key_id(request))

    @app.get("/v1/models")
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
                    "max_model_len": state.engine.max_model_len,
                    "system_fingerprint": state.serving.fingerprint,
                }
            ],
        }

    async def run(builder, body, request: Request):
        s = serving()
        job = await s.prepare(builder, body, key_id(request), request.is_disconnected)
        if state.shutting_down or state.dead_reason is not None:
            s.release(job)
            serving()  # raises the 503
        if job.stream:
            return _JobStream(s, job)
        return JSONResponse(await _unless_disconnected(request, s, job))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(OpenAIServing.chat_job, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(OpenAIServing.completion_job, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        s = serving()
        s.check_model(body.model)
        check_other_fields(body)

        def encode() -> list[int]:
            if body.messages is not None and body.prompt is not None:
                raise InvalidRequestError("give `prompt` or `messages`, not both", "messages")
            if body.messages is not None:
                chat = ChatCompletionRequest.model_construct(
                    messages=body.messages,
                    add_generation_prompt=body.add_generation_prompt,
                    chat_template_kwargs=None,
                )
                return s.encode(s.render_chat(chat), False, "messages")
            if body.prompt is not None:
                return s.encode(body.prompt, body.add_special_tokens, "prompt")
            raise InvalidRequestError("give `prompt` or `messages`", "prompt")

        tokens = await offload(encode)
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": s.engine.max_model_len,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        s = serving()
        s.check_model(body.model)
        check_other_fields(body)
        # fuzzing: 8 MB of ids took 2 s to decode into 85 MB of text. As many ids as /tokenize
        # can return (a text it takes has fewer characters than the context x the longest token)
        limit = s.engine.max_model_len
        ceiling = limit * (s.token_bound.longest_token if s.token_bound else 1)
        if len(body.tokens) > ceiling:
            raise ContextLengthError(
                f"{len(body.tokens)} token ids; this model's context is {limit} tokens, and "
                f"/tokenize returns at most {ceiling} (the context x its longest token)",
                "tokens",
            )
        vocab = s.engine.info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", "tokens")
        s.require_tokenizer()
        return {"prompt": await offload(s.tokenizer.decode, body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Forget cached prefixes (benchmarks that replay one workload at several rates need it).
        Refused with 409 while any request holds blocks."""
        s = serving()
        done = await asyncio.to_thread(s.engine.reset_prefix_cache)
        if not done:
            raise APIError(409, "requests are running; retry when idle", "conflict")
        return JSONResponse({"status": "ok"})

    @app.get("/debug/steps")
    async def debug_steps(since: int = 0) -> dict:
        """The engine loop's per-step timings (kvserve.engine.step_log), from sequence number
        `since`, and the engine limits: what `kvserve simulate --calibrate-server` fits."""
        engine = serving().engine
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

    @app.get("/debug/engine")
    async def debug_engine() -> dict:
        """Block-pool state, for tests and operators: all blocks free when nothing runs."""
        s = serving()
        return await asyncio.to_thread(s.engine.debug_engine)

    install_openapi(app)
    return app


class _JobStream(StreamingResponse):
    """A job's SSE stream that always settles its job: a stream that never started (the client left
    before the first byte) gives its waiting-queue places back and is counted as aborted."""

    def __init__(self, serving: OpenAIServing, job) -> None:
        super().__init__(serving.stream(job), media_type="text/event-stream")
        self._serving = serving
        self._job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._serving.release(self._job)
            self._serving.client_gone(self._job)  # a no-op when the stream settled the job itself


async def _unless_disconnected(request: Request, serving: OpenAIServing, job, poll_s: float = 0.25):
    """Run a non-streaming job, but cancel it (which aborts its engine requests) if the client
    disconnects first: nobody would read the answer, and its cache blocks are better spent on others.
    The disconnected request is logged and metered as aborted."""
    task = asyncio.ensure_future(serving.complete(job))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                serving.client_gone(job)
                error = APIError(499, "the client closed the connection", "client_closed_request")
                error.accounted = True  # client_gone counted it
                raise error
    finally:
        if not task.done():
            task.cancel()
        serving.release(job)
