"""The load-tool cross-check's definition mapping, on synthetic streams with known answers: the
same streams written as kvserve records and as GuideLLM's JSON give the same mapped metrics, and
each tool's own headline metric is the mapped one it claims to be."""

from __future__ import annotations

import pytest

from kvserve.lab.bench.crosscheck import (
    mapped_metrics,
    timings_from_guidellm,
    timings_from_kvserve,
)
from kvserve.lab.bench.metrics import latency_table, request_metrics
from kvserve.lab.bench.records import RequestRecord, StreamEvent

# Request k: sent at k s; first token after 0.1 + 0.01 k s; then n - 1 tokens 20 ms apart (one per
# event), the stream closes 5 ms after the last token.
N_OUT = 9
STREAMS = [(float(k), 0.1 + 0.01 * k) for k in range(11)]


def kvserve_records() -> list[RequestRecord]:
    out = []
    for k, (start, ttft) in enumerate(STREAMS):
        times = [start + ttft + 0.02 * j for j in range(N_OUT)]
        events = tuple(StreamEvent(t, 3, j + 1) for j, t in enumerate(times))
        out.append(
            RequestRecord(
                f"r{k}",
                k,
                "measured",
                "ok",
                start,
                start,
                times[-1] + 0.005,
                N_OUT,
                events=events,
                num_completion_tokens_server=N_OUT,
            )  # fmt: skip
        )
    return out


def guidellm_benchmark() -> dict:
    requests = []
    for start, ttft in STREAMS:
        first = start + ttft
        timings = {
            "request_start": start,
            "first_token_iteration": first,
            "last_token_iteration": first + 0.02 * (N_OUT - 1),
            "request_end": first + 0.02 * (N_OUT - 1) + 0.005,
        }
        requests.append({"info": {"timings": timings}, "output_tokens": N_OUT})
    return {"requests": {"successful": requests}}


def test_known_answers():
    m = mapped_metrics(timings_from_kvserve(kvserve_records()))
    assert m["num_requests"] == 11
    assert m["ttft_p50_s"] == pytest.approx(0.15)  # median of 0.10 .. 0.20
    assert m["ttft_p99_s"] == pytest.approx(0.10 + 0.01 * 9.9)  # linear between ranks 9 and 10
    assert m["decode_per_token_p50_s"] == pytest.approx(0.02)
    assert m["decode_per_token_token_weighted_p50_s"] == pytest.approx(0.02)
    # GuideLLM's TPOT: (ttft + 8 x 20 ms + 5 ms) / 9 for the median request
    assert m["latency_per_output_token_p50_s"] == pytest.approx((0.15 + 0.16 + 0.005) / 9)
    # 99 tokens from t=0 to the last end at 10 + 0.2 + 0.16 + 0.005
    assert m["output_tokens_per_s"] == pytest.approx(99 / 10.365)


def test_both_tools_records_map_to_the_same_numbers():
    a = mapped_metrics(timings_from_kvserve(kvserve_records()))
    b = mapped_metrics(timings_from_guidellm(guidellm_benchmark()))
    assert a == pytest.approx(b)


def test_kvserve_tpot_is_the_mapped_decode_time_per_token():
    records = kvserve_records()
    table = latency_table([request_metrics(r) for r in records])
    mapped = mapped_metrics(timings_from_kvserve(records))
    assert table["tpot"].p50 == pytest.approx(mapped["decode_per_token_p50_s"])
    assert table["ttft"].p99 == pytest.approx(mapped["ttft_p99_s"])


def test_unequal_lengths_separate_token_weighted_from_request_weighted():
    # GuideLLM's ITL weighs each request by its decoded tokens: a long slow request dominates.
    from kvserve.lab.bench.crosscheck import Timing

    fast = [Timing(0, 0.1, 0.1 + 0.01 * 2, 0.2, 3)] * 3  # 10 ms per token, 2 decoded tokens each
    slow = [Timing(0, 0.1, 0.1 + 0.05 * 99, 5.0, 100)]  # 50 ms per token, 99 decoded tokens
    m = mapped_metrics(fast + slow)
    assert m["decode_per_token_p50_s"] == pytest.approx(0.01)
    assert m["decode_per_token_token_weighted_p50_s"] == pytest.approx(0.05)
