"""Access logs carry the path, never the query string: a secret in `?note=...` must not reach a log."""

from __future__ import annotations

import logging


class StripQueryFilter(logging.Filter):
    """Rewrites uvicorn's access records (client, method, path?query, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            path, sep, _ = args[2].partition("?")
            record.args = (*args[:2], path + ("?[query omitted]" if sep else ""), *args[3:])
        return True


def install() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, StripQueryFilter) for f in access.filters):
        access.addFilter(StripQueryFilter())
