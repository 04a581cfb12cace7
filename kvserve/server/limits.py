"""The server's front door, as one ASGI middleware that runs before any route parses a body:

1. the API key (every path but /health, /ready, /metrics and the browser pages with their static assets),
   checked on the headers alone; on the open paths a valid key is still recognised (/ready's details);
2. the request-body size (`--max-request-bytes`, 413), from Content-Length when given, else while reading;
3. the body's shape: valid UTF-8, JSON nesting at most `--max-json-depth`, no lone UTF-16 surrogates (which
   no tokenizer can encode and no JSON encoder can write back), each a 400 naming what is wrong.

Checks of a large body run in the worker pool, so a 8 MB upload never holds the event loop. Rejections are
OpenAI-shaped JSON (see docs/server.md, "Errors").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from kvserve.core.options import check_options, flag_of, option
from kvserve.server.errors import APIError, bad_request
from kvserve.server.workers import offload

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
# A browser cannot send a header when it opens a page: the pages and their assets hold no data and load
# without a key, then ask for one and send it on every API call they make (kvserve/server/web.py).
PAGE_PATHS = frozenset({"/", "/dashboard", "/docs"})
STATIC_PREFIX = "/static/"


def is_open_path(path: str) -> bool:
    if path in OPEN_PATHS or path in PAGE_PATHS:
        return True
    return path.startswith(STATIC_PREFIX) and ".." not in path  # only files under static/


_OFFLOAD_BYTES = 256 * 1024  # bodies above this are checked in the worker pool
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may ask for (documented in docs/server.md, "Limits"), each a
    `kvserve serve` flag (kvserve/core/options.py)."""

    max_request_bytes: int = option(8 * 1024 * 1024, "largest request body (413 above it)", ge=1)
    max_json_depth: int = option(64, "deepest JSON nesting of a request body", ge=1)
    max_n: int = option(16, "largest n per request", ge=1)
    # 1,000 prompts x n=16 queued 16,000 samples and held a 2-core server for 99 s
    max_samples: int = option(256, "most samples (prompts x n) one request may create", ge=1)
    max_request_tokens: int = option(
        1 << 20,
        "most output tokens one request may ask for: samples x max_tokens (the context "
        "length for a request without max_tokens)",
        ge=1,
    )
    max_stop_strings: int = option(16, "stop strings per request", ge=1)
    max_stop_chars: int = option(256, "characters per stop string", ge=1)
    # a 20,000-value enum (440 KB) compiled for over a minute; larger constraints are refused
    # before any compile
    max_grammar_bytes: int = option(
        128 * 1024,
        "largest structured-output constraint (JSON schema, regex, grammar, choices as JSON); "
        "each compile is also bounded in time by --grammar-compile-timeout",
        ge=1,
    )

    def __post_init__(self) -> None:
        check_options(self, flag_of)


def json_depth(body: bytes, limit: int) -> int:
    """Nesting depth of a JSON text (exact once it exceeds `limit`; any value <= limit otherwise),
    in linear time: brackets count outside strings only, a string opening and closing at each
    quote that an even run of backslashes precedes. (A regex for strings took quadratic time on
    an unclosed string of escaped quotes: 12 s for 48 KB, holding the GIL.)"""
    if body.count(b"[") + body.count(b"{") <= limit:
        return 0  # cannot be deeper than the number of openers
    text = np.frombuffer(body, dtype=np.uint8)
    index = np.arange(len(text))
    # the last index at or before each position that is not a backslash (-1: none)
    last_other = np.maximum.accumulate(np.where(text != ord("\\"), index, -1))
    run_before = np.empty(len(text), dtype=np.int64)  # backslashes right before each position
    run_before[0] = 0
    run_before[1:] = index[:-1] - last_other[:-1]
    quotes = (text == ord('"')) & (run_before % 2 == 0)
    outside = np.cumsum(quotes) % 2 == 0  # a closing quote itself counts as outside
    steps = np.zeros(len(text), dtype=np.int32)
    steps[((text == ord("[")) | (text == ord("{"))) & outside] = 1
    steps[((text == ord("]")) | (text == ord("}"))) & outside] = -1
    return int(np.cumsum(steps).max(initial=0))


def _lone_surrogate_param(value, path: str = "") -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate, else None."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "body"
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def check_body(body: bytes, limits: RequestLimits) -> None:
    """Raise a 400 APIError for a body that is not UTF-8, nests too deep or holds lone surrogates."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason})",
            code="invalid_utf8",
        ) from None
    depth = json_depth(body, limits.max_json_depth)
    if depth > limits.max_json_depth:
        raise bad_request(
            f"the request body nests JSON {depth} levels deep; the limit is "
            f"{limits.max_json_depth} (--max-json-depth)",
            code="json_too_deep",
        )
    if _SURROGATE_ESCAPE.search(body):  # maybe a lone surrogate; pairs (emoji) are fine
        try:
            parsed = json.loads(body)
        except ValueError:
            return  # malformed JSON: the route's parser says where
        param = _lone_surrogate_param(parsed)
        if param is not None:
            raise bad_request(
                f"{param}: the string holds a lone UTF-16 surrogate, which is not a character; "
                "send valid Unicode",
                param,
                "invalid_unicode",
            )


class GuardMiddleware:
    """API key, body size and body shape, before the app sees the request (see the module docstring)."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state  # ServerState: limits, api keys, metrics, metering

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scope.setdefault("state", {})
        key_id = state.keys.authenticate(headers.get("authorization", ""))
        if is_open_path(scope["path"]):
            scope["state"]["open_key_id"] = key_id  # None: no valid key (/ready shows less)
        else:
            if key_id is None:
                state.metrics.unauthorized.inc()  # not a request error: its own counter
                error = APIError(
                    401,
                    "missing or invalid API key (send Authorization: Bearer KEY)",
                    "authentication_error",
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
            scope["state"]["key_id"] = key_id
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(headers, receive)
            if len(body) > _OFFLOAD_BYTES:
                await offload(check_body, body, state.limits)
            else:
                check_body(body, state.limits)
        except APIError as error:
            state.record_rejection(scope["state"].get("key_id"), error)
            await error.response()(scope, receive, send)
            return

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _read_body(self, headers: dict[str, str], receive) -> bytes:
        limit = self.state.limits.max_request_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError(499, "the client closed the connection", "client_closed_request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _too_large(num_bytes: int, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body has {num_bytes} bytes or more; the limit is {limit} (--max-request-bytes)",
        "invalid_request_error",
        code="request_too_large",
    )
