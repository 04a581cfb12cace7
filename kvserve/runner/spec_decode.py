"""Speculative decoding (docs/speculative-decoding.md): verification and the two proposers.

One target forward scores the last committed token plus the gamma proposals, giving gamma + 1 distributions.
Greedy verification accepts proposals while they equal the target's argmax and then emits the argmax, so the
output is exactly the target's greedy output. Stochastic verification accepts x ~ q with probability
min(1, p(x) / q(x)); on the first rejection it emits a sample of normalise(max(p - q, 0)) and stops; after all
are accepted it emits a bonus sample of p. Then the output is distributed exactly as the target's. p and q are
both taken after the same bias / min_tokens / temperature / top-k / top-p / min-p processing.

Proposers: n-gram lookup in the request's own tokens (no model; q is a point mass), or a draft model that
shares the target's block ids and tokenizer and keeps its own KV tensors.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kvserve.runner.sampler import sample_categorical


def leading_accepts(accept: torch.Tensor) -> torch.Tensor:
    """accept: [n, s] bool -> number of leading True per row, [n]."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(
    target_argmax: torch.Tensor, proposals: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax: [n, s + 1]; proposals: [n, s] -> (num_accepted [n], final token [n])."""
    num_accepted = leading_accepts(proposals == target_argmax[:, :-1])
    final = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, final


def verify_stochastic(
    p: torch.Tensor,
    q: torch.Tensor,
    proposals: torch.Tensor,
    uniforms: torch.Tensor,
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept/resample for n independent rows.

    p: [n, s + 1, V] target probabilities; q: [n, s, V] proposal probabilities; proposals: [n, s] drawn
    from q; uniforms: [n, s] in [0, 1). Returns (num_accepted [n], final token [n]): the final token is the
    residual sample at the first rejection, or the bonus sample from p[:, s] when all were accepted.
    """
    n, s = proposals.shape
    index = proposals.unsqueeze(2)
    p_x = p[:, :s].gather(2, index).squeeze(2)  # [n, s]
    q_x = q.gather(2, index).squeeze(2)
    # u < min(1, p/q)  <=>  u * q < p  (q(x) > 0 because x was drawn from q)
    num_accepted = leading_accepts(uniforms * q_x < p_x)
    rows = torch.arange(n, device=p.device)
    p_final = p[rows, num_accepted]  # [n, V]
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # q at position s is 0: bonus = p
    residual = (p_final - q_padded[rows, num_accepted]).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0, so any choice is exact.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_final)
    return num_accepted, sample_categorical(residual, generators, shared)


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from ngram_max down to
    ngram_min) in the request's prompt and output, and propose the tokens that followed it."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        if num_tokens <= 0:
            return []
        data = array("i", token_ids).tobytes()
        width = data.__len__() // max(len(token_ids), 1)  # bytes per token id
        limit = (len(token_ids) - 1) * width  # a match must end before the last token
        for n in range(min(self.ngram_max, len(token_ids) - 1), self.ngram_min - 1, -1):
            pattern = data[-n * width :]
            end = limit
            while (at := data.rfind(pattern, 0, end)) >= 0:
                if at % width == 0:  # on a token boundary
                    # Continue from the match; a continuation that runs into the end repeats itself
                    # (a periodic pattern), so extend with the proposals made so far.
                    start = at // width + n
                    extended = list(token_ids)
                    for i in range(num_tokens):
                        extended.append(extended[start + i])
                    return extended[len(token_ids) :]
                end = at + len(pattern) - 1  # look for an earlier match
        return []


@dataclass
class DraftJob:
    """One request's proposal work: catch up on committed tokens, then propose `num_tokens`."""

    token_ids: list[
        int
    ]  # committed tokens (prompt + output), the last one not yet in the target cache
    num_computed: int  # draft cache entries valid for positions [0, num_computed)
    block_ids: list[int]
    num_tokens: int
