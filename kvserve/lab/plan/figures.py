"""The planner's workload and the latency and load figures it derives: plain frozen values shared by
planner.py and parallel.py (the tensor-parallel terms), which neither owns."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.lab.plan.model import PlanError


@dataclass(frozen=True)
class Workload:
    """Every request: `prompt_tokens` in (the first `shared_prefix_tokens` common to all),
    `output_tokens` out."""

    prompt_tokens: int = 2000
    output_tokens: int = 500
    shared_prefix_tokens: int = 0
    requests_per_day: float = 100_000

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise PlanError("prompt and output tokens must be at least 1")
        if not 0 <= self.shared_prefix_tokens < self.prompt_tokens:
            raise PlanError(
                "the shared prefix must be shorter than the prompt (the last prompt token is "
                "always computed)"
            )
        if self.requests_per_day < 0:
            raise PlanError("requests per day must be >= 0")

    @property
    def tokens_per_request(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def mean_decode_context(self) -> float:
        """Mean context of the decode steps: the k-th output token attends to prompt + k."""
        return self.prompt_tokens + self.output_tokens / 2


@dataclass(frozen=True)
class Latency:
    ttft_cold_s: float
    ttft_cached_s: float  # the shared prefix already cached
    tpot_solo_s: float
    tokens_per_s_solo: float
    solo_bound: str  # "memory" | "compute" (measured engine profile: also "kernel", "dispatch")
    e2e_solo_s: float
    tpot_max_batch_s: float | None
    tokens_per_s_max_batch: float | None  # aggregate, B / step
    per_sequence_tokens_per_s_max_batch: float | None
    max_batch_bound: str | None
    aggregate_limit_tokens_per_s: float  # BW / (k t)
    estimated_mbu_solo: float  # bytes per second moved / peak BW


@dataclass(frozen=True)
class Load:
    """Full load: max batch decoding, prefills in between (phases do not overlap)."""

    device_s_per_request: float
    requests_per_s: float
    output_tokens_per_s: float
    prefill_share: float  # of device time
