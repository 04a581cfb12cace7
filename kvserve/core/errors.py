"""Typed errors: every bad input raises one of these with a message a user can act on.

The server maps them to OpenAI-shaped error bodies (see server/errors.py); `param` names the offending field.
"""

from __future__ import annotations


class KVServeError(Exception):
    """Base class of kvserve's own errors."""


class InvalidRequestError(KVServeError, ValueError):
    """A request parameter is invalid (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt plus the requested output does not fit the model's context (HTTP 400)."""


class ModelLoadError(KVServeError):
    """A checkpoint directory is missing files or tensors, or its tensors have the wrong shapes."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's `model_type` (or one of its options) is not implemented."""


class CapacityError(InvalidRequestError):
    """A request can never fit the KV cache, however long it waits (HTTP 400)."""
