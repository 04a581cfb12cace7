"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status code.

Every way a request can fail ends here: typed engine errors, schema violations, Starlette's own HTTP errors
(404 route, 405 method) and unexpected exceptions (a 500 carrying a request id; the traceback goes to the log
only). See docs/server.md, "Errors".
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.core.errors import InvalidRequestError, KVServeError

logger = logging.getLogger("kvserve.server")

_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed",
    413: "invalid_request_error",
    415: "invalid_request_error",
}


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers
        self.accounted = False  # counted and metered already (by the serving layer)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def json(self) -> str:
        # ASCII escapes: a message quoting user input (even a lone surrogate) can always be written.
        return json.dumps(self.body())

    def response(self) -> Response:
        return Response(
            self.json(),
            status_code=self.status_code,
            headers=self.headers,
            media_type="application/json",
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def internal_error(
    message: str = "internal server error", request_id: str | None = None
) -> APIError:
    request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
    return APIError(
        500, f"{message} (request id {request_id})", "internal_error", code="internal_error"
    )


def from_engine_error(exc: KVServeError) -> APIError:
    from kvserve.engine.wire import EngineDeadError, RequestFailedError

    if isinstance(exc, InvalidRequestError):
        code = "context_length_exceeded" if "context" in exc.message else None
        return bad_request(exc.message, exc.param, code)
    if isinstance(exc, RequestFailedError):
        return internal_error(f"this request failed inside the engine: {exc}")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", code="engine_dead")
    return APIError(503, str(exc), "service_unavailable")


def _respond(request: Request, error: APIError) -> Response:
    # Every error that reaches a handler is counted once, by type (request outcomes in /metrics), and
    # metered under the caller's key.
    state = getattr(request.app.state, "kvserve", None)
    if state is not None:
        state.record_rejection(request.scope.get("state", {}).get("key_id"), error)
    return error.response()


async def api_error_handler(request: Request, exc: APIError) -> Response:
    return _respond(request, exc)


async def engine_error_handler(request: Request, exc: KVServeError) -> Response:
    return _respond(request, from_engine_error(exc))


async def validation_error_handler(request: Request, exc: RequestValidationError) -> Response:
    # OpenAI answers schema violations with 400 (FastAPI's default would be 422).
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        location = [p for p in first.get("loc", ()) if p != "body"]
        where = f" at character {location[0]}" if location else ""
        reason = (first.get("ctx") or {}).get("error", "malformed JSON")
        return _respond(
            request, bad_request(f"the request body is not valid JSON: {reason}{where}")
        )
    param = _param_path(first.get("loc", ()))
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else "invalid request body"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return _respond(request, bad_request(message, param))


def _param_path(loc) -> str | None:
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_type_tag(part):
            path += f".{part}" if path else str(part)
    return path or None


def _is_type_tag(part: str) -> bool:
    # pydantic names the union member it tried (`str`, `list[int]`, `function-after[...]`): not a field
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith("function-")


async def http_exception_handler(request: Request, exc: StarletteHTTPException) -> Response:
    error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    if exc.status_code >= 500:
        error_type = "internal_error"
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    headers = dict(exc.headers) if exc.headers else None
    return _respond(request, APIError(exc.status_code, message, error_type, headers=headers))


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    error = internal_error()
    logger.error("%s on %s %s", error.message, request.method, request.url.path, exc_info=exc)
    return _respond(request, error)
