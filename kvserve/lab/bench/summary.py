"""A run's summary from its raw records: window, counts, throughput, latency, goodput, load-test
checks.

Phases (docs/load-tests.md): warm-up requests are labelled and excluded. The measured window runs from
the first measured send to the end of the last measured request; within it, "steady" ends at the
last measured send and "drain" is the rest. Throughput = total over completed measured requests /
measured window (never a sum of per-request rates); input tokens are reported as processed, never as
generated.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from kvserve.lab.bench.arrivals import gap_stats
from kvserve.lab.bench.metrics import (
    Percentiles,
    RequestMetrics,
    latency_table,
    pooled_samples,
    request_metrics,
    tokens_per_chunk_histogram,
    tokens_per_text_chunk,
)
from kvserve.lab.bench.records import OUTCOMES, RequestRecord
from kvserve.lab.bench.slo import ObjectiveSet, evaluate

PREFILL_SHARE_LIMIT = 0.30  # docs/load-tests.md: above this, the run is mostly measuring prefill
LITTLE_TOLERANCE = 0.15
LOOP_LAG_WARN_S = 0.010
CPU_WARN_FRACTION = 0.8


def measurement_window(records: Sequence[RequestRecord]) -> dict | None:
    sent = [r for r in records if r.phase == "measured" and r.t_send_s is not None]
    if not sent:
        return None
    start = min(r.t_send_s for r in sent)
    steady_end = max(r.t_send_s for r in sent)
    end = max(r.t_end_s for r in sent)
    return {
        "start_s": start,
        "steady_end_s": steady_end,
        "end_s": end,
        "duration_s": end - start,
        "steady_s": steady_end - start,
        "drain_s": end - steady_end,
    }


def littles_law(records: Sequence[RequestRecord], start_s: float, end_s: float) -> dict:
    """Mean number in system (time average over [start, end], every sent request of any phase or
    outcome) against completed rate x mean time in system (requests that completed ok inside the
    interval)."""
    span = end_s - start_s
    if span <= 0:
        return {"interval_s": [start_s, end_s], "note": "empty interval"}
    in_system_s = 0.0
    for r in records:
        if r.t_send_s is not None and r.t_end_s is not None:
            in_system_s += max(0.0, min(r.t_end_s, end_s) - max(r.t_send_s, start_s))
    done = [r for r in records if r.outcome == "ok" and start_s <= r.t_end_s <= end_s]
    mean_in_system = in_system_s / span
    completed_rate = len(done) / span
    mean_time_s = float(np.mean([r.t_end_s - r.t_send_s for r in done])) if done else None
    predicted = completed_rate * mean_time_s if mean_time_s is not None else None
    ratio = mean_in_system / predicted if predicted else None
    # L = lambda W holds on any sample path up to the requests in flight at the interval's edges.
    # Those are many when the queue grows (overload) or the interval is only a few times in system
    # long: either way the run is not a stable one to quote.
    spans = span / mean_time_s if mean_time_s else None
    holds = abs(ratio - 1.0) <= LITTLE_TOLERANCE if ratio is not None else None
    return {
        "interval_s": [start_s, end_s],
        "mean_in_system": mean_in_system,
        "completed_rate_rps": completed_rate,
        "mean_time_in_system_s": mean_time_s,
        "rate_x_time": predicted,
        "ratio": ratio,
        "interval_over_time_in_system": spans,
        "holds": holds,  # None: nothing completed in the interval
        "tolerance": LITTLE_TOLERANCE,
    }


def wall_clock_decomposition(
    metrics: Sequence[RequestMetrics], window_s: float, prefill_tok_s: float | None = None
) -> dict:
    """wall ~= total prompt tokens / prefill speed + longest output / per-request decode speed.

    Without a measured prefill speed, it is estimated as the p90 over requests of prompt tokens /
    (TTFT - queue time when reported): TTFT also holds queueing and the first decode step, so this
    underestimates the speed and overestimates the prefill share.
    """
    prompts = [m.num_prompt_tokens for m in metrics if m.num_prompt_tokens]
    source = "given (--prefill-speed)"
    if prefill_tok_s is None:
        speeds = [
            m.num_prompt_tokens / (m.ttft_s - (m.queue_time_s or 0.0))
            for m in metrics
            if m.num_prompt_tokens and m.ttft_s - (m.queue_time_s or 0.0) > 0
        ]
        prefill_tok_s = float(np.percentile(speeds, 90)) if speeds else None
        source = "client estimate: p90 of prompt tokens / (TTFT - reported queue time)"
    tpots = [m.tpot_s for m in metrics if m.tpot_s]
    decode_tok_s = 1.0 / float(np.median(tpots)) if tpots else None
    longest = max((m.num_output_tokens or 0 for m in metrics), default=0)
    prefill_s = sum(prompts) / prefill_tok_s if prefill_tok_s else None
    decode_s = longest / decode_tok_s if decode_tok_s else None
    share = prefill_s / window_s if prefill_s is not None and window_s > 0 else None
    note = None
    if share is not None and share > 1.0:
        note = (
            "estimate exceeds the wall clock: prefill overlaps (batching) or the speed estimate is "
        )
        note += "too low; pass a measured --prefill-speed"
    return {
        "total_prompt_tokens": sum(prompts),
        "prefill_tok_s": prefill_tok_s,
        "prefill_speed_source": source,
        "per_request_decode_tok_s": decode_tok_s,
        "longest_output_tokens": longest,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "estimated_wall_s": prefill_s + decode_s if None not in (prefill_s, decode_s) else None,
        "wall_s": window_s,
        "prefill_share": share,
        "mostly_prefill": share is not None and share > PREFILL_SHARE_LIMIT,
        "note": note,
    }


def token_count_checks(records: Sequence[RequestRecord]) -> dict:
    """Client-side token counts against the server's usage, over completed requests."""
    done = [r for r in records if r.outcome == "ok" and r.num_completion_tokens_server is not None]
    chunk_cmp = [(sum(c), r) for r in done if (c := tokens_per_text_chunk(r)) is not None]
    retok = [r for r in done if r.num_completion_tokens_retokenized is not None]
    return {
        "num_with_usage": len(done),
        "num_chunk_counts_compared": len(chunk_cmp),
        "num_chunk_count_mismatches": sum(
            n != r.num_completion_tokens_server for n, r in chunk_cmp
        ),
        "num_retokenized_compared": len(retok),
        "num_retokenized_mismatches": sum(
            r.num_completion_tokens_retokenized != r.num_completion_tokens_server for r in retok
        ),
    }


