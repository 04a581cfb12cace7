"""`kvserve eval compare`: KL, top-1 and perplexity against direct computations, identity of a model
with itself, the report's hashes, and /manifest's view of a quantised artifact with its evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvserve.cli import main
from kvserve.model.kernel_choice import served_kernels
from kvserve.quant.compare import first_difference, window_stats
from kvserve.quant.pipeline import quantize_checkpoint
from kvserve.quant.provenance import EVALUATION_NAME, artifact_sha256
from kvserve.quant.scheme import parse_weight_scheme
from kvserve.server.manifest import build_manifest

TEXT = "def area(radius):\n    return 3.14159 * radius ** 2\n" * 20


def test_window_stats_match_direct_formulas():
    gen = torch.Generator().manual_seed(0)
    ref, cand = torch.randn(9, 50, generator=gen), torch.randn(9, 50, generator=gen)
    window = torch.randint(0, 50, (9,), generator=gen).tolist()
    stats = window_stats(ref, cand, window)
    expected_kl = F.kl_div(
        F.log_softmax(cand[:-1].double(), -1),
        F.log_softmax(ref[:-1].double(), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    torch.testing.assert_close(stats["kl"], expected_kl)
    nll = F.cross_entropy(ref[:-1].double(), torch.tensor(window[1:]), reduction="none")
    torch.testing.assert_close(stats["ref_nll"], nll)
    assert stats["top1"].tolist() == (ref[:-1].argmax(-1) == cand[:-1].argmax(-1)).tolist()
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1


def test_compare_cli_self_is_identity_and_quantised_differs(gpt2_model_dir, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    out = tmp_path / "self.json"
    common = ["--data", str(data), "--window", "64", "--num-prompts", "2", "--greedy-tokens", "6"]
    assert main(["eval", "compare", str(gpt2_model_dir), str(gpt2_model_dir), *common,
                 "--json", str(out), "--max-kl-mean", "1e-9"]) == 0  # fmt: skip
    same = json.loads(out.read_text())
    assert same["kl_mean"] < 1e-9 and same["top1_agreement"] == 1.0
    assert same["ppl_reference"] == pytest.approx(same["ppl_candidate"], rel=1e-9)
    assert same["greedy"]["identical_share"] == 1.0 and same["passed"] is True
    assert same["candidate"]["artifact_sha256"] == artifact_sha256(gpt2_model_dir)

    artifact = tmp_path / "q"
    quantize_checkpoint(gpt2_model_dir, artifact, weights="int4-pt")
    out = tmp_path / "q.json"
    # a bound the catastrophic per-tensor int4 fails: exit status 1, and the report says so
    assert main(["eval", "compare", str(gpt2_model_dir), str(artifact), *common,
                 "--json", str(out), "--max-kl-mean", "1e-6", "--record"]) == 1  # fmt: skip
    diff = json.loads(out.read_text())
    assert diff["kl_mean"] > 1e-6 and diff["passed"] is False
    assert diff["candidate"]["artifact_sha256"] == artifact_sha256(artifact)
    assert math.isfinite(diff["ppl_candidate"])
    manifest = build_manifest(
        artifact, served_model_name="q", dtype="float32", chat_template=None, engine_options={}
    )
    quant = manifest["quantization"]
    assert quant["scheme"] == "int4-pt" and quant["source"] == "checkpoint"
    recorded = json.loads((artifact / EVALUATION_NAME).read_text())
    assert quant["evaluation"] == {"sha256": recorded["sha256"], "passed": False, "current": True}
    at_load = build_manifest(
        gpt2_model_dir, served_model_name="m", dtype="float32", chat_template=None,
        engine_options={"quantization": "int8"}, **served_kernels(gpt2_model_dir, parse_weight_scheme("int8")),
    )  # fmt: skip
    assert at_load["quantization"]["scheme"] == "int8"
    assert at_load["quantization"]["kernel_isa"] in ("avx512", "avx2", "scalar", "unavailable")
