"""The OpenAI generation routes: /v1/chat/completions and /v1/completions, streamed (SSE) or not."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.serving import OpenAIServing
from kvserve.server.state import key_id, state_of

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _run(OpenAIServing.chat_job, body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _run(OpenAIServing.completion_job, body, request)


async def _run(builder, body, request: Request):
    state = state_of(request)
    serving = state.require_serving()
    job = await serving.prepare(builder, body, key_id(request), request.is_disconnected)
    if state.shutting_down or state.dead_reason is not None:
        serving.release(job)
        state.require_serving()  # raises the 503
    if job.stream:
        return _JobStream(serving, job)
    return JSONResponse(await _unless_disconnected(request, serving, job))


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
