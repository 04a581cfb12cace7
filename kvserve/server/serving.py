"""OpenAI chat and completions over the async engine: request -> prompts -> engine streams -> responses.

Preparing a job (chat template, tokenisation, validation) runs in the worker pool (`prepare`), a grammar's
compilation through the grammar queue (kvserve/server/grammar_queue.py); the event loop only admits it (an
exact `--max-waiting` reservation) and relays its outputs.
Every outcome is logged once and metered once under the caller's key id.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from kvserve.core.errors import ContextLengthError, InvalidRequestError, KVServeError
from kvserve.core.options import check_options, flag_of, option
from kvserve.core.sampling_params import SamplingParams, StructuredOutput
from kvserve.engine.client import EngineClient, validate_timeout_s
from kvserve.engine.output_processor import OutputKind
from kvserve.engine.outputs import RequestOutput
from kvserve.server import tools
from kvserve.server.errors import APIError, from_engine_error, internal_error
from kvserve.server.grammar_queue import GrammarQueue
from kvserve.server.job_accounting import JobAccounting, merge_streams
from kvserve.server.limits import RequestLimits
from kvserve.server.metering import Metering, outcome_of
from kvserve.server.metrics import ServerMetrics
from kvserve.server.openai_fields import check_fields
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.responses import Job, ResponseBuilder, server_metrics
from kvserve.server.token_bound import TokenBound
from kvserve.server.tool_parsers import DEFAULT_MAX_PARALLEL_CALLS, TOOL_PARSERS
from kvserve.server.workers import offload

logger = logging.getLogger("kvserve.requests")
_MAX_KNOWN_GRAMMARS = 4096  # compiled constraints remembered (then forgotten all at once)


@dataclass(frozen=True)
class ServingOptions:
    """How the server serves requests; the fields declared with `option()` are `kvserve serve`
    flags (kvserve/core/options.py)."""

    served_model_name: str
    max_waiting: int | None = option(
        None,
        "reject with 429 + Retry-After when this many samples would wait for admission",
        ge=1,
    )
    max_waiting_grammars: int = option(
        64,
        "reject with 429 + Retry-After when this many requests wait for a new structured-output "
        "grammar to compile (one compiles at a time)",
        ge=1,
    )
    request_timeout_s: float | None = option(
        None, "abort a request after this many seconds", gt=0, flag="--request-timeout"
    )
    chat_template: str | None = None  # the template's text (--chat-template: its file)
    log_content: bool = option(False, "log prompt and output text (off: sizes and timings)")
    limits: RequestLimits = RequestLimits()
    tool_call_parser: str | None = option(
        None,
        "find tool calls in the output of tool_choice auto requests (docs/tools.md)",
        choices=tuple(sorted(TOOL_PARSERS)),
    )
    max_parallel_tool_calls: int = option(
        DEFAULT_MAX_PARALLEL_CALLS,
        'most calls in one response to tool_choice "required" with parallel calls: the call '
        "grammar ends after N, so a model that never stops calling still ends (docs/tools.md)",
        ge=1,
        le=64,
        metavar="N",
    )

    def __post_init__(self) -> None:
        check_options(self, flag_of)


def _as_sent(exc: InvalidRequestError, field: str) -> InvalidRequestError:
    """`exc` naming `field` where it names max_tokens (a chat request may send
    max_completion_tokens); the same error class (a context-length error stays one)."""
    if exc.param != "max_tokens" or field == "max_tokens":
        return exc
    renamed = copy.copy(exc)
    renamed.message = exc.message.replace("max_tokens", field)
    renamed.args, renamed.param = (renamed.message,), field
    return renamed


async def _unless_gone(
    work: Awaitable, disconnected: Callable[[], Awaitable[bool]] | None, poll_s: float = 0.25
):
    """Await `work`, but cancel it (a 499) if the client disconnects first: a grammar is not compiled for
    nobody, and its place in the queue goes to the next request."""
    if disconnected is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await disconnected():
                raise APIError(499, "the client closed the connection", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()


def _shutdown_error() -> APIError:
    return APIError(
        503,
        "the server shut down (grace period over) before this request finished",
        "service_unavailable",
        code="server_shutdown",
    )


class OpenAIServing(JobAccounting):
    def __init__(
        self,
        engine: EngineClient,
        options: ServingOptions,
        metrics: ServerMetrics,
        fingerprint: str,
        metering: Metering | None = None,
    ) -> None:
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.metering = metering
        self.fingerprint = fingerprint
        self.tokenizer = engine.tokenizer
        self.token_bound = None if engine.tokenizer is None else TokenBound.of(engine.tokenizer)
        self.responses = ResponseBuilder(options.served_model_name, fingerprint, engine.tokenizer)
        self.open_jobs: set[Job] = (
            set()
        )  # running jobs, cut with an error when the grace period ends
        self.grammar_queue = GrammarQueue(options.max_waiting_grammars)
        # Constraints the engine has compiled (checked again at once, without waiting for a turn).
        self.compiled_grammars: set[StructuredOutput] = set()
        metrics.grammar_waiting.set_function(lambda: self.grammar_queue.num_waiting)

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

    def require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")

    def _named_template(self, plan: tools.ToolPlan | None) -> str:
        """The model's template for this request among its named ones, as transformers picks it:
        `tool_use` when tools are sent and the model has one, else `default`."""
        try:
            return self.tokenizer.get_chat_template(tools=list(plan.tools) if plan else None)
        except ValueError as exc:  # no `default` among the names
            raise InvalidRequestError(f"this model's chat templates: {exc}", "messages") from None

    def render_chat(self, request: ChatCompletionRequest) -> str:
        self.require_tokenizer()
        template = self.options.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; start the server with --chat-template FILE or use "
                "/v1/completions",
                "messages",
            )
        plan = request.tool_plan()
        if isinstance(template, dict):  # named templates (chat_template.jinja + additional ones)
            template = self._named_template(plan)
        extra = request.chat_template_kwargs or {}
        own = {
            "chat_template": template,
            "add_generation_prompt": request.add_generation_prompt,
            "tokenize": False,
            **tools.template_kwargs(plan, template),
        }
        # names the template call itself passes: a clear 400, not a TypeError from apply_chat_template
        reserved = sorted(set(extra) & (own.keys() | {"conversation", "tools"}))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the server "
                "sets it (use the request's own field)",
                "chat_template_kwargs",
            )
        try:
            return self.tokenizer.apply_chat_template(request.rendered_messages(), **own, **extra)
        except InvalidRequestError:
            raise
        except (
            Exception
        ) as exc:  # a template error is the request's (or template's) fault, not a 500
            raise InvalidRequestError(f"chat template failed: {exc}", "messages") from exc

    def encode(self, text: str, add_special_tokens: bool, param: str, room: int = 0) -> list[int]:
        """Tokenise `text`, after refusing one that cannot fit the context with `room` tokens of output
        whatever its tokens (kvserve.server.token_bound): the engine's own check comes after tokenising,
        which for a text of megabytes takes seconds of a worker. `/tokenize` passes room 0 (a 2 MB text
        takes ~5 s of a worker to encode)."""
        self.require_tokenizer()
        bound = self.token_bound
        if bound is not None:
            limit = self.engine.info.max_model_len
            # Shorter texts could fit (or are cheap to tokenise: the engine's check names them exactly).
            at_least = bound.at_least(text, max(limit, (limit - room) * bound.longest_token))
            # at_least 0: not worked out, and the engine names the exact count (never "at least 0
            # tokens" for a huge max_tokens)
            if at_least and at_least + room > limit:
                how = f"{len(text)} characters; no token of this tokenizer covers more than "
                how += str(bound.longest_token)
                if at_least >= limit or not room:  # room 0: at_least > limit
                    tail = ", which leaves no room for output" if room else ""
                    raise ContextLengthError(
                        f"the prompt has at least {at_least} tokens ({how}); this model's context "
                        f"is {limit} tokens{tail}",
                        param,
                    )
                raise ContextLengthError(
                    f"prompt (at least {at_least} tokens: {how}) + max_tokens ({room}) = at least "
                    f"{at_least + room} exceeds this model's context of {limit} tokens",
                    "max_tokens",
                )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_prompt(
        self, text: str, add_special_tokens: bool, params: SamplingParams, param: str
    ) -> list[int]:
        """`encode` with room for the output: max_tokens when given, else 1."""
        room = 1 if params.max_tokens is None else max(params.max_tokens, 1)
        return self.encode(text, add_special_tokens, param, room)

    def check_limits(self, params: SamplingParams, num_prompts: int) -> None:
        limits = self.options.limits
        if params.n > limits.max_n:
            raise InvalidRequestError(
                f"n must be at most {limits.max_n} on this server (--max-n), got {params.n}", "n"
            )
        samples = num_prompts * params.n
        if samples > limits.max_samples:
            raise InvalidRequestError(
                f"{num_prompts} prompt(s) x n={params.n} = {samples} samples; this server takes at "
                f"most {limits.max_samples} per request (--max-samples)",
                "n" if params.n > 1 else "prompt",
            )
        structured = params.structured
        if structured is not None and len(structured.spec.encode()) > limits.max_grammar_bytes:
            raise InvalidRequestError(
                f"the structured-output constraint is {len(structured.spec.encode())} bytes; this "
                f"server compiles at most {limits.max_grammar_bytes} bytes (--max-grammar-bytes)",
                structured.param,
            )
        if len(params.stop) > limits.max_stop_strings:
            raise InvalidRequestError(
                f"at most {limits.max_stop_strings} stop strings, got {len(params.stop)}", "stop"
            )
        if params.max_stop_len > limits.max_stop_chars:
            raise InvalidRequestError(
                f"stop strings must be at most {limits.max_stop_chars} characters, got one of "
                f"{params.max_stop_len}",
                "stop",
            )
        # Checked here, off the engine: the engine checks the ids again, but a body of ~600,000 bias
        # entries would cost it seconds to receive and check (each id must be in the vocabulary, so no
        # valid request has more entries than the vocabulary; nor more stop ids than that).
        vocab = self.engine.info.vocab_size
        params.check_vocabulary(vocab)
        if len(params.stop_token_ids) > vocab:
            raise InvalidRequestError(
                f"at most {vocab} stop_token_ids (the vocabulary's size), got "
                f"{len(params.stop_token_ids)}",
                "stop_token_ids",
            )
        waiting_limit = self.options.max_waiting
        if waiting_limit is not None and num_prompts * params.n > waiting_limit:
            # It could never be admitted: a 400, not a 429 that no retry can satisfy.
            raise InvalidRequestError(
                f"{num_prompts} prompt(s) x n={params.n} = {num_prompts * params.n} samples exceed "
                f"the server's waiting-queue limit of {waiting_limit} (--max-waiting)",
                "n",
            )
        # no sample outlives the context (a longer max_tokens is the context check's to refuse)
        context = self.engine.info.max_model_len
        per_sample = context if params.max_tokens is None else min(params.max_tokens, context)
        if samples * per_sample > limits.max_request_tokens:
            how = "max_tokens" if params.max_tokens is not None else "the context: no max_tokens"
            raise InvalidRequestError(
                f"{samples} sample(s) x {per_sample} tokens ({how}) = {samples * per_sample} tokens "
                f"of work; this server takes at most {limits.max_request_tokens} per request "
                "(--max-request-tokens): lower max_tokens, n or the number of prompts",
                "max_tokens",
            )

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        """Run in the worker pool: template, tokenisation, the server's limits (the engine checks the
        rest when it adds the request: `prepare`)."""
        self.check_model(request.model)
        check_fields(request, "chat")
        plan = request.tool_plan()
        parser = tools.output_parser(plan, self.options.tool_call_parser)
        try:
            params = tools.constrain(
                request.to_sampling_params(), plan, parser, self.options.max_parallel_tool_calls
            )
            self.check_limits(params, 1)
            text = self.render_chat(request)
            ids = self.encode_prompt(text, False, params, "messages")
            job = self._job("chat", request, params, [ids], [text])
        except InvalidRequestError as exc:
            if request.max_completion_tokens is None:
                raise
            raise _as_sent(exc, "max_completion_tokens") from None
        job.tool_plan, job.tool_parser = plan, parser
        if request.max_completion_tokens is not None:
            job.max_tokens_field = "max_completion_tokens"
        return job

    def completion_job(self, request: CompletionRequest) -> Job:
        """Run in the worker pool: tokenisation, the server's limits (the engine checks the rest when it
        adds the request: `prepare`)."""
        self.check_model(request.model)
        check_fields(request, "completion")
        params = request.to_sampling_params()
        prompts = request.prompts()
        self.check_limits(params, len(prompts))
        ids, texts = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids.append(self.encode_prompt(prompt, True, params, "prompt"))
                texts.append(prompt)
            else:
                ids.append(list(prompt))
                texts.append(None)
        return self._job("completion", request, params, ids, texts)

    def _job(self, kind, request, params, ids, texts) -> Job:
        known = params.structured is None or params.structured in self.compiled_grammars
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
            grammar_known=known,
        )

    async def prepare(
        self,
        builder,
        request,
        key_id: str | None = None,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> Job:
        """Build the job off the loop, then start it: reserve its samples in the waiting count (or
        429), hand its prompts to the engine and wait until the core has accepted each one. That is
        the one check a request gets (context, capacity, a new grammar compiled, which first waits its
        turn in the grammar queue); a refusal raises here, before any response starts.
        `--request-timeout` counts from here, a grammar's compile included (a long compile gets its 504
        at the limit, not when it ends). `disconnected`: polled while a grammar waits for its turn; a
        client that left takes its grammar out of the queue (499)."""
        received = time.monotonic()
        budget = asyncio.timeout(self.options.request_timeout_s)  # None: no limit
        job = None
        try:
            async with budget:
                job = await offload(builder, self, request)
                job.received = received
                job.key_id = key_id
                if job.grammar_known:
                    await self._start(job)
                else:
                    size = len(job.params.structured.spec)
                    await _unless_gone(self.grammar_queue.run(size, self._start, job), disconnected)
                    self._remember_grammar(job.params.structured)
        except BaseException as exc:
            if job is not None:
                self.release(job)  # its streams, if any, end here
            if isinstance(exc, TimeoutError) and budget.expired():
                raise self._timeout_error() from None
            raise
        return job

    async def _start(self, job: Job) -> None:
        num_samples = len(job.prompt_token_ids) * job.params.n
        limit = self.options.max_waiting
        if not self.engine.reserve(num_samples, limit):
            raise APIError(
                429,
                f"the server is at its waiting-queue limit ({limit} samples); retry shortly",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        job.num_reserved = num_samples
        kind = OutputKind.DELTA if job.stream else OutputKind.FINAL
        many = len(job.prompt_token_ids) > 1
        for i, ids in enumerate(job.prompt_token_ids):
            job.streams.append(
                self.engine.add(
                    f"{job.request_id}-p{i}" if many else job.request_id,
                    ids,
                    job.params,
                    prompt=job.prompt_texts[i] if self.options.log_content else None,
                    cache_salt=job.cache_salt,
                    arrival_time=job.arrival_time,
                    reserved=True,
                    group=job.request_id,  # fair admission among API calls
                    output_kind=kind,
                )
            )
            job.num_reserved -= job.params.n
        # a new grammar compiles in the core first; the core's own limit ends a compile, this bounds
        # the wait beyond it (a compile queued behind another)
        wait_s = None if job.grammar_known else validate_timeout_s(self.engine.info)
        for stream in job.streams:
            try:
                await stream.accepted(wait_s)
            except InvalidRequestError as exc:  # name the field the client sent
                raise _as_sent(exc, job.max_tokens_field) from None
            except TimeoutError:
                structured = job.params.structured
                raise InvalidRequestError(
                    f"the structured-output grammar did not compile within {wait_s:.0f} s",
                    structured.param,
                ) from None

    def _remember_grammar(self, structured: StructuredOutput) -> None:
        if len(self.compiled_grammars) >= _MAX_KNOWN_GRAMMARS:
            self.compiled_grammars.clear()
        self.compiled_grammars.add(structured)

    def _timeout_error(self) -> APIError:
        return APIError(
            504,
            f"request exceeded the server's {self.options.request_timeout_s:g} s time limit and was "
            "aborted",
            "timeout_error",
            code="request_timeout",
        )

    def release(self, job: Job) -> None:
        """Give back a reservation nobody used, and end the job's engine requests that are still
        open (a job that never got to its response, or whose response ended early)."""
        if job.num_reserved:
            self.engine.release(job.num_reserved)
            job.num_reserved = 0
        for stream in job.streams:
            stream.close()

    # --- running ----------------------------------------------------------------------------------------

    def expire_open_jobs(self) -> int:
        """The grace period is over: every running job ends now with a `server_shutdown` error."""
        jobs = list(self.open_jobs)
        for job in jobs:
            job.interrupt(_shutdown_error())
        return len(jobs)

    async def _outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of every prompt's request, merged: (prompt index, output): each step's deltas
        for a stream, the finished request otherwise. Raises APIError when the request's time budget or
        the server's grace period runs out."""
        streams = job.streams  # started and accepted by `prepare`
        timeout = self.options.request_timeout_s
        timer = None
        if timeout is not None:
            start = job.arrival_time if job.received is None else job.received
            remaining = max(0.0, start + timeout - time.monotonic())
            error = self._timeout_error()
            timer = asyncio.get_running_loop().call_later(remaining, job.interrupt, error)
        self.open_jobs.add(job)
        try:
            if len(streams) == 1:
                async for output in streams[0]:
                    yield 0, output
                return
            async for item in merge_streams(streams):
                yield item
        finally:
            self.open_jobs.discard(job)
            if timer is not None:
                timer.cancel()
            for stream in streams:
                await stream.aclose()

    async def complete(self, job: Job) -> dict:
        """Run a non-streaming request to the end; returns the response body."""
        finals: dict[int, RequestOutput] = {}
        try:
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for index, output in outputs:
                    finals[index] = output  # FINAL: only finished outputs come
        except APIError as error:
            self._finish(job, outcome_of(error.status_code, error.code), error)
            raise
        except KVServeError as exc:
            error = from_engine_error(exc)
            self._finish(job, outcome_of(error.status_code, error.code), error)
            raise error from exc
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

    def client_gone(self, job: Job) -> None:
        """A non-streaming client disconnected: log and meter what it got (the caller cancelled it)."""
        self._finish(job, "aborted", APIError(499, "client closed", "client_closed_request"))

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events: role chunk (chat), content deltas, finish chunks, usage, [DONE]."""
        latest = job.latest
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
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for index, output in outputs:
                    latest[index] = output  # this step's deltas, with the running counts
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
                            yield self.responses.sse(
                                job, [finish], latest, server_metrics(completion)
                            )
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away mid-stream; leaving this generator aborts the engine requests.
            self._finish(job, "aborted", APIError(499, "client closed", "client_closed_request"))
            raise
        except Exception as exc:  # headers are sent: the error travels as an event, then [DONE]
            if isinstance(exc, APIError):
                error = exc
            elif isinstance(exc, KVServeError):
                error = from_engine_error(exc)
            else:
                error = internal_error()
                logger.error("%s in stream %s", error.message, job.request_id, exc_info=exc)
            self._finish(job, outcome_of(error.status_code, error.code), error)
            yield f"data: {error.json()}\n\n"
            yield "data: [DONE]\n\n"
            return
        finals = job.so_far()  # the whole outputs, joined once
        self._record(job, finals)
        if job.include_usage:
            yield f"data: {json.dumps(self.responses.envelope(job, [], usage=self.responses.usage(job, finals)))}\n\n"
        yield "data: [DONE]\n\n"
