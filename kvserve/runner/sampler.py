"""Batched sampling: logit processors, greedy and random selection, and logprobs. No per-token Python loops.

Order (as vLLM): logit bias, min_tokens masking of stop tokens, repetition / presence / frequency penalties;
greedy rows take the argmax of the processed logits; random rows divide by temperature, apply top-k, top-p and
min-p, and sample by inverting the CDF with one uniform per row, which draws exactly from p and lets a seeded
request use its own generator. Logprobs are those of the model's raw distribution (before any
processing), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.core.outputs import TokenLogprob


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors (built by the runner from request states)."""

    temperature: torch.Tensor  # [S] float, 0 for greedy rows
    top_k: torch.Tensor  # [S] long, 0 = off
    top_p: torch.Tensor  # [S] float
    min_p: torch.Tensor  # [S] float
    generators: list[torch.Generator | None]  # per row; None = the runner's shared generator
    num_logprobs: list[int | None]  # per row
    # Sparse additions: (rows, token ids, values) for logit_bias; (rows, token ids) masked by min_tokens.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # Penalties (None when no row uses any).
    repetition_penalty: torch.Tensor | None = None  # [S]
    presence_penalty: torch.Tensor | None = None  # [S]
    frequency_penalty: torch.Tensor | None = None  # [S]
    output_counts: torch.Tensor | None = None  # [S, V] occurrences in the output so far
    prompt_mask: torch.Tensor | None = None  # [S, V] token appears in the prompt
    # Grammar masks: called on the processed logits, masks (in place) the rows that carry a grammar.
    constrain: Callable[[torch.Tensor], object] | None = None
    # Known on the host when the runner builds the batch (no device sync); None: read the tensors.
    host_all_greedy: bool | None = None
    host_random_rows: list[int] | None = None  # rows with temperature > 0
    host_use_top_k: bool | None = None  # some row has top_k > 0
    host_use_top_p: bool | None = None  # some row has top_p < 1
    host_use_min_p: bool | None = None  # some row has min_p > 0
    host_penalty_below_one: bool | None = None  # some row has repetition_penalty < 1

    @property
    def all_greedy(self) -> bool:
        if self.host_all_greedy is not None:
            return self.host_all_greedy
        return bool((self.temperature == 0).all())

    def random_rows(self) -> list[int]:
        if self.host_random_rows is not None:
            return self.host_random_rows
        return (self.temperature > 0).nonzero().squeeze(1).tolist()

    def uses(self, name: str) -> bool:
        """Whether some row uses top_k, top_p or min_p (`name`); from the host flag when set."""
        flag = getattr(self, f"host_use_{name}")
        if flag is not None:
            return flag
        if name == "top_k":
            return bool((self.top_k > 0).any())
        if name == "top_p":
            return bool((self.top_p < 1.0).any())
        return bool((self.min_p > 0).any())


# Past this magnitude distinct float32 values are at least ~7e22 apart, so a softmax over a row whose
# maximum is there is one-hot on that maximum at every temperature up to ~1e20 (a gap over the temperature
# of >= 700); and the limit divided by the smallest temperature (1e-5) stays finite.
LOGIT_LIMIT = 1e30


