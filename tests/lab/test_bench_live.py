"""`kvserve bench serve` against a live `kvserve serve` (a tiny Llama over GPT-2's tokenizer).

A short open-loop sweep and a forced-length closed-loop run complete; the client's token counts
equal the server's usage; the report files exist and parse; the server's per-request `metrics`
(queue time on the finish chunk) reach the records; `--reset-prefix-cache` makes each rate start
from an empty prefix cache, and without it a rerun of the same prompts is served from cache.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests import FIXTURES
from tests.server_utils import running_server

pytestmark = pytest.mark.slow

BENCH_FIXTURES = FIXTURES / "bench"
SERVER_METRICS_KEYS = {"queue_time_s", "ttft_s", "e2e_s", "num_cached_tokens", "num_preemptions"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_fixture_{name}", BENCH_FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


harness = _load("harness")


@pytest.fixture(scope="module")
def live_url(gpt2_model_dir):
    args = ("--max-model-len", "512", "--kv-cache-memory", "64MiB")
    with running_server(gpt2_model_dir, *args) as (url, _):
        yield url


def _check_completed(records, num_measured: int) -> list:
    measured = [r for r in records if r.phase == "measured"]
    assert len(measured) == num_measured and all(r.outcome == "ok" for r in measured)
    # per-chunk token counts add up to the server's usage (re-tokenising random-weight output may
    # legitimately differ, so it is not required to be exact)
    assert harness.check_token_counts(records, retokenized_exact=False) == len(records)
    for r in measured:
        m = r.extra["server_metrics"]
        assert SERVER_METRICS_KEYS <= set(m) and m["num_preemptions"] == 0
        # queue time comes from the server, and durations nest: queue <= server TTFT <= client TTFT
        assert r.queue_time_s is not None and r.queue_time_s == m["queue_time_s"]
        client_ttft = next(e.t_s for e in r.events if e.num_chars > 0) - r.t_send_s
        assert 0 <= r.queue_time_s <= m["ttft_s"] <= client_ttft
    return measured


def test_open_loop_sweep_resets_the_prefix_cache(live_url, tmp_path):
    common = ("--num-requests", "4", "--warmup", "1", "--input-len", "40", "--output-len", "8",
              "--slo", "ttft=30s,worst_gap=10s")  # fmt: skip
    out = tmp_path / "sweep"
    rc = harness.run_bench(live_url, out, "--sweep", "20,inf", "--reset-prefix-cache", *common)
    assert rc == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert [row["prefix_cache_reset"] for row in sweep["rows"]] == ["ok", "ok"]
    assert (out / "report.html").read_text().startswith("<!doctype html>")
    prompts = None
    for rate_dir in ("rate_20", "rate_inf"):
        summary, records = harness.load_run(out / rate_dir)
        assert summary["counts"]["ok"] == 4
        assert summary["latency_s"]["queue_time"]["count"] == 4
        assert summary["metadata"]["workload"]["token_exact"]  # the server's /tokenize
        measured = _check_completed(records, 4)
        # both rates send the same prompts, and neither is served from the other's cache
        assert prompts in (None, [r.prompt_sha256 for r in measured])
        prompts = [r.prompt_sha256 for r in measured]
        assert [r.extra["server_metrics"]["num_cached_tokens"] for r in measured] == [0] * 4
        assert all(r.num_prompt_tokens_server >= 40 for r in measured)
    # the same prompts again without a reset: the cache of the last rate serves their full blocks
    assert harness.run_bench(live_url, tmp_path / "again", "--request-rate", "inf", *common) == 0
    summary, records = harness.load_run(tmp_path / "again")
    assert summary["metadata"]["prefix_cache_reset"]["status"] == "not requested"
    measured = _check_completed(records, 4)
    assert [r.prompt_sha256 for r in measured] == prompts
    assert all(r.extra["server_metrics"]["num_cached_tokens"] >= 16 for r in measured)


def test_forced_length_closed_loop(live_url, tmp_path):
    rc = harness.run_bench(
        live_url, tmp_path, "--endpoint", "completions", "--mode", "forced",
        "--max-concurrency", "3", "--num-requests", "5", "--warmup", "1",
        "--input-len", "16", "--output-len", "12", "--content", "code",
    )  # fmt: skip
    assert rc == 0
    summary, records = harness.load_run(tmp_path)
    _check_completed(records, 5)
    for r in records:
        assert r.num_completion_tokens_server == 12 and r.finish_reason == "length"
        assert r.num_prompt_tokens_server == r.num_prompt_tokens_client == 16
    assert summary["metadata"]["mode"] == "forced"
    assert summary["throughput"]["total_output_tokens"] == 5 * 12
    assert summary["tokens_per_chunk"]["num_requests_with_per_chunk_counts"] == 5
    assert summary["metadata"]["identity"]["engine"]["value"] == "kvserve"
