"""Simulated workloads: which requests arrive when, with how many prompt and output tokens.

Two sources, both reusing the bench's own pure functions so that a simulation and a load test of
the same workload see the same requests:

- synthetic: open-loop gamma / Poisson arrivals from `kvserve.lab.bench.arrivals.schedule` (gaps drawn
  at unit rate and scaled by 1/rate, so a sweep's rates share one arrival pattern) and lengths from
  `kvserve.lab.bench.workloads.LengthDist`, drawn per request index from the bench's length stream, so
  `kvserve simulate` and `kvserve bench serve --workload random` with the same seed, lengths, rate,
  warm-up and count get the same prompt/output lengths and send offsets;
- a trace: a bench run's raw `requests.jsonl` (send times, the server's prompt and completion token
  counts, phases), or a bench arrival trace (one time per line, or JSON with `timestamp` and
  optional `input_len` / `output_len`).

Output lengths are exact: the simulator runs every request with ignore_eos and max_tokens = its
output length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.lab.bench.arrivals import ArrivalSpec, load_trace, schedule
from kvserve.lab.bench.records import BenchError, RequestRecord
from kvserve.lab.bench.workloads import LengthDist

# The random stream kvserve.lab.bench.workloads draws request i's lengths from: np.random.default_rng(
# [seed, 1, i]). tests/test_sim_workload.py pins the equality with bench.workloads.build_workload.
BENCH_LENGTH_STREAM = 1


class SimError(ValueError):
    """Bad simulator input (workload, policy, cost model); the message says what to fix."""


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated workload. `arrival_s` is its send time on the run clock."""

    index: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    phase: str = "measured"  # "warmup" | "measured", as in the bench's records

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or self.num_output_tokens < 1:
            raise SimError(
                f"request {self.index}: prompt and output need at least one token, got "
                f"{self.num_prompt_tokens} and {self.num_output_tokens}"
            )


@dataclass(frozen=True)
class Workload:
    """A seeded synthetic workload (lengths and arrival pattern); `requests(rate)` realises it."""

    input_len: LengthDist
    output_len: LengthDist
    num_requests: int
    num_warmup: int = 0
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_warmup < 0:
            raise SimError("need num_requests >= 1 and num_warmup >= 0")

    def lengths(self, index: int) -> tuple[int, int]:
        """(prompt tokens, output tokens) of request `index`: the bench's draw for that index."""
        rng = np.random.default_rng([self.seed, BENCH_LENGTH_STREAM, index])
        return self.input_len.sample(rng), self.output_len.sample(rng)

    def requests(self, rate: float) -> tuple[SimRequest, ...]:
        """Warm-up then measured requests, sent at the bench's schedule for this rate (inf: all at
        t = 0)."""
        try:
            if math.isinf(rate):
                spec = ArrivalSpec("inf")
            else:
                spec = ArrivalSpec("gamma", rate, self.burstiness)
            offsets = schedule(spec, self.seed, self.num_warmup, self.num_requests, None)
        except BenchError as exc:
            raise SimError(str(exc)) from exc
        out = []
        for i, t in enumerate(offsets):
            num_in, num_out = self.lengths(i)
            phase = "warmup" if i < self.num_warmup else "measured"
            out.append(SimRequest(i, float(t), num_in, num_out, phase))
        return tuple(out)

    def describe(self) -> dict:
        shape = self.burstiness
        return {
            "kind": "synthetic",
            "input_len": self.input_len.describe(),
            "output_len": self.output_len.describe(),
            "num_requests": self.num_requests,
            "num_warmup": self.num_warmup,
            "arrivals": "poisson" if shape == 1.0 else f"gamma(shape={shape:g})",
            "seed": self.seed,
        }


def _is_bench_records(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(obj, dict) and "t_scheduled_s" in obj and "request_id" in obj
    return False


def requests_from_bench_records(records: list[RequestRecord]) -> tuple[SimRequest, ...]:
    """Replay a bench run: each request arrives when the client sent it (its scheduled time if it
    was never sent), with the server's prompt token count (chat template included) and, when it
    completed, the number of tokens the server generated (else its max_tokens)."""
    out = []
    for rec in sorted(records, key=lambda r: (r.t_scheduled_s, r.index)):
        t = rec.t_send_s if rec.t_send_s is not None else rec.t_scheduled_s
        num_in = rec.num_prompt_tokens_server or rec.num_prompt_tokens_client
        if num_in is None:
            raise SimError(f"bench record {rec.request_id} has no prompt token count")
        num_out = rec.max_tokens
        if rec.outcome == "ok" and rec.num_completion_tokens_server:
            num_out = rec.num_completion_tokens_server
        out.append(SimRequest(rec.index, t, int(num_in), int(num_out), rec.phase))
    if not out:
        raise SimError("the bench records hold no request")
    origin = min(r.arrival_s for r in out)
    return tuple(
        SimRequest(r.index, r.arrival_s - origin, r.num_prompt_tokens, r.num_output_tokens, r.phase)
        for r in out
    )


def requests_from_trace(
    path: str | Path, input_len: LengthDist, output_len: LengthDist, seed: int = 0
) -> tuple[SimRequest, ...]:
    """A bench run's `requests.jsonl`, or an arrival trace whose missing lengths are drawn from the
    given distributions (per index, as in `Workload.lengths`)."""
    path = Path(path)
    if not path.is_file():
        raise SimError(f"trace {path} does not exist")
    if _is_bench_records(path):
        from kvserve.lab.bench.records import read_jsonl

        return requests_from_bench_records(read_jsonl(path))
    try:
        trace = load_trace(path)
    except BenchError as exc:
        raise SimError(str(exc)) from exc
    draw = Workload(input_len, output_len, len(trace.offsets_s), seed=seed)
    out = []
    for i, t in enumerate(trace.offsets_s):
        num_in, num_out = draw.lengths(i)
        if trace.lengths is not None:
            num_in = trace.lengths[i][0] or num_in
            num_out = trace.lengths[i][1] or num_out
        out.append(SimRequest(i, float(t), int(num_in), int(num_out)))
    return tuple(out)


def scale_arrivals(requests: tuple[SimRequest, ...], factor: float) -> tuple[SimRequest, ...]:
    """The same requests with every arrival time divided by `factor` (a trace replayed faster)."""
    return tuple(
        SimRequest(r.index, r.arrival_s / factor, r.num_prompt_tokens, r.num_output_tokens, r.phase)
        for r in requests
    )


def nominal_rate(requests: tuple[SimRequest, ...]) -> float | None:
    """(n - 1) / span of the measured arrivals; inf when they all arrive at once."""
    times = sorted(r.arrival_s for r in requests if r.phase == "measured")
    if len(times) < 2:
        return None
    span = times[-1] - times[0]
    return (len(times) - 1) / span if span > 0 else math.inf
