"""`kvserve eval compare --reference-quantization / --candidate-kv-cache-dtype` on the demo model, and the
shipped held-out evaluation text (kvserve/assets/eval)."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.evaluation import read_documents
from kvserve.models import ASSETS_DIR

EVAL_DIR = ASSETS_DIR.parent / "eval"
COMMON = ["--window", "48", "--max-tokens", "192", "--num-prompts", "2", "--greedy-tokens", "4"]


def _compare(tmp_path, name: str, *options: str) -> dict:
    out = tmp_path / f"{name}.json"
    data = str(EVAL_DIR / "code.jsonl")
    args = ["eval", "compare", "kvserve-demo", "kvserve-demo", "--data", data, *COMMON, *options]
    assert main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_reference_quantization_swaps_the_roles(tmp_path):
    forward = _compare(tmp_path, "fwd", "--candidate-quantization", "int8")
    backward = _compare(tmp_path, "bwd", "--reference-quantization", "int8")
    # the same two models on the same windows: the perplexities trade places exactly, the argmaxes
    # agree at the same positions, and the report names which side was quantised
    assert backward["ppl_reference"] == forward["ppl_candidate"]
    assert backward["ppl_candidate"] == forward["ppl_reference"]
    assert backward["top1_agreement"] == forward["top1_agreement"] < 1.0
    assert backward["kl_mean"] > 0 and forward["kl_mean"] > 0
    assert backward["reference"]["quantization"] == "int8"
    assert backward["candidate"]["quantization"] is None
    both = _compare(
        tmp_path, "both", "--reference-quantization", "int8", "--candidate-quantization", "int8"
    )
    assert both["kl_mean"] == 0.0 and both["top1_agreement"] == 1.0
    assert both["ppl_reference"] == both["ppl_candidate"] == forward["ppl_candidate"]


def test_candidate_kv_cache_dtype(tmp_path):
    plain = _compare(tmp_path, "plain")
    assert plain["kl_mean"] == 0.0 and "kv_cache_dtype" not in plain["candidate"]
    reports = {kind: _compare(tmp_path, kind, "--candidate-kv-cache-dtype", kind)
               for kind in ("int8", "fp8")}  # fmt: skip
    for kind, report in reports.items():
        assert report["candidate"]["kv_cache_dtype"] == kind
        assert "kv_cache_dtype" not in report["reference"]
        assert report["candidate"]["sha256"] != plain["candidate"]["sha256"]
        assert report["ppl_reference"] == plain["ppl_reference"]
        assert 0 < report["kl_mean"] < 0.01, kind  # a small, nonzero change of the logits
    # e4m3 keeps 3 mantissa bits per value where int8 keeps ~7 at the same per-vector scale
    assert reports["fp8"]["kl_mean"] > reports["int8"]["kl_mean"]


@pytest.mark.parametrize(
    "option", [["--candidate-kv-cache-dtype", "int8"], ["--candidate-quantization", "int8"]]
)
def test_record_refused_for_options_applied_at_load(tmp_path, capsys, option):
    data = str(EVAL_DIR / "prose.jsonl")
    args = ["eval", "compare", str(tmp_path), str(tmp_path), "--data", data, "--record", *option]
    assert main(args) == 2
    assert option[0] in capsys.readouterr().err


def test_eval_text_ships_with_its_licence():
    licence = (EVAL_DIR / "README.md").read_text()
    for name, min_words in (("prose.jsonl", 2300), ("code.jsonl", 1200)):
        documents = read_documents(EVAL_DIR / name)
        assert len(documents) >= 5 and all(d.strip() for d in documents)
        assert sum(len(d.split()) for d in documents) >= min_words
        assert name in licence
    assert "Apache License 2.0" in licence
    for document in read_documents(EVAL_DIR / "code.jsonl"):
        compile(document, "<code.jsonl>", "exec")  # every code document is valid Python
