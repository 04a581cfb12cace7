"""The OpenAPI schema tells the truth: the statuses each route really returns (400 for schema violations,
not FastAPI's 422), each with the OpenAI error body, and the bearer key on every route that needs one."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvserve.server.limits import OPEN_PATHS

_DESCRIPTIONS = {
    "400": "Invalid request (schema, range, context length, limits); `error.param` names the field",
    "401": "Missing or invalid API key",
    "404": "Unknown model",
    "409": "Conflict: requests are running",
    "413": "Request body larger than --max-request-bytes",
    "429": "Waiting queue full (--max-waiting); retry after `Retry-After` seconds",
    "500": "Internal error attributable to this request; the message carries a request id",
    "503": "Loading, shutting down, or the engine is dead",
    "504": "The request exceeded --request-timeout",
}
_GENERATION = ("400", "404", "413", "429", "500", "503", "504")
_STATUSES = {
    "/v1/completions": _GENERATION,
    "/v1/chat/completions": _GENERATION,
    "/tokenize": ("400", "404", "413", "500", "503"),
    "/detokenize": ("400", "404", "413", "500", "503"),
    "/reset_prefix_cache": ("409", "503"),
    "/v1/models": ("503",),
    "/manifest": ("503",),
    "/debug/engine": ("503",),
    "/health": ("503",),
    "/ready": ("503",),
}

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = ERROR_SCHEMA
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                statuses = list(_STATUSES.get(path, ()))
                if path not in OPEN_PATHS:
                    statuses.append("401")
                    operation["security"] = [{"bearer": []}]
                if method == "post" and "413" not in statuses:
                    statuses.append("413")
                for status in sorted(set(statuses)):
                    responses[status] = {"description": _DESCRIPTIONS[status], "content": error_ref}
                if path in ("/v1/completions", "/v1/chat/completions") and "200" in responses:
                    responses["200"]["content"]["text/event-stream"] = {
                        "schema": {"type": "string", "description": "with `stream: true`"}
                    }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
