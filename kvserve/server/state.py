"""The server's state (`ServerState`: what every route reads) and the background load of the engine.

The HTTP server starts at once; `load_engine` builds the engine client in a background thread, warms it
up and then sets `state.serving`. Until then /health is 200 and /ready is 503, and the API answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from kvserve.engine.client import EngineClient
from kvserve.server.errors import APIError
from kvserve.server.manifest import build_manifest, fingerprint, manifest_hash
from kvserve.server.metering import KeyRing, Metering, outcome_of
from kvserve.server.metrics import ServerMetrics
from kvserve.server.serving import OpenAIServing, ServingOptions

logger = logging.getLogger("kvserve.server")


def state_of(request: Request) -> ServerState:
    """The app's `ServerState` (set by `build_app`)."""
    return request.app.state.kvserve


def key_id(request: Request) -> str | None:
    """The caller's API key id, set by the guard middleware (None without --api-key)."""
    return request.scope.get("state", {}).get("key_id")


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

    def require_serving(self) -> OpenAIServing:
        """The serving layer, or the 503 that says why there is none (dead, draining, loading)."""
        if self.dead_reason is not None:
            raise APIError(503, self.dead_reason, "service_unavailable", code="engine_dead")
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if self.serving is None:
            message = self.load_error or "the model is still loading"
            code = "model_load_failed" if self.load_error else NOT_READY_CODE
            raise APIError(
                503, message, "service_unavailable", code=code, headers={"Retry-After": "2"}
            )
        return self.serving

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


def load_engine(state: ServerState, client_factory: Callable[[], EngineClient]) -> None:
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
            matrix_engine=info.matrix_engine,
            kernel_table=info.kernel_table,
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
