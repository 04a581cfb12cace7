"""OpenAI chat and completions over the async engine: request -> prompts -> engine streams -> responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvserve.core.errors import InvalidRequestError, KVServeError
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server import tools
from kvserve.server.errors import APIError, from_engine_error
from kvserve.server.metrics import ServerMetrics
from kvserve.server.openai_fields import check_fields
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.responses import Job, ResponseBuilder, server_metrics

logger = logging.getLogger("kvserve.requests")


@dataclass(frozen=True)
class ServingOptions:
    served_model_name: str
    max_waiting: int | None = None
    request_timeout_s: float | None = None
    chat_template: str | None = None
    log_content: bool = False
    tool_call_parser: str | None = None  # docs/tools.md: finds calls for tool_choice auto


class OpenAIServing:
    def __init__(
        self, engine: AsyncEngine, options: ServingOptions, metrics: ServerMetrics, fingerprint: str
    ) -> None:
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.fingerprint = fingerprint
        self.tokenizer = engine.tokenizer
        self.responses = ResponseBuilder(options.served_model_name, fingerprint, engine.tokenizer)

    # --- request intake ---------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"`{self.options.served_model_name}`",
                "NotFoundError",
                "model",
                "model_not_found",
            )

    def _require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")

    def render_chat(self, request: ChatCompletionRequest) -> str:
        self._require_tokenizer()
        template = self.options.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; start the server with --chat-template FILE or use "
                "/v1/completions",
                "messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                request.rendered_messages(),
                chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                tokenize=False,
                **tools.template_kwargs(request.tool_plan(), template),
                **(request.chat_template_kwargs or {}),
            )
        except InvalidRequestError:
            raise
        except (
            Exception
        ) as exc:  # a template error is the request's (or template's) fault, not a 500
            raise InvalidRequestError(f"chat template failed: {exc}", "messages") from exc

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self._require_tokenizer()
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        self.check_model(request.model)
        check_fields(request, "chat")
        plan = request.tool_plan()
        parser = tools.output_parser(plan, self.options.tool_call_parser)
        params = tools.constrain(request.to_sampling_params(), plan, parser)
        text = self.render_chat(request)
        ids = self.encode(text, add_special_tokens=False)
        job = self._job("chat", request, params, [ids], [text])
        job.tool_plan, job.tool_parser = plan, parser
        return job

    def completion_job(self, request: CompletionRequest) -> Job:
        self.check_model(request.model)
        check_fields(request, "completion")
        params = request.to_sampling_params()
        ids, texts = [], []
        for prompt in request.prompts():
            if isinstance(prompt, str):
                ids.append(self.encode(prompt, add_special_tokens=True))
                texts.append(prompt)
            else:
                ids.append(list(prompt))
                texts.append(None)
        return self._job("completion", request, params, ids, texts)

    def _job(self, kind, request, params, ids, texts) -> Job:
        for prompt_ids in ids:
            self.engine.validate(prompt_ids, params)
        incoming = len(ids) * params.n
        limit = self.options.max_waiting
        if limit is not None and self.engine.num_waiting + incoming > limit:
            raise APIError(
                429,
                f"the server is at its waiting-queue limit ({limit} requests); retry shortly",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Job(
            request_id=f"{prefix}-{uuid.uuid4().hex[:24]}",
            kind=kind,
            stream=request.stream,
            params=params,
            prompt_token_ids=ids,
            prompt_texts=texts,
            include_usage=request.include_usage,
            continuous_usage=request.continuous_usage,
            cache_salt=request.cache_salt,
            user=request.safety_identifier or request.user,
        )

    # --- running ----------------------------------------------------------------------------------------

    async def _outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Snapshots of every prompt's request, merged: (prompt index, output)."""
        streams = [
            self.engine.generate(
                f"{job.request_id}-p{i}" if len(job.prompt_token_ids) > 1 else job.request_id,
                ids,
                job.params,
                prompt=job.prompt_texts[i] if self.options.log_content else None,
                cache_salt=job.cache_salt,
                arrival_time=job.arrival_time,
            )
            for i, ids in enumerate(job.prompt_token_ids)
        ]
        if len(streams) == 1:
            async with contextlib.aclosing(streams[0]) as stream:
                async for output in stream:
                    yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async with contextlib.aclosing(stream):
                    async for output in stream:
                        await queue.put((index, output))
            except BaseException as exc:
                await queue.put((index, exc))
                raise
            finally:
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _with_deadline(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        timeout = self.options.request_timeout_s
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            try:
                async with asyncio.timeout(timeout):
                    async for item in outputs:
                        yield item
            except TimeoutError:
                self._log(job, "timeout", [])
                raise APIError(
                    504,
                    f"request exceeded the server's {timeout:g} s time limit and was aborted",
                    "timeout_error",
                    code="request_timeout",
                ) from None

    async def complete(self, job: Job) -> dict:
        """Run a non-streaming request to the end; returns the response body."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, output in self._with_deadline(job):
                if output.finished:
                    finals[index] = output
        except KVServeError as exc:
            raise from_engine_error(exc) from exc
        choices = []
        for index in sorted(finals):
            for completion in finals[index].outputs:
                choices.append(self.responses.choice(job, index, completion))
        self._record(job, finals)
        return {
            "id": job.request_id,
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": self.options.served_model_name,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self.responses.usage(job, finals),
            "metrics": server_metrics(finals[0].outputs[0]) if finals else None,
        }

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events: role chunk (chat), content deltas, finish chunks, usage, [DONE]."""
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        n = job.params.n
        if job.kind == "chat":
            for index in range(len(job.prompt_token_ids) * n):
                yield self.responses.sse(
                    job,
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    latest,
                )
        try:
            async for index, output in self._with_deadline(job):
                latest[index] = output
                for completion in output.outputs:
                    choice_index = index * n + completion.index
                    if completion.delta_text or completion.delta_logprobs:
                        yield self.responses.sse(
                            job,
                            [self.responses.delta_choice(job, choice_index, completion)],
                            latest,
                        )
                    if completion.finished and choice_index not in job.finished_choices:
                        job.finished_choices.add(choice_index)
                        finish = self.responses.finish_choice(job, choice_index, completion)
                        yield self.responses.sse(job, [finish], latest, server_metrics(completion))
                if output.finished:
                    finals[index] = output
        except (APIError, KVServeError) as exc:
            # Headers are sent: the error travels as an event (counted here, not by a handler).
            error = exc if isinstance(exc, APIError) else from_engine_error(exc)
            self.metrics.observe_error(error.error_type)
            yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away mid-stream; leaving this generator aborts the engine requests.
            self.metrics.observe_error("client_closed_request")
            self._log(job, "client_closed_request", [])
            raise
        self._record(job, finals)
        if job.include_usage:
            yield f"data: {json.dumps(self.responses.envelope(job, [], usage=self.responses.usage(job, finals)))}\n\n"
        yield "data: [DONE]\n\n"

    def _record(self, job: Job, finals: dict[int, RequestOutput]) -> None:
        completions = [c for o in finals.values() for c in o.outputs]
        self.metrics.observe_completion(sum(len(i) for i in job.prompt_token_ids), completions)
        self._log(job, "ok", completions)

    def _log(self, job: Job, outcome: str, completions: list[CompletionOutput]) -> None:
        record = {
            "request_id": job.request_id,
            "kind": job.kind,
            "stream": job.stream,
            "outcome": outcome,
            "prompt_tokens": [len(i) for i in job.prompt_token_ids],
            "output_tokens": [len(c.token_ids) for c in completions],
            "finish_reasons": [c.finish_reason for c in completions],
            "e2e_s": round(time.monotonic() - job.arrival_time, 4),
        }
        ttfts = [
            c.metrics.ttft_s for c in completions if c.metrics and c.metrics.ttft_s is not None
        ]
        if job.user is not None:
            record["user"] = job.user
        if ttfts:
            record["ttft_s"] = round(min(ttfts), 4)
        if self.options.log_content:
            record["prompts"] = job.prompt_texts
            record["outputs"] = [c.text for c in completions]
        logger.info("request %s", json.dumps(record))
