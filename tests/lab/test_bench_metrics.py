"""Serving metrics (docs/metrics.md) on synthetic timestamp streams with known answers."""

from __future__ import annotations

import math

import pytest

from kvserve.lab.bench.metrics import (
    Percentiles,
    request_metrics,
    token_level_itl,
    tokens_per_chunk_histogram,
)
from kvserve.lab.bench.records import (
    BenchError,
    RequestRecord,
    StreamEvent,
    read_jsonl,
    write_jsonl,
)
from kvserve.lab.bench.slo import ObjectiveSet, parse_duration_s
from kvserve.lab.bench.summary import littles_law, summarize, wall_clock_decomposition


def rec(
    i: int,
    events: list[tuple],
    *,
    t_send: float = 0.0,
    outcome: str = "ok",
    usage: int | None = None,
    phase: str = "measured",
    t_end: float | None = None,
    prompt: int | None = 10,
    **kw,
) -> RequestRecord:
    """events: (t, chars[, cumulative usage[, logprob count]])."""
    evs = tuple(StreamEvent(*e) for e in events)
    end = t_end if t_end is not None else (evs[-1].t_s if evs else t_send + 0.01)
    return RequestRecord(
        request_id=f"req-{i:06d}",
        index=i,
        phase=phase,
        outcome=outcome,
        t_scheduled_s=t_send,
        t_send_s=t_send,
        t_end_s=end,
        max_tokens=16,
        events=evs,
        num_completion_tokens_server=usage,
        num_prompt_tokens_server=prompt,
        **kw,
    )


def approx(x: float):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_multi_token_chunks_after_a_role_only_chunk():
    r = rec(
        0,
        [(0.10, 0, 0), (0.30, 5, 1), (0.40, 9, 3), (0.70, 4, 4), (0.71, 0, 4)],
        usage=4,
    )
    m = request_metrics(r)
    assert m.ttft_s == approx(0.30)  # the role-only chunk at 0.10 does not count
    assert m.e2e_s == approx(0.70)  # the last text chunk, not the usage-only event after it
    assert m.num_output_tokens == 4 and m.num_output_tokens_source == "usage"
    assert m.tpot_s == approx((0.70 - 0.30) / 3)
    assert m.itl_chunk_s == (approx(0.1), approx(0.3))
    assert m.worst_gap_s == approx(0.3)
    assert m.tokens_per_chunk == (1, 2, 1)
    # token level: the 0.1 s gap holds 2 tokens -> two samples of 0.05; the 0.3 s gap holds 1 token
    assert m.itl_token_s == (approx(0.05), approx(0.05), approx(0.3))


def test_one_token_output_omits_tpot_and_gaps():
    m = request_metrics(rec(0, [(0.05, 0, 0), (0.2, 3, 1), (0.21, 0, 1)], usage=1, t_send=0.1))
    assert m.ttft_s == approx(0.1)
    assert m.e2e_s == approx(0.1)
    assert m.tpot_s is None  # never (E2E - TTFT) / 0
    assert m.itl_chunk_s == () and m.worst_gap_s is None
    assert m.itl_token_s == ()


def test_all_tokens_in_one_chunk_has_tpot_but_no_gap():
    m = request_metrics(rec(0, [(0.5, 12, 3)], usage=3))
    assert m.tpot_s == 0.0 and m.worst_gap_s is None and m.itl_token_s == ()


def test_tokens_from_logprobs_when_usage_is_absent():
    r = rec(0, [(0.1, 0), (0.2, 3, None, 1), (0.5, 6, None, 3)])
    m = request_metrics(r)
    assert m.tokens_per_chunk == (1, 3)
    assert m.num_output_tokens == 4 and m.num_output_tokens_source == "chunks"
    assert m.itl_token_s == (approx(0.1), approx(0.1), approx(0.1))
    assert m.tpot_s == approx(0.3 / 3)


def test_without_per_chunk_counts_token_itl_is_not_guessed():
    m = request_metrics(rec(0, [(0.1, 2), (0.2, 2), (0.4, 2)], usage=6))
    assert m.tokens_per_chunk is None and m.itl_token_s is None
    assert m.itl_chunk_s == (approx(0.1), approx(0.2))
    assert m.tpot_s == approx(0.3 / 5)
    retok = rec(1, [(0.1, 2), (0.3, 2)], num_completion_tokens_retokenized=2)
    assert request_metrics(retok).num_output_tokens_source == "retokenized"
    assert request_metrics(rec(2, [(0.1, 2), (0.3, 2)])).tpot_s is None  # n_out unknown


