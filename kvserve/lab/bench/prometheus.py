"""Server-side counters over a run, from the server's Prometheus `/metrics` before and after it.

Names differ between servers, so metrics are matched by suffix (`..._prefix_cache_hits`, with or
without `_total`): vLLM's `vllm:` and kvserve's `kvserve_` names both match. Everything here is best
effort and says where it came from; a server without `/metrics` gives "not reported".
"""

from __future__ import annotations

import re

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def total(text: str | None, suffix: str) -> float | None:
    """Sum of the samples whose metric name ends with `suffix` (or `suffix_total`); None if none."""
    if not text:
        return None
    found, value = False, 0.0
    for line in text.splitlines():
        match = _SAMPLE_RE.match(line)
        if match and match.group(1).endswith((suffix, suffix + "_total")):
            try:
                value += float(match.group(3))
            except ValueError:
                continue
            found = True
    return value if found else None


def delta(before: str | None, after: str | None, suffix: str) -> float | None:
    a, b = total(before, suffix), total(after, suffix)
    return b - a if a is not None and b is not None else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def server_counters(before: str | None, after: str | None) -> dict:
    """What the server itself counted during the run: queue time, prefix-cache hits, preemptions,
    speculative acceptance."""
    queue_sum = delta(before, after, "queue_time_seconds_sum")
    queue_count = delta(before, after, "queue_time_seconds_count")
    hits = delta(before, after, "prefix_cache_hits")
    queries = delta(before, after, "prefix_cache_queries")
    accepted = delta(before, after, "accepted_tokens")
    drafted = delta(before, after, "draft_tokens")
    return {
        "source": "server /metrics, after minus before" if after else "not reported",
        "mean_queue_time_s": _ratio(queue_sum, queue_count),
        "num_queue_time_samples": queue_count,
        "prefix_cache_hit_rate": _ratio(hits, queries),
        "num_preemptions": delta(before, after, "num_preemptions"),
        "speculative_acceptance_rate": _ratio(accepted, drafted),
        "speculative_accepted_tokens": accepted,
        "speculative_draft_tokens": drafted,
    }
