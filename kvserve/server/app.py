"""The FastAPI application: its state, error handlers, guard middleware and routes.

The HTTP server starts at once; the model loads (and warms up) in a background thread
(kvserve.server.state.load_engine). Until then /health is 200 and /ready is 503, and the API answers
503. If the engine dies, /health and /ready answer 503 with the reason, every request gets 503, and
`on_fatal` (the CLI: stop the server, exit non-zero) is called. The routes live in
kvserve.server.routes, one module per concern.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.core.errors import KVServeError
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
from kvserve.server.metering import ApiKey, KeyRing, Metering, parse_api_keys
from kvserve.server.metrics import ServerMetrics
from kvserve.server.openapi import install_openapi
from kvserve.server.routes import admin, generation, status, tokens
from kvserve.server.serving import ServingOptions
from kvserve.server.state import NOT_READY_CODE, ServerState, load_engine
from kvserve.server.web import include_web

__all__ = ["NOT_READY_CODE", "ServerState", "build_app"]


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
        loader = threading.Thread(target=load_engine, args=(state, client_factory), daemon=True)
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
    for routes in (status, generation, tokens, admin):
        app.include_router(routes.router)
    install_openapi(app)
    return app