def test_text_chunk_without_a_new_token_passes_its_gap_on():
    assert token_level_itl([0.0, 1.0, 2.0], [1, 0, 2]) == (1.0, 1.0)
    # cumulative usage that does not grow on a text chunk gives that chunk 0 tokens
    m = request_metrics(rec(0, [(0.0, 1, 1), (1.0, 1, 1), (2.0, 1, 3)], usage=3))
    assert m.tokens_per_chunk == (1, 0, 2) and m.itl_token_s == (1.0, 1.0)


def test_not_completed_requests_have_no_latency():
    for outcome in ("failed", "timeout", "rejected", "cancelled"):
        assert request_metrics(rec(0, [(0.1, 3, 1)], outcome=outcome)) is None
    assert request_metrics(rec(0, [(0.1, 0, 0)])) is None  # no text at all


def test_percentiles_from_raw_samples_with_counts():
    p = Percentiles.of(range(1, 101))
    assert (p.count, p.p50, p.p90, p.p99, p.max, p.min, p.mean) == (
        100, 50.5, approx(90.1), approx(99.01), 100.0, 1.0, 50.5
    )  # fmt: skip
    assert Percentiles.of([]) == Percentiles(0)
    assert Percentiles.of([7.0]).p99 == 7.0


def _mixed_run() -> list[RequestRecord]:
    """Window 0..2 s. Four completed requests with known TTFT and worst gap, three that did not
    complete, one warm-up request (excluded)."""
    return [
        rec(0, [(0.2, 1, 1), (0.3, 1, 2), (0.4, 1, 3)], usage=3),  # ttft .2, worst .1
        rec(1, [(0.9, 1, 1), (1.0, 1, 2)], t_send=0.5, usage=2),  # ttft .4, worst .1
        rec(2, [(1.6, 1, 1), (1.9, 1, 2)], t_send=1.0, usage=2),  # ttft .6, worst .3
        rec(3, [(1.2, 1, 1), (2.0, 1, 2)], t_send=1.1, usage=2),  # ttft .1, worst .8
        rec(4, [], t_send=1.2, outcome="failed", t_end=1.25, error="HTTP 500"),
        rec(5, [(1.3, 1, 1)], t_send=1.2, outcome="timeout", t_end=1.8),
        rec(6, [], t_send=1.5, outcome="rejected", t_end=1.51, http_status=429),
        rec(7, [(0.1, 1, 1), (0.2, 1, 2)], t_send=-0.5, usage=2, phase="warmup"),
    ]


def test_failures_timeouts_and_rejections_are_counted_not_dropped():
    s = summarize(_mixed_run())
    assert s["counts"] == {"measured": 7, "ok": 4, "failed": 1, "rejected": 1, "timeout": 1,
                           "cancelled": 0, "warmup": 1}  # fmt: skip
    assert s["window"]["start_s"] == 0.0 and s["window"]["end_s"] == 2.0
    assert s["window"]["steady_end_s"] == 1.5 and s["window"]["drain_s"] == approx(0.5)
    assert s["latency_s"]["ttft"]["count"] == 4  # only completed requests have latencies


def test_throughput_is_total_over_window_not_a_sum_of_rates():
    s = summarize(_mixed_run())
    t = s["throughput"]
    assert t["total_output_tokens"] == 9  # warm-up and unfinished requests excluded
    assert t["output_tokens_per_s"] == approx(9 / 2.0)
    assert t["requests_per_s"] == approx(4 / 2.0)
    assert t["total_input_tokens"] == 40 and t["input_tokens_processed_per_s"] == approx(20.0)
    summed_rates = 3 / 0.4 + 2 / 0.5 + 2 / 0.9 + 2 / 0.9
    assert t["output_tokens_per_s"] < summed_rates


def test_goodput_per_request_and_pooled_are_different_objectives():
    per_request = ObjectiveSet.parse("ttft=500ms,worst_gap=200ms")
    pooled = ObjectiveSet.parse("p50_ttft=500ms,p99_itl=1s")
    strict_pooled = ObjectiveSet.parse("p99_ttft=500ms")
    s = summarize(_mixed_run(), objective_sets=[per_request, pooled, strict_pooled])
    g_req, g_pool, g_strict = s["goodput"]
    assert g_req["name"] == "TTFT <= 500 ms and worst gap <= 200 ms per request"
    assert g_req["style"] == "per-request"
    # requests 0 and 1 meet both; 2 misses TTFT; 3 misses the worst gap; 3 never completed
    assert (g_req["num_met"], g_req["num_measured"]) == (2, 7)
    assert g_req["attainment"] == approx(2 / 7)
    assert g_req["goodput_rps"] == approx(2 / 2.0)
    assert g_pool["name"] == "pooled p50 TTFT <= 500 ms and pooled p99 ITL <= 1 s"
    assert g_pool["met"] and g_pool["goodput_rps"] == approx(4 / 2.0)
    assert g_pool["values"][0]["value_s"] == approx(0.3) and g_pool["values"][0]["num_samples"] == 4
    assert g_pool["values"][1]["num_samples"] == 5  # pooled ITL: every gap of every request
    assert not g_strict["met"] and g_strict["goodput_rps"] == 0.0


