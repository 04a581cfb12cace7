"""Speculative decoding in the simulator: proposals, their verification and the draft's cost.

The real scheduler schedules the verification (a request's last token plus its k proposals in one
chunk, `num_spec_tokens = k`) exactly as in the engine; the cost model prices that chunk like any
other multi-token chunk. What the simulator must supply is what the runner would: how many
proposals the target accepted, and new proposals. Acceptance follows the independence model
(docs/simulator.md): each proposal is accepted with probability alpha given the previous ones
were, so a verification of k proposals commits `a + 1` tokens, a ~ min(Geometric, k), with mean
(1 - alpha^(k+1)) / (1 - alpha). The draft's work is its own cost term: `draft_step_s` per
proposal position per step (the draft proposes k tokens one forward at a time, the batch
together), plus `draft_token_s` per proposed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.core.outputs import SchedulerOutput
from kvserve.lab.sim.cost import CostModel
from kvserve.lab.sim.workload import SimError


@dataclass(frozen=True)
class SpecModel:
    """k proposals per step, accepted with probability `acceptance` each (independence model)."""

    num_speculative_tokens: int
    acceptance: float
    draft_step_s: float = 0.0
    draft_token_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise SimError("speculative decoding needs k >= 1 proposals")
        if not 0.0 <= self.acceptance < 1.0:
            raise SimError(f"acceptance must be in [0, 1), got {self.acceptance}")
        if self.draft_step_s < 0 or self.draft_token_s < 0:
            raise SimError("draft costs must be >= 0")

    @property
    def expected_tokens_per_verify(self) -> float:
        a, k = self.acceptance, self.num_speculative_tokens
        return (1 - a ** (k + 1)) / (1 - a)

    def describe(self) -> dict[str, Any]:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "acceptance": self.acceptance,
            "draft_step_s": self.draft_step_s,
            "draft_token_s": self.draft_token_s,
            "expected_tokens_per_verify": self.expected_tokens_per_verify,
        }


@dataclass
class Acceptance:
    """Seeded draws of accepted proposal counts."""

    spec: SpecModel
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def num_accepted(self, num_proposed: int) -> int:
        accepted = 0
        while accepted < num_proposed and self._rng.random() < self.spec.acceptance:
            accepted += 1
        return accepted


@dataclass
class SpeculativeCost:
    """`base`'s step cost plus the draft's: k forwards of the batch of speculating requests."""

    base: CostModel
    spec: SpecModel

    @property
    def request_overhead_s(self) -> float:
        return float(getattr(self.base, "request_overhead_s", 0.0))

    @property
    def pickup_s(self) -> float:
        return float(getattr(self.base, "pickup_s", 0.0))

    @property
    def delivery(self):
        return getattr(self.base, "delivery", None)

    def reset(self) -> None:
        reset = getattr(self.base, "reset", None)
        if reset is not None:
            reset()

    def step_s(self, scheduler_output: SchedulerOutput) -> float:
        base_s = self.base.step_s(scheduler_output)
        proposing = sum(1 for c in scheduler_output.chunks if c.sample)
        if not proposing:
            return base_s
        k = self.spec.num_speculative_tokens
        return base_s + k * self.spec.draft_step_s + k * proposing * self.spec.draft_token_s

    def describe(self) -> dict[str, Any]:
        return self.base.describe() | {"speculative": self.spec.describe()}
