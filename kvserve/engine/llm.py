"""The offline API: `LLM(model_dir, **engine_options).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvserve.core.errors import InvalidRequestError
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.args import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput

PromptType = str | Sequence[int]


class LLM:
    """Runs a local Hugging Face checkpoint, or a built-in model (`kvserve-demo`, the default). Engine options are those of `build_engine_config`
    (dtype, device, max_model_len, max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
    kv_cache_memory_bytes, enable_prefix_caching, admission, seed, kv_cache_dtype, attention_backend,
    quantization)."""

    def __init__(self, model: str | None = None, *, tokenizer=None, **engine_options) -> None:
        self.engine = LLMEngine(build_engine_config(model, **engine_options), tokenizer=tokenizer)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = _broadcast(sampling_params, len(prompts))
        encoded = [self.encode(p) for p in prompts]
        for token_ids, params in zip(encoded, params_list, strict=True):
            self.engine.validate(token_ids, params)
        request_ids = []
        for prompt, token_ids, params in zip(prompts, encoded, params_list, strict=True):
            request_id = f"offline-{next(self._ids)}"
            text = prompt if isinstance(prompt, str) else None
            self.engine.add_request(
                request_id, token_ids, params, prompt=text, cache_salt=cache_salt
            )
            request_ids.append(request_id)
        return self.run_until_done(request_ids)

    def run_until_done(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(request_ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
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
