"""Prometheus metrics (prometheus-client), on a registry of the app's own.

Per-request latencies are observed when a request ends, from the engine's own timestamps. Scheduler and cache
state (running / waiting, KV usage, preemptions, prefix-cache queries and hits) is read from the engine's
published stats at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.wire import EngineStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


_FAST_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


# Per engine core (data parallel), labelled engine="0", "1", ...: (name, help, EngineStats field, kind)
_PER_CORE = (
    (
        "kvserve_engine_num_requests_running",
        "Requests running on this engine core",
        "num_running",
        GaugeMetricFamily,
    ),
    (
        "kvserve_engine_num_requests_waiting",
        "Requests waiting on this engine core",
        "num_waiting",
        GaugeMetricFamily,
    ),
    (
        "kvserve_engine_kv_cache_usage_ratio",
        "Fraction of this core's KV blocks held",
        "kv_usage",
        GaugeMetricFamily,
    ),
    ("kvserve_engine_num_steps", "Steps this engine core ran", "num_steps", CounterMetricFamily),
    (
        "kvserve_engine_prefix_cache_hits",
        "Prompt tokens served from this core's prefix cache",
        "prefix_cache_hits",
        CounterMetricFamily,
    ),
    (
        "kvserve_engine_threads",
        "Threads this core's next step uses (the adaptive thread policy "
        "drops one while a neighbour takes CPU time)",
        "num_threads",
        GaugeMetricFamily,
    ),
    (
        "kvserve_engine_thread_changes",
        "Times this core's step thread count changed",
        "num_thread_changes",
        CounterMetricFamily,
    ),
    (
        "kvserve_engine_cpu_lost_ratio",
        "Share of this core's step thread-time spent runnable but "
        "not running (taken by other processes), over the last window",
        "cpu_lost",
        GaugeMetricFamily,
    ),
)


class _EngineCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        core_stats: Callable[[], list[tuple[int, bool, EngineStats]]] = list,
    ) -> None:
        self._stats = stats
        self._core_stats = core_stats

    def collect(self):
        cores = self._core_stats()
        up = GaugeMetricFamily(
            "kvserve_engine_up", "1 while this engine core is alive", labels=["engine"]
        )
        for index, alive, _ in cores:
            up.add_metric([str(index)], 1.0 if alive else 0.0)
        yield up
        for name, help_text, field_name, kind in _PER_CORE:
            family = kind(name, help_text, labels=["engine"])
            for index, _, core in cores:
                family.add_metric([str(index)], getattr(core, field_name))
            yield family
        groups = GaugeMetricFamily(
            "kvserve_engine_kv_blocks_in_use",
            "KV blocks held per KV group of this core (a hybrid model's global and sliding-window "
            "groups; docs/scheduling.md)",
            labels=["engine", "group", "kind"],
        )
        for index, _, core in cores:
            for group, (kind, num) in enumerate(
                zip(core.kv_group_kinds, core.kv_group_blocks, strict=True)
            ):
                groups.add_metric([str(index), str(group), kind], num)
        yield groups
        stats = self._stats() or EngineStats()
        yield GaugeMetricFamily(
            "kvserve_num_requests_running", "Requests running", stats.num_running
        )
        yield GaugeMetricFamily(
            "kvserve_num_requests_waiting", "Requests waiting for admission", stats.num_waiting
        )
        yield GaugeMetricFamily(
            "kvserve_kv_cache_usage_ratio", "Fraction of KV blocks held by requests", stats.kv_usage
        )
        yield CounterMetricFamily(
            "kvserve_num_preemptions", "Requests preempted (recompute)", stats.num_preemptions
        )
        yield CounterMetricFamily(
            "kvserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "kvserve_prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            stats.prefix_cache_hits,
        )
        spec = (
            (
                "num_drafts",
                "Verification steps (chunks with proposals)",
                stats.spec_num_verify_steps,
            ),
            ("num_draft_tokens", "Proposed tokens verified", stats.spec_num_proposed),
            ("num_accepted_tokens", "Proposed tokens accepted", stats.spec_num_accepted),
            (
                "num_emitted_tokens",
                "Tokens committed by verification steps",
                stats.spec_num_emitted,
            ),
            (
                "draft_seconds",
                "Time spent proposing (draft model or n-gram lookup)",
                stats.spec_draft_time_s,
            ),
            ("target_seconds", "Target forward time in verifying steps", stats.spec_target_time_s),
        )
        for name, help_text, value in spec:
            yield CounterMetricFamily(f"kvserve_spec_decode_{name}", help_text, value)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None], core_stats=list) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Gap between consecutive tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "kvserve_request_queue_time_seconds",
            "Arrival to first scheduling",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated", registry=r
        )
        self.request_success = Counter(
            "kvserve_request_success",
            "Requests that completed, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            "kvserve_request_errors",
            "Requests that failed, by error type",
            ["error_type"],
            registry=r,
        )
        self.unauthorized = Counter(
            "kvserve_unauthorized_requests",
            "Requests refused for a missing or wrong API key (not in kvserve_request_errors)",
            registry=r,
        )
        self.not_ready = Counter(
            "kvserve_not_ready_requests",
            "Requests answered 503 while the model was still loading (not in kvserve_request_errors)",
            registry=r,
        )
        self.grammar_compile = Histogram(
            "kvserve_grammar_compile_seconds",
            "Compiling one structured-output constraint",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.grammar_mask = Histogram(
            "kvserve_grammar_mask_seconds",
            "Filling and applying grammar bitmasks, per batch",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.grammar_waiting = Gauge(
            "kvserve_grammar_requests_waiting",
            "Structured-output requests waiting for their grammar's turn to compile",
            registry=r,
        )
        r.register(_EngineCollector(stats, core_stats))

    def observe_completion(
        self, num_prompt_tokens: int, completions: list[CompletionOutput]
    ) -> None:
        """Record one finished request (all its samples)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        for completion in completions:
            self.generation_tokens.inc(completion.num_tokens)
            self.request_success.labels(completion.finish_reason or "abort").inc()
            m = completion.metrics
            if m is None:
                continue
            if m.queue_time_s is not None:
                self.queue_time.observe(m.queue_time_s)
            if m.ttft_s is not None:
                self.ttft.observe(m.ttft_s)
            for previous, current in zip(m.token_times, m.token_times[1:], strict=False):
                self.itl.observe(current - previous)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)

    def observe_error(self, error_type: str) -> None:
        self.request_errors.labels(error_type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
