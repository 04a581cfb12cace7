"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status code."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvserve.core.errors import InvalidRequestError, KVServeError


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

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_engine_error(exc: KVServeError) -> APIError:
    if isinstance(exc, InvalidRequestError):
        code = "context_length_exceeded" if "context" in exc.message else None
        return bad_request(exc.message, exc.param, code)
    return APIError(503, str(exc), "service_unavailable")


def _respond(request: Request, error: APIError) -> JSONResponse:
    # Every error that reaches a handler is counted once, by type (request outcomes in /metrics).
    state = getattr(request.app.state, "kvserve", None)
    if state is not None and state.metrics is not None:
        state.metrics.observe_error(error.error_type)
    return error.response()


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return _respond(request, exc)


async def engine_error_handler(request: Request, exc: KVServeError) -> JSONResponse:
    return _respond(request, from_engine_error(exc))


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    # OpenAI answers schema violations with 400 (FastAPI's default would be 422).
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else "invalid request body"
    return _respond(request, bad_request(message, param))
