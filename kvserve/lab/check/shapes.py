"""The batch-invariance check offline: each prompt alone, then in batch shapes, through the engine.

Shapes (docs/determinism.md): run-to-run repeat; batches of several sizes; neighbours much longer
than the prompt; chunked prefill alone and batched; a prefix-cache hit (the same prompt again on a
caching engine); speculative verification (n-gram proposals, alone and batched). Every shape runs
greedy, `ignore_eos`, with top-k log probabilities, and is compared with the solo run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.core.sampling_params import SamplingParams
from kvserve.lab.check.invariance import Position, ShapeResult, Trace, compare_shape

Prompt = str | list[int]


@dataclass(frozen=True)
class CheckConfig:
    """What the check generates and with which engines."""

    max_tokens: int = 24
    num_logprobs: int = 5
    batch_sizes: tuple[int, ...] = (2, 4, 8)
    chunk_tokens: int = 16  # the chunked-prefill engine's token budget per step
    num_long_neighbours: int = 3
    long_neighbour_tokens: int = 192
    num_speculative_tokens: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or not 2 <= self.num_logprobs <= 20:
            raise ValueError("need max_tokens >= 1 and 2 <= logprobs <= 20")
        if not self.batch_sizes or min(self.batch_sizes) < 2:
            raise ValueError("batch sizes must be >= 2")

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=self.num_logprobs,
        )


def trace_of(output) -> Trace:
    """A RequestOutput's first sample as a Trace (tokens keyed by id)."""
    sample = output.outputs[0]
    positions = tuple(
        Position(e.token_id, e.logprob, {t: lp for t, lp in e.top}) for e in sample.logprobs
    )
    return Trace(positions, output.num_cached_tokens, sample.num_spec_accepted)


def long_neighbours(cfg: CheckConfig, vocab_size: int, max_len: int) -> list[list[int]]:
    """Seeded random-token prompts, far longer than a typical check prompt."""
    rng = np.random.default_rng(cfg.seed + 1)
    length = max(2, min(cfg.long_neighbour_tokens, max_len - cfg.max_tokens - 1))
    return [
        [int(t) for t in rng.integers(3, vocab_size, size=length)]
        for _ in range(cfg.num_long_neighbours)
    ]


def groups(num_prompts: int, size: int) -> list[list[int]]:
    """Cover every prompt once in batches of `size`, topping the last batch up with other prompts
    (run as neighbours, not compared twice)."""
    out = []
    for start in range(0, num_prompts, size):
        members = list(range(start, min(start + size, num_prompts)))
        extra = [i % num_prompts for i in range(start + size, start + 2 * size)]
        out.append(members + [i for i in extra if i not in members][: size - len(members)])
    return out


def token_ids_without_tokenizer(llm, prompts: list[Prompt]) -> list[Prompt]:
    """Text prompts on a model without a tokenizer become fixed token ids of the text's length."""
    if llm.tokenizer is not None:
        return prompts
    vocab = llm.engine.config.model.vocab_size
    return [
        p
        if isinstance(p, list)
        else [(i * 31 + j * 7 + 3) % (vocab - 3) + 3 for j in range(len(p))]
        for i, p in enumerate(prompts)
    ]


EngineFactory = Callable[..., Any]  # (**engine options) -> kvserve.LLM


class OfflineCheck:
    """Runs the shapes on LLM engines built by `make_llm(**options)`."""

    def __init__(self, make_llm: EngineFactory, prompts: Sequence[Prompt], cfg: CheckConfig):
        if not prompts:
            raise ValueError("no prompts to check")
        self.make_llm, self.prompts, self.cfg = make_llm, list(prompts), cfg
        self.progress: Callable[[str], None] = lambda msg: None

    def _run(self, llm, prompts: list[Prompt]) -> list[Trace]:
        return [trace_of(o) for o in llm.generate(prompts, self.cfg.params)]

    def run(self) -> tuple[list[Trace], list[ShapeResult]]:
        """Long: the checks run in sequence against one server, each a few lines."""
        cfg = self.cfg
        base = self.make_llm(enable_prefix_caching=False)
        prompts = self.prompts = token_ids_without_tokenizer(base, self.prompts)
        n = len(prompts)
        self.progress("alone")
        refs = [self._run(base, [p])[0] for p in prompts]
        results = []

        def add(name: str, description: str, variants: dict[int, Trace], facts=None) -> None:
            self.progress(name)
            results.append(compare_shape(name, description, refs, variants, facts))

        add(
            "repeat",
            "each prompt alone, again",
            {i: self._run(base, [p])[0] for i, p in enumerate(prompts)},
        )
        for size in cfg.batch_sizes:
            variants = {}
            for members in groups(n, size):
                traces = self._run(base, [prompts[i] for i in members])
                for i, trace in zip(members, traces, strict=True):
                    variants.setdefault(i, trace)
            add(f"batch-{size}", f"batches of {size} prompts", variants, {"batch_size": size})
        vocab = base.engine.config.model.vocab_size
        longs = long_neighbours(cfg, vocab, base.engine.max_model_len)
        traces = self._run(base, prompts + longs)
        add(
            "long-neighbours",
            f"all prompts beside {len(longs)} prompts of {len(longs[0])} tokens",
            dict(enumerate(traces[:n])),
            {"neighbour_tokens": len(longs[0]), "num_neighbours": len(longs)},
        )
        del base
        chunked = self.make_llm(
            enable_prefix_caching=False, max_num_batched_tokens=cfg.chunk_tokens
        )
        facts = {"max_num_batched_tokens": cfg.chunk_tokens}
        add(
            "chunked-alone",
            f"each prompt alone, prefill in chunks of {cfg.chunk_tokens} tokens",
            {i: self._run(chunked, [p])[0] for i, p in enumerate(prompts)},
            facts,
        )
        add(
            "chunked-batch",
            f"all prompts at once, {cfg.chunk_tokens}-token step budget",
            dict(enumerate(self._run(chunked, prompts))),
            facts,
        )
        del chunked
        cached = self.make_llm(enable_prefix_caching=True)
        variants = {}
        for i, p in enumerate(prompts):
            self._run(cached, [p])  # fills the cache
            variants[i] = self._run(cached, [p])[0]
        add(
            "prefix-cache-hit",
            "each prompt again on a caching engine (its full blocks come from the cache)",
            variants,
            {"num_prompts_hit": sum(t.num_cached_tokens > 0 for t in variants.values())},
        )
        del cached
        spec = self.make_llm(
            enable_prefix_caching=False,
            speculative_method="ngram",
            num_speculative_tokens=cfg.num_speculative_tokens,
        )
        for name, description, variants in (
            (
                "spec-alone",
                "each prompt alone, n-gram speculative verification",
                {i: self._run(spec, [p])[0] for i, p in enumerate(prompts)},
            ),
            (
                "spec-batch",
                "all prompts at once, n-gram speculative verification",
                dict(enumerate(self._run(spec, prompts))),
            ),
        ):
            accepted = sum(t.num_spec_accepted for t in variants.values())
            add(
                name,
                description,
                variants,
                {"num_spec_accepted": accepted, "k": cfg.num_speculative_tokens},
            )
        return refs, results