def collapse_overflow(logits: torch.Tensor, unscaled: torch.Tensor) -> torch.Tensor:
    """Rows where a repetition penalty below 1 pushed a logit past LOGIT_LIMIT (or to inf): their limit,
    0 for the largest such logit (ties share it) and -inf for every other token; exact at temperatures up
    to ~1e20 (above, the true distribution of such a row is flatter). Which one is largest is read
    from `unscaled` (the logits before the penalty), since ties at inf cannot tell. [S, V]"""
    over = logits > LOGIT_LIMIT
    top = unscaled.masked_fill(~over, float("-inf")).amax(dim=-1, keepdim=True)  # [S, 1]
    collapsed = torch.zeros_like(logits).masked_fill(~(over & (unscaled == top)), float("-inf"))
    return torch.where(over.any(dim=-1, keepdim=True), collapsed, logits)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.output_counts is None:
        return logits
    counts = batch.output_counts
    seen = (counts > 0) | batch.prompt_mask
    rep = batch.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    return logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Bias, min_tokens bans and penalties: what greedy and random selection both see."""
    if (
        batch.bias is None
        and batch.banned is None
        and batch.output_counts is None
        and batch.constrain is None
    ):
        return logits
    logits = logits.clone()
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    unpenalised, logits = logits, apply_penalties(logits, batch)
    if batch.banned is not None:
        rows, ids = batch.banned
        logits[rows, ids] = float("-inf")
    if batch.constrain is not None:
        batch.constrain(logits)
    if batch.output_counts is not None and batch.host_penalty_below_one is not False:
        # logit / penalty can leave float32's range (a penalty of 1e-45, or 1e-46, which float32 stores
        # as 0); after the masks, so that the token the limit keeps is one they allow.
        logits = collapse_overflow(logits, unpenalised)
    return logits


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for random rows: returns masked, scaled logits [S, V]."""
    temperature = batch.temperature.clamp_min(1e-5).unsqueeze(1)
    logits = logits / temperature
    use_top_k, use_top_p = batch.uses("top_k"), batch.uses("top_p")
    if use_top_k or use_top_p:
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        if use_top_k:
            k = torch.where(batch.top_k > 0, batch.top_k, vocab).clamp_max(vocab)
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [S, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if use_top_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = mass_before > batch.top_p.unsqueeze(1)
            drop[:, 0] = False
            threshold = (
                sorted_logits.masked_fill(drop, float("inf")).min(dim=-1, keepdim=True).values
            )
            logits = logits.masked_fill(logits < threshold, float("-inf"))
    if batch.uses("min_p"):
        probs = logits.softmax(dim=-1)
        keep = probs >= batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def sample_categorical(
    probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator
) -> torch.Tensor:
    """One index per row of `probs` [S, V] by inverting the CDF with one uniform draw per row.

    A seeded request draws its uniform from its own generator (one number per token, so its stream does
    not depend on the batch or the vocabulary size); the others share one generator. With `right=True`
    the search returns the first index whose cumulative mass exceeds u * total, so a zero-probability
    token is never chosen. The CDF is accumulated in float64 so the tail is not lost to rounding.
    """
    num_rows = probs.shape[0]
    uniforms = torch.empty(num_rows, dtype=torch.float64, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        draws = torch.rand(
            len(unseeded), generator=shared, dtype=torch.float64, device=probs.device
        )
        uniforms[torch.tensor(unseeded, device=probs.device)] = draws
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i] = torch.rand(
                1, generator=generator, dtype=torch.float64, device=probs.device
            )[0]
    return invert_cdf(probs, uniforms)


def invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The index whose cumulative mass first exceeds u * total, per row of `probs` [S, V] and uniform
    [S] (float64): a draw from each row when u is uniform."""
    cdf = probs.double().cumsum(dim=-1)  # [S, V]
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)


def peek_uniforms(generator: torch.Generator, count: int) -> torch.Tensor:
    """The next `count` uniforms a seeded request's generator will give `sample_categorical` (one a
    token), without taking them: speculative decoding uses the draw of each future position."""
    state = generator.get_state()
    draws = torch.rand(count, generator=generator, dtype=torch.float64, device=generator.device)
    generator.set_state(state)
    return draws


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary per row [R] (int64): the first maximal index, as `torch.argmax`.
    On CPU, fp32, through numpy's vectorised argmax: 9 us for one 50k row where `torch.argmax` took
    120 us on this project's 2-core machine (docs/performance.md, "The fused decode step"). Ties and
    NaN (a NaN counts as the maximum, its first index wins) come out as in torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def prepare(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(processed logits [R, V], probabilities [R, V] after temperature / top-k / top-p / min-p, or None
        when every row is greedy). Greedy rows take the argmax of the processed logits."""
        processed = process_logits(logits, batch)
        if batch.all_greedy:
            return processed, None
        return processed, filter_logits(processed, batch).softmax(dim=-1)

    def sample(
        self,
        processed: torch.Tensor,
        probs: torch.Tensor | None,
        batch: SamplingBatch,
        uniforms: dict[int, float] | None = None,
    ) -> torch.Tensor:
        """One token per row: argmax for greedy rows, a draw from `probs` for the others. [R]
        `uniforms`: rows whose draw uses this uniform instead of one taken from a generator (a
        draft's proposals for seeded requests: kvserve.runner.model_runner `_sample_draft_rows`)."""
        token_ids = greedy_argmax(processed)
        if probs is not None:
            given = uniforms or {}
            rows = [i for i in batch.random_rows() if i not in given]
            if rows:
                generators = [batch.generators[i] for i in rows]
                random_rows = torch.tensor(rows, dtype=torch.long, device=token_ids.device)
                token_ids[random_rows] = sample_categorical(
                    probs[random_rows], generators, self.generator
                )
            if given:
                fixed = torch.tensor(list(given), dtype=torch.long, device=token_ids.device)
                u = torch.tensor(list(given.values()), dtype=torch.float64, device=probs.device)
                token_ids[fixed] = invert_cdf(probs[fixed], u)
        return token_ids

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [S, V] float32
        processed, probs = self.prepare(logits, batch)
        token_ids = self.sample(processed, probs, batch)
        return token_ids.tolist(), self.logprobs(logits, token_ids, batch.num_logprobs)

    @staticmethod
    def logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, k in enumerate(num_logprobs) if k is not None]
        results: list[TokenLogprob | None] = [None] * len(num_logprobs)
        if not wanted:
            return results
        rows = torch.tensor(wanted, device=logits.device)
        logprobs = logits[rows].log_softmax(dim=-1)  # [W, V]
        chosen_ids = token_ids[rows]
        chosen = logprobs.gather(1, chosen_ids.unsqueeze(1))  # [W, 1]
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        max_k = max(num_logprobs[i] for i in wanted)
        top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
        chosen_list, ranks_list = chosen.squeeze(1).tolist(), ranks.tolist()
        top_v = top_values.tolist() if max_k else None
        top_i = top_ids.tolist() if max_k else None
        for j, row in enumerate(wanted):
            k = num_logprobs[row]
            top = tuple(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k else ()
            results[row] = TokenLogprob(int(chosen_ids[j]), chosen_list[j], ranks_list[j], top)
        return results
