"""Identity metadata, server counters from /metrics, compare verdicts, the layering contract."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from kvserve.lab.bench.compare import compare_runs, format_comparison
from kvserve.lab.bench.identity import identity_fields
from kvserve.lab.bench.prometheus import server_counters
from kvserve.lab.bench.records import RequestRecord, write_jsonl
from tests import REPO_ROOT

BENCH = REPO_ROOT / "kvserve" / "bench"


def test_identity_from_a_kvserve_like_server_and_labels():
    probes = {
        "/ready": {"status": "ready", "model": "tiny", "manifest_sha256": "ab" * 32},
        "/manifest": {"sha256": "ab" * 32, "manifest": {
            "engine": "kvserve", "engine_version": "0.1.0",
            "weights_sha256": {"m.safetensors": "c" * 64},
            "tokenizer_sha256": {"tokenizer.json": "d" * 64}, "dtype": "bfloat16",
            "quantization": None, "kv_cache_dtype": "bfloat16", "max_model_len": None}},
        "/v1/models": {"data": [{"id": "tiny", "owned_by": "kvserve", "max_model_len": 2048}]},
    }  # fmt: skip
    fields = identity_fields(probes, {"hardware": "H200"}, ["fp_0123"])
    assert fields["hardware"] == {"value": "H200", "source": "--label"}
    assert fields["manifest_sha256"] == {"value": "ab" * 32, "source": "/ready:manifest_sha256"}
    assert fields["model_sha256"]["value"] == {"m.safetensors": "c" * 64}
    assert fields["engine_version"] == {"value": "0.1.0", "source": "/manifest:engine_version"}
    assert fields["quantization"] == {"value": None, "source": "/manifest:quantization"}
    assert fields["cache_dtype"]["value"] == "bfloat16"
    assert fields["max_model_len"] == {"value": 2048, "source": "/v1/models:max_model_len"}
    assert fields["system_fingerprints_seen"]["value"] == ["fp_0123"]
    bare = identity_fields({}, {}, ["fp_9"])
    assert bare["dtype"] == {"value": None, "source": "unreported"}
    assert bare["manifest_sha256"] == {"value": "fp_9", "source": "response system_fingerprint"}


def test_server_counters_match_vllm_and_kvserve_names():
    before = (
        "# HELP vllm:request_queue_time_seconds x\n"
        'vllm:request_queue_time_seconds_sum{model_name="m"} 1.0\n'
        'vllm:request_queue_time_seconds_count{model_name="m"} 4\n'
        "vllm:prefix_cache_hits_total 10\nvllm:prefix_cache_queries_total 100\n"
        "vllm:spec_decode_num_accepted_tokens_total 30\n"
        "vllm:spec_decode_num_draft_tokens_total 50\n"
        "kvserve_num_preemptions 2\n"
    )
    after = (
        'vllm:request_queue_time_seconds_sum{model_name="m"} 4.0\n'
        'vllm:request_queue_time_seconds_count{model_name="m"} 10\n'
        "vllm:prefix_cache_hits_total 70\nvllm:prefix_cache_queries_total 200\n"
        "vllm:spec_decode_num_accepted_tokens_total 90\n"
        "vllm:spec_decode_num_draft_tokens_total 130\n"
        "kvserve_num_preemptions 5\n"
    )
    c = server_counters(before, after)
    assert c["mean_queue_time_s"] == 0.5 and c["num_queue_time_samples"] == 6
    assert c["prefix_cache_hit_rate"] == 0.6
    assert c["speculative_acceptance_rate"] == 0.75
    assert c["num_preemptions"] == 3
    assert server_counters(None, None)["source"] == "not reported"


def _write_run(path: Path, outputs: list[str], mode: str = "natural") -> None:
    path.mkdir()
    records = [
        RequestRecord(
            f"req-{i:06d}",
            i,
            "measured",
            "ok",
            0.0,
            0.0,
            1.0,
            8,
            output_sha256=out,
            prompt_sha256=f"p{i}",
        )  # fmt: skip
        for i, out in enumerate(outputs)
    ]
    write_jsonl(path / "requests.jsonl", records)
    summary = {"metadata": {"mode": mode, "sampling": {"temperature": 0.0}},
               "counts": {"ok": len(outputs)}, "throughput": {"requests_per_s": 2.0}}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))


def test_compare_verdicts(tmp_path):
    _write_run(tmp_path / "a", ["x", "y", "z"])
    _write_run(tmp_path / "b", ["x", "y", "z"])
    _write_run(tmp_path / "c", ["x", "Y", "z"], mode="forced")
    same = compare_runs(tmp_path / "a", tmp_path / "b")
    assert same["outputs"]["all_identical"] and not same["not_comparable"]
    diff = compare_runs(tmp_path / "a", tmp_path / "c")
    assert diff["outputs"]["differing_indices"] == [1] and not diff["outputs"]["all_identical"]
    assert diff["not_comparable"] == ['mode differs: "natural" vs "forced"']
    text = format_comparison(diff)
    assert "DIFFER: 2/3" in text and "NOT COMPARABLE: mode differs" in text


def test_bench_talks_http_only():
    """kvserve.lab.bench (but the offline `latency` bench) imports nothing from the engine's layers."""
    forbidden = ("kvserve.engine", "kvserve.runner", "kvserve.model", "kvserve.sched", "kvserve.kv",
                 "kvserve.server", "torch")  # fmt: skip
    for path in sorted(BENCH.glob("*.py")) + [BENCH.parent / "cli" / "bench.py"]:
        if path.name == "latency.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"