def summarize(
    records: Sequence[RequestRecord],
    *,
    objective_sets: Sequence[ObjectiveSet] = (),
    nominal_rate: float | None = None,
    loop_lag_s: Sequence[float] = (),
    cpu_s: float | None = None,
    wall_s: float | None = None,
    prefill_tok_s: float | None = None,
) -> dict:
    measured = [r for r in records if r.phase == "measured"]
    counts = Counter(r.outcome for r in measured)
    out: dict = {
        "counts": {"measured": len(measured)}
        | {k: counts.get(k, 0) for k in OUTCOMES}
        | {"warmup": sum(r.phase == "warmup" for r in records)},
        "failures_by_reason": failures_by_reason(measured),
        "client": _client_section(loop_lag_s, cpu_s, wall_s),
        "token_count_checks": token_count_checks(measured),
    }
    window = measurement_window(records)
    out["window"] = window
    if window is None:
        return out
    span = window["duration_s"]
    completed = [m for r in measured if (m := request_metrics(r)) is not None]
    pooled = pooled_samples(completed)
    num_out = sum(m.num_output_tokens or 0 for m in completed)
    num_in = sum(m.num_prompt_tokens or 0 for m in completed)
    out["throughput"] = {
        "num_completed": len(completed),
        "requests_per_s": len(completed) / span if span > 0 else None,
        "output_tokens_per_s": num_out / span if span > 0 else None,
        "total_output_tokens": num_out,
        "input_tokens_processed_per_s": num_in / span if span > 0 else None,
        "total_input_tokens": num_in,
        "num_completed_without_token_count": sum(m.num_output_tokens is None for m in completed),
    }
    out["latency_s"] = {k: v.to_json() for k, v in latency_table(completed).items()}
    out["output_tokens"] = Percentiles.of(
        m.num_output_tokens for m in completed if m.num_output_tokens is not None
    ).to_json()
    out["prompt_tokens"] = Percentiles.of(
        m.num_prompt_tokens for m in completed if m.num_prompt_tokens is not None
    ).to_json()
    out["tokens_per_chunk"] = tokens_per_chunk_histogram(completed)
    out["goodput"] = [evaluate(s, completed, pooled, len(measured), span) for s in objective_sets]
    sends = [r.t_send_s for r in measured if r.t_send_s is not None]
    lags = [r.t_send_s - r.t_scheduled_s for r in measured if r.t_send_s is not None]
    realised = gap_stats(sends)
    out["arrivals"] = {
        "nominal_rate_rps": nominal_rate,
        "realised_rate_rps": realised["rate"],
        "realised_gap_cv": realised["gap_cv"],
        "schedule_lag_s": Percentiles.of(lags).to_json(),
    }
    steady = (window["start_s"], window["steady_end_s"])
    interval = (
        steady if steady[1] - steady[0] >= 0.5 * span else (window["start_s"], window["end_s"])
    )
    out["littles_law"] = littles_law(records, *interval) | {
        "interval": "steady" if interval == steady else "measured window"
    }
    out["wall_clock"] = wall_clock_decomposition(completed, span, prefill_tok_s)
    return out


def failure_reason(record: RequestRecord) -> str:
    """A request's failure, short and with its numbers replaced by N, so that failures of one
    kind group together: `failed: HTTP 400: prompt (N tokens) + max_tokens (N) ...`."""
    error = record.error or "no error message"
    match = re.match(r"HTTP (\d+): (.*)", error, re.S)
    if match:  # an OpenAI-shaped body: keep its message
        status, body = match.groups()
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body
        error = f"HTTP {status}: {message}"
    error = re.sub(r"\d+(\.\d+)?", "N", " ".join(error.split()))
    return f"{record.outcome}: {error[:160]}"


def failures_by_reason(records: Sequence[RequestRecord]) -> list[dict]:
    """[{"reason", "count"}] over requests that did not complete, most frequent first."""
    counts = Counter(failure_reason(r) for r in records if r.outcome != "ok")
    return [{"reason": k, "count": n} for k, n in counts.most_common()]


def _client_section(loop_lag_s: Sequence[float], cpu_s: float | None, wall_s: float | None) -> dict:
    lag = Percentiles.of(loop_lag_s)
    cpu_fraction = cpu_s / wall_s if cpu_s is not None and wall_s else None
    warn = (lag.p99 or 0.0) > LOOP_LAG_WARN_S or (cpu_fraction or 0.0) > CPU_WARN_FRACTION
    return {
        "event_loop_lag_s": lag.to_json(),
        "cpu_fraction": cpu_fraction,
        "bottleneck_warning": bool(warn),
        "thresholds": {"loop_lag_p99_s": LOOP_LAG_WARN_S, "cpu_fraction": CPU_WARN_FRACTION},
    }


def json_safe(obj):
    """JSON has no inf/nan: write them as strings so the file stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
