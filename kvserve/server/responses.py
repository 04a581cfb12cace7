"""OpenAI response bodies and stream chunks: choices, logprobs, usage, and kvserve's extensions."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from functools import lru_cache

from kvserve.core.outputs import TokenLogprob
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server import tools
from kvserve.server.logprob_text import TokenBytes, TokenTexts, chat_logprobs, completion_logprobs


@dataclass(eq=False)  # identity: jobs live in sets
class Job:
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
    user: str | None = None  # the request's user / safety_identifier, for the request log
    arrival_time: float = field(default_factory=time.monotonic)  # prepared: the engine's arrival
    received: float | None = None  # when its preparation began (--request-timeout counts from here)
    finished_choices: set[int] = field(default_factory=set)  # streamed finish chunks
    key_id: str | None = None  # the caller's API key id (metering)
    num_reserved: int = 0  # waiting-queue places held for it and not yet used
    # no grammar, or one the engine compiled before; a new one waits its turn in the grammar queue
    grammar_known: bool = False
    max_tokens_field: str = "max_tokens"  # the name the client sent (max_completion_tokens in chat)
    streams: list = field(default_factory=list)  # the engine's request streams, once started
    # a stream's newest output per prompt: that step's deltas with the running counts (continuous usage)
    latest: dict[int, RequestOutput] = field(default_factory=dict)
    accounted: bool = False  # counted, metered and logged (exactly once)

    # per choice: the logprob token-text state (streamed chunks continue where the last one ended)
    token_texts: dict[int, TokenTexts] = field(default_factory=dict)
    tool_plan: tools.ToolPlan | None = None  # chat with tools: calls are parsed from the output
    tool_parser: tools.ToolParser | None = None
    tool_streams: dict[int, tools.ToolStream] = field(default_factory=dict)  # per choice

    def tool_stream(self, index: int) -> tools.ToolStream:
        if index not in self.tool_streams:
            self.tool_streams[index] = tools.ToolStream(self.tool_plan, self.tool_parser)
        return self.tool_streams[index]

    def so_far(self) -> dict[int, RequestOutput]:
        """Every prompt's whole output as received until now (finished or not): {prompt index: it}."""
        return {index: stream.so_far() for index, stream in enumerate(self.streams)}

    def interrupt(self, error: BaseException) -> None:
        """End the job with `error` (time budget or grace period over): raised where it reads outputs."""
        for stream in self.streams:
            stream.interrupt(error)


class ResponseBuilder:
    """Shapes engine outputs as OpenAI chat / completions bodies and SSE chunks."""

    def __init__(self, served_model_name: str, fingerprint: str, tokenizer) -> None:
        self.served_model_name = served_model_name
        self.fingerprint = fingerprint
        self.tokenizer = tokenizer
        self.token_text = lru_cache(maxsize=65536)(self.decode_token)
        self.token_bytes = TokenBytes(tokenizer) if tokenizer is not None else None

    def envelope(self, job: Job, choices: list[dict], usage=None, with_usage_key=False) -> dict:
        body = {
            "id": job.request_id,
            "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": self.served_model_name,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None or with_usage_key:
            body["usage"] = usage
        return body

    def sse(
        self, job: Job, choices: list[dict], latest: dict[int, RequestOutput], metrics=None
    ) -> str:
        usage = self.usage(job, latest) if job.continuous_usage else None
        body = self.envelope(job, choices, usage=usage, with_usage_key=job.include_usage)
        if metrics:
            body["metrics"] = metrics
        return f"data: {json.dumps(body)}\n\n"

    def delta_choice(self, job: Job, index: int, c: CompletionOutput) -> dict:
        logprobs = self.logprobs(job, index, c.delta_logprobs) if c.delta_logprobs else None
        if job.kind == "chat":
            delta = {"content": c.delta_text}
            if job.tool_parser is not None:
                delta = job.tool_stream(index).delta(c.delta_text, final=False)
            return {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": None,
            }
        return {"index": index, "text": c.delta_text, "logprobs": logprobs, "finish_reason": None}

    def finish_choice(self, job: Job, index: int, c: CompletionOutput) -> dict:
        if job.kind == "chat":
            choice = {
                "index": index,
                "delta": {},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            if job.tool_parser is not None:
                stream = job.tool_stream(index)
                choice["delta"] = stream.delta("", final=True)
                choice["finish_reason"] = stream.finish_reason(c.finish_reason)
        else:
            choice = {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
        return with_structured(choice, c)

    def choice(self, job: Job, prompt_index: int, c: CompletionOutput) -> dict:
        index = prompt_index * job.params.n + c.index
        logprobs = self.logprobs(job, index, c.logprobs) if c.logprobs is not None else None
        if job.kind == "chat":
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if job.tool_parser is not None:
                message, reason = tools.message(job.tool_plan, job.tool_parser, c.text, reason)
            return with_structured(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                },
                c,
            )
        return with_structured(
            {
                "index": index,
                "text": c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            },
            c,
        )

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def logprobs(self, job: Job, index: int, entries: list[TokenLogprob]) -> dict:
        """Logprobs of choice `index`'s next entries; token texts are their text in context."""
        if self.token_bytes is not None:
            texts = job.token_texts.get(index)
            if texts is None:
                prompt_ids = job.prompt_token_ids[index // job.params.n]
                texts = TokenTexts(
                    self.tokenizer, self.token_bytes, prompt_ids, job.params.skip_special_tokens
                )
                job.token_texts[index] = texts
            return (chat_logprobs if job.kind == "chat" else completion_logprobs)(texts, entries)
        text = self.token_text  # no tokenizer: token_id:N
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

    def usage(self, job: Job, outputs: dict[int, RequestOutput]) -> dict:
        prompt_tokens = sum(len(ids) for ids in job.prompt_token_ids)
        completion_tokens = sum(c.num_tokens for o in outputs.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def server_metrics(completion: CompletionOutput) -> dict | None:
    """Server-side timings of one sample (a kvserve extension; clients that do not know it ignore it):
    queue time is admission - arrival, which a client cannot measure (docs/metrics.md)."""
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


def with_structured(choice: dict, completion: CompletionOutput) -> dict:
    """Constrained outputs say whether the document is complete: one cut short by max_tokens (finish
    reason `length`) or a stop string may not parse, and the response must not suggest otherwise."""
    if completion.structured_complete is not None:
        choice["structured_output"] = {"complete": completion.structured_complete}
    return choice
