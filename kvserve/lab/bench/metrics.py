"""Per-request metrics and percentiles, computed from raw records only (docs/metrics.md).

With t0 = the send time and c_k = the arrival of the k-th chunk that carries output text:
TTFT = c_1 - t0 (a role-only chunk does not count); E2E = c_last - t0;
TPOT = (E2E - TTFT) / (n_out - 1), omitted when n_out <= 1; chunk-level ITL = every c_k - c_{k-1};
worst gap = the largest of them.

Token-level ITL spreads a chunk's gap evenly over the tokens the server says it held (m_k tokens
give m_k samples of gap / m_k). A chunk with text but no new token passes its gap on to the next
chunk. Tokens that arrive with the first chunk give no ITL sample: no gap was measured for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvserve.lab.bench.records import RequestRecord, StreamEvent

QUANTILES = (50, 90, 99)
PERCENTILE_METHOD = "linear"  # numpy's default: interpolates between the two nearest ranks


@dataclass(frozen=True)
class Percentiles:
    """p50 / p90 / p99 / max of raw samples, with the sample count (None values when count is 0)."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    min: float | None = None

    @classmethod
    def of(cls, samples: Iterable[float]) -> Percentiles:
        x = np.asarray(list(samples), dtype=float)
        if x.size == 0:
            return cls(0)
        p50, p90, p99 = (float(v) for v in np.percentile(x, QUANTILES, method=PERCENTILE_METHOD))
        return cls(int(x.size), float(x.mean()), p50, p90, p99, float(x.max()), float(x.min()))

    def to_json(self) -> dict:
        return dict(self.__dict__)


def percentile(samples: Sequence[float], q: float) -> float | None:
    """One percentile of raw samples (q in [0, 100]), None for no samples."""
    if len(samples) == 0:
        return None
    return float(np.percentile(np.asarray(samples, dtype=float), q, method=PERCENTILE_METHOD))


@dataclass(frozen=True)
class RequestMetrics:
    """The metrics of one completed request. `num_output_tokens_source` says where n_out came from:
    `usage` (the server), `chunks` (per-chunk counts summed), `retokenized` (the client's
    tokenizer)."""

    request_id: str
    index: int
    ttft_s: float
    e2e_s: float
    num_output_tokens: int | None
    num_output_tokens_source: str | None
    tpot_s: float | None
    itl_chunk_s: tuple[float, ...]
    itl_token_s: (
        tuple[float, ...] | None
    )  # None: the server did not say how many tokens each chunk held
    worst_gap_s: float | None  # None: fewer than two text chunks
    tokens_per_chunk: tuple[int, ...] | None
    queue_time_s: float | None
    num_prompt_tokens: int | None


def text_events(rec: RequestRecord) -> list[StreamEvent]:
    return [e for e in rec.events if e.num_chars > 0]


def tokens_per_text_chunk(rec: RequestRecord) -> tuple[int, ...] | None:
    """Tokens each text chunk held, when the server said so for every one of them, else None.

    From the running `usage.completion_tokens` (differences between text chunks, so tokens announced
    by text-less events are carried to the next text chunk), else from per-token logprob entries.
    """
    text = text_events(rec)
    if not text:
        return None
    if all(e.cum_completion_tokens is not None for e in text):
        cums = [0] + [e.cum_completion_tokens for e in text]
        counts = tuple(b - a for a, b in zip(cums, cums[1:], strict=False))
        return counts if min(counts) >= 0 else None
    if all(e.num_logprob_tokens is not None for e in text):
        return tuple(e.num_logprob_tokens for e in text)
    return None


def output_tokens(rec: RequestRecord) -> tuple[int | None, str | None]:
    """n_out and its source: the server's usage, else per-chunk counts, else the re-tokenised
    text."""
    if rec.num_completion_tokens_server is not None:
        return rec.num_completion_tokens_server, "usage"
    counts = tokens_per_text_chunk(rec)
    if counts is not None:
        return sum(counts), "chunks"
    if rec.num_completion_tokens_retokenized is not None:
        return rec.num_completion_tokens_retokenized, "retokenized"
    return None, None


