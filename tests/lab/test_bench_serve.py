"""`kvserve bench serve` end to end against a scripted OpenAI-compatible SSE server (127.0.0.1, free
port).

The server's answers are known (whitespace tokens, a fixed cycle of tokens per chunk, known
rejections and stalls), so the report's counts can be checked exactly. The helpers in
fixtures/bench/harness.py take a base URL, so the same run-and-check applies to a live server (see
test_live_server_smoke).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from kvserve.cli import main as cli_main
from kvserve.lab.bench.records import sha256_text
from tests import FIXTURES

BENCH_FIXTURES = FIXTURES / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_fixture_{name}", BENCH_FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


harness = _load("harness")
scripted = _load("scripted_server")


def test_open_loop_chat_run_counts_and_token_counts(tmp_path):
    # 2 warm-up + 16 measured requests; the server rejects its 5th and 9th and stalls its 12th
    script = scripted.Script(reject_nth=frozenset({5, 9}), stall_nth=frozenset({12}), stall_s=3.0)
    with scripted.scripted_server(script) as (url, log):
        rc = harness.run_bench(
            url, tmp_path, "--num-requests", "16", "--warmup", "2", "--request-rate", "400",
            "--input-len", "uniform:8:24", "--output-len", "uniform:1:12", "--timeout", "0.5",
            "--slo", "ttft=2s,worst_gap=1s", "--slo", "p99_ttft=2s,p99_itl=1s",
            "--label", "hardware=test-cpu",
        )  # fmt: skip
    assert rc == 0
    summary, records = harness.load_run(tmp_path)
    c = summary["counts"]
    assert (c["measured"], c["warmup"]) == (16, 2)
    # the server counted requests in arrival order; the records know which ones it rejected
    assert sum(r.outcome == "rejected" for r in records) == len(log.rejected) == 2
    assert all(r.http_status == 429 and r.extra["retry_after"] == "1"
               for r in records if r.outcome == "rejected")  # fmt: skip
    assert c["timeout"] == 1 and c["failed"] == 0 and c["cancelled"] == 0
    assert c["ok"] == 16 - c["rejected"] - 1
    # token counts: per-chunk usage and re-tokenised text equal the server's usage, which equals
    # what the server says it generated for that prompt
    assert harness.check_token_counts(records) == c["ok"] + (c["warmup"] - sum(
        r.outcome != "ok" for r in records if r.phase == "warmup"))  # fmt: skip
    served = log.completion_tokens
    prompts_by_hash = {
        sha256_text(t): t for t in (b["messages"][-1]["content"] for b in log.bodies)
    }
    for r in records:
        if r.outcome == "ok":
            prompt = prompts_by_hash[r.prompt_sha256]
            assert r.num_completion_tokens_server == served[prompt]
            assert r.num_prompt_tokens_client == len(prompt.split())  # token-exact via /tokenize
            assert (
                r.num_prompt_tokens_server
                == r.num_prompt_tokens_client + scripted.CHAT_TEMPLATE_TOKENS
            )
            assert 8 <= r.num_prompt_tokens_client <= 24
            assert r.system_fingerprint == scripted.FINGERPRINT
            assert r.queue_time_s == pytest.approx(script.queue_time_s)
            assert r.events[0].num_chars == 0  # role-only first chunk recorded, not counted as TTFT
    checks = summary["token_count_checks"]
    assert checks["num_chunk_count_mismatches"] == 0 and checks["num_retokenized_mismatches"] == 0
    assert checks["num_retokenized_compared"] == c["ok"]
    # per-chunk token histogram: the script's cycle (1, 2, 1, 3), cut short at the end of an answer
    assert set(summary["tokens_per_chunk"]["histogram"]) <= {"1", "2", "3"}
    lat = summary["latency_s"]
    assert lat["ttft"]["count"] == c["ok"] and lat["queue_time"]["count"] == c["ok"]
    assert lat["ttft"]["p50"] >= script.ttft_s
    assert lat["itl_token"]["count"] > 0 and lat["itl"]["count"] > 0
    # a one-token answer has no TPOT: fewer TPOT samples than TTFT samples unless none was that
    # short
    n_one = sum(r.phase == "measured" and r.outcome == "ok" and r.num_completion_tokens_server == 1
                for r in records)  # fmt: skip
    assert lat["tpot"]["count"] == c["ok"] - n_one
    g_req, g_pool = summary["goodput"]
    assert g_req["style"] == "per-request" and g_req["num_measured"] == 16
    assert g_req["num_met"] <= c["ok"] and g_pool["style"] == "pooled"
    meta = summary["metadata"]
    assert meta["mode"] == "natural" and meta["workload"]["token_exact"]
    assert meta["workload"]["tokenizer"].startswith("server:/tokenize")
    assert meta["identity"]["engine_version"] == {
        "value": "0.0-test",
        "source": "/ready:engine_version",
    }
    assert meta["identity"]["hardware"]["value"] == "test-cpu"
    # the server's own counters over the run (warm-up requests fall inside the before/after scrape)
    counters = meta["server_counters"]
    assert counters["num_queue_time_samples"] == len(log.completion_tokens)
    assert counters["mean_queue_time_s"] == pytest.approx(script.queue_time_s)
    assert counters["speculative_acceptance_rate"] is None
    assert meta["identity"]["system_fingerprints_seen"]["value"] == [scripted.FINGERPRINT]
    assert (
        meta["arrivals"]["process"] == "poisson" and summary["arrivals"]["nominal_rate_rps"] == 400
    )
    assert summary["arrivals"]["schedule_lag_s"]["count"] == 16
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4  # TTFT CDF, ITL CDF, worst gaps, timeline
    # natural stop: the scripted model stops after 7 tokens unless max_tokens is smaller
    assert all(r.num_completion_tokens_server <= 7 for r in records if r.outcome == "ok")
    assert all(b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
               for b in log.bodies)  # fmt: skip


def test_forced_length_closed_loop_on_completions(tmp_path):
    with scripted.scripted_server() as (url, log):
        rc = harness.run_bench(
            url, tmp_path, "--endpoint", "completions", "--mode", "forced",
            "--max-concurrency", "3",
            "--num-requests", "9", "--warmup", "1", "--input-len", "6", "--output-len", "11",
            "--content", "code", "--no-per-chunk-usage", "--no-plots",
        )  # fmt: skip
    assert rc == 0
    summary, records = harness.load_run(tmp_path)
    assert summary["counts"]["ok"] == 9
    assert all(
        b["ignore_eos"] is True and b["min_tokens"] == b["max_tokens"] == 11 for b in log.bodies
    )
    for r in records:
        assert r.num_completion_tokens_server == 11 and r.finish_reason == "length"
        assert r.num_completion_tokens_retokenized == 11
    # without per-chunk usage the token-level ITL is not guessed
    assert summary["latency_s"]["itl_token"]["count"] == 0
    assert summary["tokens_per_chunk"]["num_requests_with_per_chunk_counts"] == 0
    meta = summary["metadata"]
    assert meta["mode"] == "forced" and meta["workload"]["content"] == "code"
    assert meta["arrivals"]["loop"] == "closed" and meta["concurrency_limit"] == 3
    assert "data:image/png" not in (tmp_path / "report.html").read_text()


def test_sweep_uses_one_workload_and_compare_sees_identical_outputs(tmp_path, capsys):
    with scripted.scripted_server() as (url, _):
        rc = harness.run_bench(
            url, tmp_path, "--sweep", "200,inf", "--num-requests", "6", "--warmup", "0",
            "--input-len", "10", "--output-len", "5", "--slo", "p99_ttft=2s",
        )  # fmt: skip
    assert rc == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [row["offered_rps"] for row in sweep["rows"]] == [200, "inf"]
    assert all(row["passed"] for row in sweep["rows"])
    assert "latency vs offered load" in (tmp_path / "report.html").read_text()
    _, rec_a = harness.load_run(tmp_path / "rate_200")
    _, rec_b = harness.load_run(tmp_path / "rate_inf")
    assert [r.prompt_sha256 for r in rec_a] == [r.prompt_sha256 for r in rec_b]
    capsys.readouterr()
    rc = cli_main(["bench", "compare", str(tmp_path / "rate_200"), str(tmp_path / "rate_inf"),
                   "--require-identical", "--json", str(tmp_path / "cmp.json")])  # fmt: skip
    assert rc == 0
    assert "outputs: IDENTICAL: 6/6" in capsys.readouterr().out
    doc = json.loads((tmp_path / "cmp.json").read_text())
    assert any("arrivals differs" in note for note in doc["not_comparable"])


def test_compare_flags_a_differing_output(tmp_path, capsys):
    args = ("--num-requests", "5", "--warmup", "0", "--request-rate", "inf", "--input-len", "12",
            "--output-len", "6", "--no-plots")  # fmt: skip
    with scripted.scripted_server() as (url, _):
        assert harness.run_bench(url, tmp_path / "a", *args) == 0
    _, records = harness.load_run(tmp_path / "a")
    third = next(r for r in records if r.index == 2)
    # the same workload again, but the model answers request 2's prompt with one word changed
    script = scripted.Script(variant_prompt_sha256=third.prompt_sha256)
    with scripted.scripted_server(script) as (url, _):
        assert harness.run_bench(url, tmp_path / "b", *args) == 0
    capsys.readouterr()
    rc = cli_main(
        ["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--require-identical"]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "outputs: DIFFER: 4/5" in out and "differing indices (1): 2" in out
    assert cli_main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0


def test_ctrl_c_writes_what_was_measured(tmp_path):
    script = scripted.Script(sigint_nth=4, chunk_gap_s=0.05)
    with scripted.scripted_server(script) as (url, _):
        rc = harness.run_bench(url, tmp_path, "--num-requests", "30", "--warmup", "0",
                               "--request-rate", "inf", "--max-concurrency", "6",
                               "--input-len", "5", "--output-len", "12", "--no-plots")  # fmt: skip
    assert rc == 130
    summary, records = harness.load_run(tmp_path)
    assert summary["metadata"]["interrupted"]
    assert summary["counts"]["cancelled"] == len(records) == 30
    assert max(sum(e.num_chars > 0 for e in r.events) for r in records) >= 3  # partial streams kept


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    rc = harness.run_bench("http://127.0.0.1:9", tmp_path, "--num-requests", "1")
    assert rc == 2 and "no answer from http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.skipif(harness.live_base_url() is None, reason=f"set {harness.LIVE_URL_ENV} to run")
def test_live_server_smoke(tmp_path):
    url = harness.live_base_url()
    args = ("--num-requests", "8", "--warmup", "1", "--request-rate", "2", "--input-len", "32",
            "--output-len", "16")  # fmt: skip
    rc = harness.run_bench(url, tmp_path, *args)
    assert rc == 0
    summary, records = harness.load_run(tmp_path)
    assert summary["counts"]["ok"] == 8
    harness.check_token_counts(records, retokenized_exact=False)


def test_sweep_resets_the_prefix_cache_before_each_rate(tmp_path, capsys):
    # the server's first reset answers 409 (requests running): the bench retries it
    script = scripted.Script(reset_prefix_cache=True, reset_busy_times=1)
    with scripted.scripted_server(script) as (url, log):
        rc = harness.run_bench(
            url, tmp_path, "--sweep", "200,inf", "--num-requests", "3", "--warmup", "1",
            "--input-len", "6", "--output-len", "3", "--no-plots", "--reset-prefix-cache",
        )  # fmt: skip
    assert rc == 0
    # one reset before each rate's first request (its warm-up): none, then after 1 + 3 requests
    assert log.resets_at_request == [0, 4] and log.num_reset_conflicts == 1
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["prefix_cache_reset"] is True
    assert [row["prefix_cache_reset"] for row in sweep["rows"]] == ["ok", "ok"]
    assert "prefix cache reset before every rate" in sweep["note"]
    assert "prefix cache reset before every rate" in capsys.readouterr().out
    summary, _ = harness.load_run(tmp_path / "rate_inf")
    assert summary["metadata"]["prefix_cache_reset"] == {
        "requested": True,
        "status": "ok",
        "detail": None,
    }
    # every measured record keeps the server's per-request metrics object
    _, records = harness.load_run(tmp_path / "rate_200")
    assert all(r.extra["server_metrics"] == {"queue_time_s": script.queue_time_s} for r in records)


def test_reset_prefix_cache_on_a_server_without_it_warns_and_runs(tmp_path, capsys):
    with scripted.scripted_server() as (url, log):
        rc = harness.run_bench(
            url, tmp_path, "--num-requests", "2", "--warmup", "0", "--input-len", "6",
            "--output-len", "3", "--no-plots", "--reset-prefix-cache",
        )  # fmt: skip
    assert rc == 0 and log.num_resets == 0
    captured = capsys.readouterr()
    assert "WARNING: prefix cache not reset (unsupported)" in captured.err
    assert "prefix cache: reset FAILED (unsupported" in captured.out
    summary, _ = harness.load_run(tmp_path)
    assert summary["metadata"]["prefix_cache_reset"]["status"] == "unsupported"
    assert summary["counts"]["ok"] == 2
    # without the flag nothing is posted and the summary says so
    with scripted.scripted_server(scripted.Script(reset_prefix_cache=True)) as (url, log):
        assert harness.run_bench(url, tmp_path / "b", "--num-requests", "1", "--warmup", "0",
                                 "--input-len", "6", "--output-len", "3", "--no-plots") == 0  # fmt: skip
    assert log.num_resets == 0
    summary, _ = harness.load_run(tmp_path / "b")
    assert summary["metadata"]["prefix_cache_reset"] == {
        "requested": False,
        "status": "not requested",
    }


def test_no_size_flags_is_a_short_finite_run_at_a_stated_rate():
    """issue 46: `bench serve` with no flags erred (give --num-requests or --duration), and with a
    count its rate was infinite. Now: 32 requests at 1 request/s, said on the first line."""
    from kvserve.cli import build_parser
    from kvserve.cli.bench import _default_run, _serve_config

    args = build_parser().parse_args(["bench", "serve"])
    assert (
        _default_run(args)
        == "no --num-requests or --duration: 32 requests at 1 request/s (Poisson)"
    )
    config = _serve_config(args)
    assert config.num_requests == 32 and config.arrivals.kind == "gamma"
    assert config.arrivals.rate == 1.0
    closed = build_parser().parse_args(["bench", "serve", "--max-concurrency", "4"])
    assert _default_run(closed) == "no --num-requests or --duration: 32 requests"
    given = build_parser().parse_args(["bench", "serve", "--num-requests", "5"])
    assert _default_run(given) is None and _serve_config(given).arrivals.kind == "inf"