def test_objective_parsing():
    assert parse_duration_s("3s") == 3.0
    assert parse_duration_s("100ms") == approx(0.1)
    assert parse_duration_s("250us") == approx(250e-6)
    assert parse_duration_s("1.5") == 1.5
    with pytest.raises(BenchError):
        parse_duration_s("fast")
    with pytest.raises(BenchError, match="mix"):
        ObjectiveSet.parse("ttft=1s,p99_itl=50ms")
    with pytest.raises(BenchError, match="unknown objective"):
        ObjectiveSet.parse("latency=1s")
    assert ObjectiveSet.parse("p99.9_itl=50ms").objectives[0].percentile == 99.9


def test_undefined_metric_does_not_violate_an_objective():
    one_token = rec(0, [(0.1, 3, 1)], usage=1)
    s = summarize([one_token], objective_sets=[ObjectiveSet.parse("tpot=1ms,worst_gap=1ms")])
    assert s["goodput"][0]["num_met"] == 1


def test_littles_law_on_a_stable_stream():
    # one arrival per second, each in the system for exactly 2 s: L = 2 = 1/s x 2 s
    records = [rec(i, [(i + 2.0, 1, 1)], t_send=float(i), usage=1) for i in range(20)]
    ll = littles_law(records, 5.0, 15.0)
    assert ll["mean_in_system"] == approx(2.0)
    assert ll["completed_rate_rps"] == approx(11 / 10)  # completions at t = 5..15 inclusive
    assert ll["mean_time_in_system_s"] == approx(2.0)
    assert ll["holds"]


def test_littles_law_flags_a_growing_queue():
    # arrivals every second, time in system grows by 1 s per request: the queue builds up
    records = [rec(i, [(2.0 * i + 1, 1, 1)], t_send=float(i), usage=1) for i in range(30)]
    ll = littles_law(records, 5.0, 25.0)
    assert ll["ratio"] > 1.2 and not ll["holds"]


def test_wall_clock_decomposition_with_a_given_prefill_speed():
    records = [
        rec(i, [(0.5, 1, 1), (1.0, 1, 11)], t_send=0.0, usage=11, prompt=1000) for i in range(4)
    ]
    metrics = [request_metrics(r) for r in records]
    wc = wall_clock_decomposition(metrics, window_s=2.0, prefill_tok_s=4000.0)
    assert wc["prefill_s"] == approx(1.0)  # 4 x 1000 tokens / 4000 tok/s
    assert wc["per_request_decode_tok_s"] == approx(20.0)  # TPOT 0.05 s
    assert wc["decode_s"] == approx(11 / 20.0)
    assert wc["prefill_share"] == approx(0.5) and wc["mostly_prefill"]
    estimated = wall_clock_decomposition(metrics, window_s=2.0)
    assert estimated["prefill_tok_s"] == approx(2000.0)  # 1000 tokens / TTFT 0.5 s
    assert estimated["prefill_speed_source"].startswith("client estimate")


def test_tokens_per_chunk_histogram():
    records = [
        rec(0, [(0.1, 1, 1), (0.2, 1, 3), (0.3, 1, 4)], usage=4),
        rec(1, [(0.1, 1), (0.2, 1)], usage=2),
    ]
    h = tokens_per_chunk_histogram([request_metrics(r) for r in records])
    assert h["histogram"] == {"1": 2, "2": 1}
    assert h["num_requests_with_per_chunk_counts"] == 1
    assert h["mean_tokens_per_chunk"] == approx(6 / 5)


def test_records_round_trip_through_jsonl(tmp_path):
    records = _mixed_run()
    write_jsonl(tmp_path / "r.jsonl", records)
    back = read_jsonl(tmp_path / "r.jsonl")
    assert back == records
    assert math.isclose(back[0].events[1].t_s, 0.3)
