"""OpenAI chat and completions over the async engine: request -> prompts -> engine streams -> responses."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache

from kvserve.core.errors import InvalidRequestError, KVServeError
from kvserve.core.outputs import TokenLogprob
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server.errors import APIError, from_engine_error
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("kvserve.requests")


@dataclass(frozen=True)
class ServingOptions:
    served_model_name: str
    max_waiting: int | None = None
    request_timeout_s: float | None = None
    chat_template: str | None = None
    log_content: bool = False


@dataclass
class _Job:
    """One OpenAI request: its prompts (each fanned out to n samples by the engine)."""

    request_id: str
    kind: str  # "chat" | "completion"
    stream: bool
    params: SamplingParams
    prompt_token_ids: list[list[int]]
    prompt_texts: list[str | None]
    include_usage: bool
    continuous_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    finished_choices: set[int] = field(default_factory=set)  # streamed finish chunks


class OpenAIServing:
    def __init__(
        self, engine: AsyncEngine, options: ServingOptions, metrics: ServerMetrics, fingerprint: str
    ) -> None:
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.fingerprint = fingerprint
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()
        self._token_text = lru_cache(maxsize=65536)(self._decode_token)

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

    def chat_job(self, request: ChatCompletionRequest) -> _Job:
        self.check_model(request.model)
        params = request.to_sampling_params()
        text = self.render_chat(request)
        ids = self.encode(text, add_special_tokens=False)
        return self._job("chat", request, params, [ids], [text])

    def completion_job(self, request: CompletionRequest) -> _Job:
        self.check_model(request.model)
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

    def _job(self, kind, request, params, ids, texts) -> _Job:
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
        return _Job(
            request_id=f"{prefix}-{uuid.uuid4().hex[:24]}",
            kind=kind,
            stream=request.stream,
            params=params,
            prompt_token_ids=ids,
            prompt_texts=texts,
            include_usage=request.include_usage,
            continuous_usage=request.continuous_usage,
            cache_salt=request.cache_salt,
        )

    # --- running ----------------------------------------------------------------------------------------

    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
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

    async def _with_deadline(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
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

    async def complete(self, job: _Job) -> dict:
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
                choices.append(self._choice(job, index, completion))
        self._record(job, finals)
        return {
            "id": job.request_id,
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": self.options.served_model_name,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self._usage(job, finals),
            "metrics": _server_metrics(finals[0].outputs[0]) if finals else None,
        }

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        """Server-sent events: role chunk (chat), content deltas, finish chunks, usage, [DONE]."""
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}
        n = job.params.n
        if job.kind == "chat":
            for index in range(len(job.prompt_token_ids) * n):
                yield self._sse(
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
                        yield self._sse(
                            job, [self._delta_choice(job, choice_index, completion)], latest
                        )
                    if completion.finished and choice_index not in job.finished_choices:
                        job.finished_choices.add(choice_index)
                        finish = self._finish_choice(job, choice_index, completion)
                        yield self._sse(job, [finish], latest, _server_metrics(completion))
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
            yield f"data: {json.dumps(self._envelope(job, [], usage=self._usage(job, finals)))}\n\n"
        yield "data: [DONE]\n\n"

    # --- response pieces --------------------------------------------------------------------------------

    def _envelope(self, job: _Job, choices: list[dict], usage=None, with_usage_key=False) -> dict:
        body = {
            "id": job.request_id,
            "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": self.options.served_model_name,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None or with_usage_key:
            body["usage"] = usage
        return body

    def _sse(
        self, job: _Job, choices: list[dict], latest: dict[int, RequestOutput], metrics=None
    ) -> str:
        usage = self._usage(job, latest) if job.continuous_usage else None
        body = self._envelope(job, choices, usage=usage, with_usage_key=job.include_usage)
        if metrics:
            body["metrics"] = metrics
        return f"data: {json.dumps(body)}\n\n"

    def _delta_choice(self, job: _Job, index: int, c: CompletionOutput) -> dict:
        logprobs = self._logprobs(job, c.delta_logprobs) if c.delta_logprobs else None
        if job.kind == "chat":
            return {
                "index": index,
                "delta": {"content": c.delta_text},
                "logprobs": logprobs,
                "finish_reason": None,
            }
        return {"index": index, "text": c.delta_text, "logprobs": logprobs, "finish_reason": None}

    def _finish_choice(self, job: _Job, index: int, c: CompletionOutput) -> dict:
        if job.kind == "chat":
            choice = {
                "index": index,
                "delta": {},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
        return _with_structured(choice, c)

    def _choice(self, job: _Job, prompt_index: int, c: CompletionOutput) -> dict:
        index = prompt_index * job.params.n + c.index
        logprobs = self._logprobs(job, c.logprobs) if c.logprobs is not None else None
        if job.kind == "chat":
            return _with_structured(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                },
                c,
            )
        return _with_structured(
            {
                "index": index,
                "text": c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            },
            c,
        )

    def _decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _logprobs(self, job: _Job, entries: list[TokenLogprob]) -> dict:
        text = self._token_text
        if job.kind == "chat":
            return {
                "content": [
                    {
                        "token": text(e.token_id),
                        "logprob": e.logprob,
                        "bytes": list(text(e.token_id).encode()),
                        "top_logprobs": [
                            {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
                            for t, lp in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        tokens = [text(e.token_id) for e in entries]
        offsets = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]])) if tokens else []
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _usage(self, job: _Job, outputs: dict[int, RequestOutput]) -> dict:
        prompt_tokens = sum(len(ids) for ids in job.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _record(self, job: _Job, finals: dict[int, RequestOutput]) -> None:
        completions = [c for o in finals.values() for c in o.outputs]
        self.metrics.observe_completion(sum(len(i) for i in job.prompt_token_ids), completions)
        self._log(job, "ok", completions)

    def _log(self, job: _Job, outcome: str, completions: list[CompletionOutput]) -> None:
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
        if ttfts:
            record["ttft_s"] = round(min(ttfts), 4)
        if self.options.log_content:
            record["prompts"] = job.prompt_texts
            record["outputs"] = [c.text for c in completions]
        logger.info("request %s", json.dumps(record))


def _server_metrics(completion: CompletionOutput) -> dict | None:
    """Server-side timings of one sample (a kvserve extension; clients that do not know it ignore it):
    queue time is admission - arrival, which a client cannot measure (spec section 1)."""
    m = completion.metrics
    if m is None:
        return None
    return {
        "queue_time_s": m.queue_time_s,
        "ttft_s": m.ttft_s,
        "e2e_s": None if m.finished_time is None else m.finished_time - m.arrival_time,
        "num_cached_tokens": completion.num_cached_tokens,
        "num_preemptions": m.num_preemptions,
        "num_spec_proposed": completion.num_spec_proposed,
        "num_spec_accepted": completion.num_spec_accepted,
    }


def _with_structured(choice: dict, completion: CompletionOutput) -> dict:
    """Constrained outputs say whether the document is complete: one cut short by max_tokens (finish
    reason `length`) or a stop string may not parse, and the response must not suggest otherwise."""
    if completion.structured_complete is not None:
        choice["structured_output"] = {"complete": completion.structured_complete}
    return choice