def token_level_itl(times_s: Sequence[float], counts: Sequence[int]) -> tuple[float, ...]:
    """Spread each gap c_k - c_{k-1} (k >= 2) evenly over the m_k tokens of chunk k."""
    out: list[float] = []
    pending = 0.0
    for k in range(1, len(times_s)):
        pending += times_s[k] - times_s[k - 1]
        if counts[k] > 0:
            out.extend([pending / counts[k]] * counts[k])
            pending = 0.0
    return tuple(out)


def request_metrics(rec: RequestRecord) -> RequestMetrics | None:
    """Metrics of a completed request; None unless it ended ok with at least one text chunk."""
    text = text_events(rec)
    if rec.outcome != "ok" or not text or rec.t_send_s is None:
        return None
    times = [e.t_s for e in text]
    ttft = times[0] - rec.t_send_s
    e2e = times[-1] - rec.t_send_s
    n_out, source = output_tokens(rec)
    tpot = (e2e - ttft) / (n_out - 1) if n_out is not None and n_out > 1 else None
    itl = tuple(b - a for a, b in zip(times, times[1:], strict=False))
    counts = tokens_per_text_chunk(rec)
    prompt = rec.num_prompt_tokens_server
    return RequestMetrics(
        request_id=rec.request_id,
        index=rec.index,
        ttft_s=ttft,
        e2e_s=e2e,
        num_output_tokens=n_out,
        num_output_tokens_source=source,
        tpot_s=tpot,
        itl_chunk_s=itl,
        itl_token_s=token_level_itl(times, counts) if counts is not None else None,
        worst_gap_s=max(itl) if itl else None,
        tokens_per_chunk=counts,
        queue_time_s=rec.queue_time_s,
        num_prompt_tokens=prompt if prompt is not None else rec.num_prompt_tokens_client,
    )


def pooled_samples(metrics: Sequence[RequestMetrics]) -> dict[str, list[float]]:
    """Raw samples pooled over requests, per metric name (the names objectives use)."""
    out: dict[str, list[float]] = {
        "ttft": [m.ttft_s for m in metrics],
        "e2e": [m.e2e_s for m in metrics],
        "tpot": [m.tpot_s for m in metrics if m.tpot_s is not None],
        "itl": [g for m in metrics for g in m.itl_chunk_s],
        "itl_token": [g for m in metrics if m.itl_token_s is not None for g in m.itl_token_s],
        "worst_gap": [m.worst_gap_s for m in metrics if m.worst_gap_s is not None],
        "queue_time": [m.queue_time_s for m in metrics if m.queue_time_s is not None],
    }
    return out


def latency_table(metrics: Sequence[RequestMetrics]) -> dict[str, Percentiles]:
    return {name: Percentiles.of(samples) for name, samples in pooled_samples(metrics).items()}


def tokens_per_chunk_histogram(metrics: Sequence[RequestMetrics]) -> dict:
    """Histogram of tokens per text chunk over requests whose server said so, and n_out / chunks
    overall."""
    hist: Counter[int] = Counter()
    num_known = 0
    for m in metrics:
        if m.tokens_per_chunk is not None:
            num_known += 1
            hist.update(m.tokens_per_chunk)
    num_tokens = sum(m.num_output_tokens or 0 for m in metrics if m.num_output_tokens is not None)
    num_chunks = sum(len(m.itl_chunk_s) + 1 for m in metrics if m.num_output_tokens is not None)
    return {
        "histogram": {str(k): v for k, v in sorted(hist.items())},
        "num_requests_with_per_chunk_counts": num_known,
        "num_requests": len(metrics),
        "mean_tokens_per_chunk": num_tokens / num_chunks if num_chunks else None,
    }
