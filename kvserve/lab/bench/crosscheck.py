"""Two load tools' raw per-request timings mapped onto one set of definitions (docs/simulator.md,
"load tool cross-check"), so that `kvserve bench serve` and GuideLLM can be compared number for
number.

Per request, both tools record four instants and a token count:

| instant | kvserve `requests.jsonl`            | GuideLLM `requests[...].info.timings` |
|---------|-------------------------------------|----------------------------------------|
| start   | `t_send_s`                          | `request_start`                        |
| first   | first event carrying text           | `first_token_iteration`                |
| last    | last event carrying text            | `last_token_iteration`                 |
| end     | `t_end_s`                           | `request_end`                          |
| n_out   | server `completion_tokens`          | `output_tokens`                        |

Definitions, the same for both tools:
- TTFT = first - start.
- decode time per token = (last - first) / (n_out - 1): kvserve calls it TPOT, GuideLLM calls
  it ITL ("inter_token_latency_ms"). GuideLLM's ITL percentiles weigh each request by n_out - 1
  (one sample per decoded token), kvserve's TPOT percentiles weigh requests alike; with forced,
  equal output lengths the two are the same distribution.
- GuideLLM's TPOT = (end - start) / n_out (it includes TTFT); kvserve has no such metric.
- kvserve's chunk-level ITL (every gap between text events) has no GuideLLM counterpart.
- output tok/s = total n_out / (last end - first start) over the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvserve.lab.bench.records import RequestRecord


@dataclass(frozen=True)
class Timing:
    """One completed request's instants (seconds on the tool's clock) and output tokens."""

    start_s: float
    first_s: float
    last_s: float
    end_s: float
    num_output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.start_s

    @property
    def decode_s_per_token(self) -> float | None:
        n = self.num_output_tokens
        return (self.last_s - self.first_s) / (n - 1) if n > 1 else None

    @property
    def latency_s_per_output_token(self) -> float | None:
        """GuideLLM's TPOT: the whole request over its output tokens."""
        n = self.num_output_tokens
        return (self.end_s - self.start_s) / n if n > 0 else None


def timings_from_kvserve(records: Iterable[RequestRecord]) -> list[Timing]:
    """Measured, completed requests of a kvserve run."""
    out = []
    for r in records:
        if r.phase != "measured" or r.outcome != "ok" or r.t_send_s is None:
            continue
        text = [e.t_s for e in r.events if e.num_chars > 0]
        n = r.num_completion_tokens_server
        if not text or not n:
            continue
        out.append(Timing(r.t_send_s, text[0], text[-1], r.t_end_s, int(n)))
    return out


def timings_from_guidellm(benchmark: dict) -> list[Timing]:
    """Successful requests of one GuideLLM benchmark (an entry of its JSON `benchmarks`)."""
    out = []
    for req in benchmark["requests"]["successful"]:
        t = req["info"]["timings"]
        first = t.get("first_token_iteration") or t.get("first_request_iteration")
        last = t.get("last_token_iteration") or t.get("last_request_iteration")
        if first is None or last is None:
            continue
        out.append(
            Timing(t["request_start"], first, last, t["request_end"], int(req["output_tokens"]))
        )
    return out


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def mapped_metrics(timings: list[Timing]) -> dict:
    """The shared definitions over one run (seconds; percentiles interpolate linearly)."""
    ttft = [t.ttft_s for t in timings]
    decode = [d for t in timings if (d := t.decode_s_per_token) is not None]
    whole = [d for t in timings if (d := t.latency_s_per_output_token) is not None]
    weighted = [
        d
        for t in timings
        if (d := t.decode_s_per_token) is not None
        for _ in range(t.num_output_tokens - 1)
    ]
    window = max(t.end_s for t in timings) - min(t.start_s for t in timings) if timings else 0
    return {
        "num_requests": len(timings),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "decode_per_token_p50_s": _pct(decode, 50),
        "decode_per_token_p99_s": _pct(decode, 99),
        "decode_per_token_token_weighted_p50_s": _pct(weighted, 50),
        "latency_per_output_token_p50_s": _pct(whole, 50),
        "output_tokens_per_s": sum(t.num_output_tokens for t in timings) / window
        if window > 0
        else None,
    }


def guidellm_reported(benchmark: dict) -> dict:
    """GuideLLM's own headline numbers for one benchmark, in seconds."""
    m = benchmark["metrics"]

    def stat(name: str, key: str) -> float | None:
        s = m.get(name, {}).get("successful", {})
        value = s.get("percentiles", {}).get(key) if key.startswith("p") else s.get(key)
        return None if value is None else value / 1e3

    return {
        "ttft_p50_s": stat("time_to_first_token_ms", "p50"),
        "ttft_p99_s": stat("time_to_first_token_ms", "p99"),
        "itl_p50_s": stat("inter_token_latency_ms", "p50"),
        "itl_p99_s": stat("inter_token_latency_ms", "p99"),
        "tpot_p50_s": stat("time_per_output_token_ms", "p50"),
    }


def kvserve_reported(summary: dict) -> dict:
    """kvserve bench serve's own headline numbers (summary.json), in seconds."""
    lat = summary.get("latency_s", {})
    return {
        "ttft_p50_s": lat.get("ttft", {}).get("p50"),
        "ttft_p99_s": lat.get("ttft", {}).get("p99"),
        "tpot_p50_s": lat.get("tpot", {}).get("p50"),
        "tpot_p99_s": lat.get("tpot", {}).get("p99"),
        "chunk_itl_p50_s": lat.get("itl", {}).get("p50"),
        "output_tokens_per_s": summary.get("throughput", {}).get("output_tokens_per_s"),
    }
