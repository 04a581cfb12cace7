"""The offline API: `LLM(model_dir, **engine_options).generate(prompts, SamplingParams(...))`.

The engine options are the fields of `kvserve.engine.args.EngineArgs` (the same names, defaults and
help as the command line's flags)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from kvserve.config import EngineConfig
from kvserve.core.errors import InvalidRequestError
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import EngineArgs
from kvserve.engine.core import EngineCore
from kvserve.engine.output_processor import OutputKind
from kvserve.engine.outputs import RequestOutput

PromptType = str | Sequence[int]


class LLM:
    """Runs a local Hugging Face checkpoint, a GGUF file, or a built-in model (`smollm2-135m-instruct`,
    the default; `kvserve-demo`).

    `engine_options` are `EngineArgs` fields (`dtype`, `max_num_seqs`, `kv_cache_memory_bytes`, ...),
    validated by it: an unknown name or a wrong type raises `InvalidRequestError`."""

    def __init__(self, model: str | None = None, *, tokenizer=None, **engine_options) -> None:
        self.args = EngineArgs.from_options(model, **engine_options)
        self.engine = EngineCore(self.args.create_engine_config(), tokenizer=tokenizer)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, tokenizer=None) -> LLM:
        return cls(args.model, tokenizer=tokenizer, **args.options())

    # --- facts about the engine (read-only) -----------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The resolved, frozen engine configuration (model, cache, scheduler limits)."""
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        """KV-cache blocks of `config.cache.block_size` tokens the engine allocated."""
        return self.engine.num_blocks

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a request (unless `ignore_eos`)."""
        return self.engine.eos_token_ids

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so that the next prompts are computed in full. Only
        between `generate` calls (no request holds a block); returns False when not possible."""
        return self.engine.kv_manager.pool.reset_prefix_cache()

    def encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model directory has no tokenizer: pass token ids instead of text",
                    "prompt",
                )
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        All prompts are validated before any is queued, so a bad one raises without leaving others behind.
        """
        request_ids = self._add_all(prompts, sampling_params, cache_salt, OutputKind.FINAL)
        return self.run_until_done(request_ids)

    def _add_all(
        self, prompts, sampling_params, cache_salt: str | None, kind: OutputKind
    ) -> list[str]:
        """Validate every prompt, then queue them all; returns their request ids in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = _broadcast(sampling_params, len(prompts))
        # Validated once, all before any is queued: a bad prompt leaves nothing behind.
        validated = [
            self.engine.validate(self.encode(p), params)
            for p, params in zip(prompts, params_list, strict=True)
        ]
        request_ids = []
        for prompt, request in zip(prompts, validated, strict=True):
            request_id = f"offline-{next(self._ids)}"
            text = prompt if isinstance(prompt, str) else None
            self.engine.add_request(
                request_id, request, prompt=text, cache_salt=cache_salt, output_kind=kind
            )
            request_ids.append(request_id)
        return request_ids

    def generate_steps(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Iterator[dict[int, RequestOutput]]:
        """`generate`, one engine step at a time: the prompts are validated and queued now; each
        `next()` runs one step and returns {prompt index: its output} for the prompts that changed in
        it. It ends when every prompt has finished; closing it early aborts the rest."""
        request_ids = self._add_all(prompts, sampling_params, cache_salt, OutputKind.CUMULATIVE)
        return self._steps(request_ids)

    def _steps(self, request_ids: list[str]) -> Iterator[dict[int, RequestOutput]]:
        index = {request_id: i for i, request_id in enumerate(request_ids)}
        pending = set(request_ids)
        try:
            while pending and self.engine.has_unfinished_requests():
                changed = {}
                for output in self.engine.step():
                    if output.request_id in index:
                        changed[index[output.request_id]] = output
                        if output.finished:
                            pending.discard(output.request_id)
                yield changed
        finally:
            for request_id in pending:  # closed early or interrupted: never leave blocks held
                self.engine.abort_request(request_id)

    def run_until_done(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        try:
            while len(finished) < len(request_ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
        except BaseException:
            for request_id in request_ids:  # never leave blocks held by an interrupted call
                self.engine.abort_request(request_id)
            raise
        return [finished[r] for r in request_ids]


def _broadcast(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise InvalidRequestError(
            f"got {len(sampling_params)} sampling params for {count} prompts", "sampling_params"
        )
    return list(sampling_params)
