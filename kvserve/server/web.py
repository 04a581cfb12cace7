"""The browser pages: a chat playground at `/`, a live dashboard at `/dashboard`, and the API
reference at `/docs` (Swagger UI from the package's own copy).

Everything the pages load is in `kvserve/server/static/` (no CDN: the pages work offline). The pages
and their assets load without an API key; on a server with `--api-key` they ask for one when an API
call answers 401, keep it in the tab's sessionStorage and send it as a Bearer header on every call
(`static/auth.js`). The pages talk to the server only through its public HTTP API: the playground streams
`/v1/chat/completions`, the dashboard polls `/metrics` and `/ready` and computes rates and
percentiles in the browser, so what they show is what any Prometheus client would see.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"


def include_web(app: FastAPI) -> None:
    """Mount the pages and their assets on `app` (which must be built with docs_url=None)."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> FileResponse:
        # Swagger UI fed by docs.js, which fetches /openapi.json with the page's API key (FastAPI's
        # own page fetches it without one, so it failed on a server with --api-key)
        return FileResponse(STATIC_DIR / "docs.html", media_type="text/html")
