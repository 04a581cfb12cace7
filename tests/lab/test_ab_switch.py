"""benchmarks/ab_switch.py: two kernel settings in one process. Its sign test against exact binomial
tails, and the harness on a tiny checkpoint: a switch that keeps the bits says equal, and a second build
of the C sources with one deliberate change (sources:DIR) is really the one that runs (its bits differ);
the captured step is a decode step of the whole batch when the prompts end in different steps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvserve.model import fused_decode
from kvserve.model.cpu_kernels import SOURCE_DIR, kernel_available
from tests import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "benchmarks"))

from ab_switch import capture, sign_test_p  # noqa: E402


def test_sign_test_is_the_two_sided_binomial_tail():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 5) == 1.0
    assert sign_test_p(10, 0) == pytest.approx(2 / 1024)
    assert sign_test_p(3, 7) == pytest.approx(2 * (1 + 10 + 45 + 120) / 1024)
    assert sign_test_p(7, 3) == sign_test_p(3, 7)


def _run(model_dir, tmp_path, switch: str, *extra: str) -> dict:
    out = tmp_path / "ab.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ab_switch.py"), "--model", str(model_dir),
           "--switch", switch, "--target", "step", "--batch", "2", "--alternations", "2",
           "--block", "1", "--out", str(out), *extra]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(not kernel_available(), reason="the C kernels did not build")
def test_a_switch_that_keeps_the_bits_reports_equal_bits(gpt2_model_dir, tmp_path):
    report = _run(gpt2_model_dir, tmp_path, "guided")
    assert report["bits_equal"] is True
    assert (report["a"], report["b"]) == ("fixed shares", "guided")
    assert len(report["a_ms"]) == len(report["b_ms"]) == 2
    assert report["pairs_above_1"] + report["pairs_below_1"] <= 2


@pytest.mark.slow
@pytest.mark.skipif(not kernel_available(), reason="the C kernels did not build")
def test_a_second_build_of_the_sources_is_the_one_that_runs(gpt2_model_dir, tmp_path):
    changed = tmp_path / "csrc"
    shutil.copytree(SOURCE_DIR, changed)
    layer_ops = changed / "layer_ops.c"
    text = layer_ops.read_text()
    line = "float inv = 1.f / sqrtf(sum / dim + eps);"
    assert line in text
    layer_ops.write_text(text.replace(line, "float inv = 1.001f / sqrtf(sum / dim + eps);"))
    report = _run(gpt2_model_dir, tmp_path, f"sources:{changed}")
    assert report["bits_equal"] is False  # the changed RMSNorm ran under B


@pytest.mark.slow
@pytest.mark.skipif(not kernel_available(), reason="the C kernels did not build")
def test_a_build_of_sources_without_the_token_lookups_still_runs_the_step(gpt2_model_dir, tmp_path):
    """Sources older than decode_step_tokens (the embedding and RoPE lookups in C) have only
    decode_layers: the fused step then looks the rows up in torch, with the same bits."""
    older = tmp_path / "csrc"
    shutil.copytree(SOURCE_DIR, older)
    step_c = older / "decode_step.c"
    text = step_c.read_text()
    cut = text.index("/* ---- the step from token ids")
    step_c.write_text(text[:cut])
    report = _run(gpt2_model_dir, tmp_path, f"sources:{older}")
    assert report["bits_equal"] is True


@pytest.mark.slow
@pytest.mark.skipif(not kernel_available(), reason="the C kernels did not build")
def test_the_captured_step_has_every_row_when_prompts_end_in_different_steps(gpt2_model_dir):
    """Three 40-token prompts under a 32-token budget end in different steps. The last fused step of a
    3-token generate is then one row (the others finished): it timed a 1-row step as a 3-row one."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(gpt2_model_dir), max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(40)] for i in range(3)]
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    llm.generate(prompts, greedy.with_updates(max_tokens=3))  # builds the fused step
    seen = capture(llm, prompts, greedy)
    _, inputs = seen["step"]
    block_table, context_lens = inputs[4], inputs[5]
    assert block_table.shape[0] == 3 and len({tuple(r) for r in block_table.tolist()}) == 3
    assert all(c > 40 for c in context_lens.tolist())  # decode rows, past each prompt
    _, (head_rows,) = seen["head"]
    assert head_rows.shape[0] == 3


@pytest.mark.slow
@pytest.mark.skipif(not kernel_available(), reason="the C kernels did not build")
@pytest.mark.skipif(
    kernel_available() and fused_decode.isa() == "scalar", reason="the changed tile is AVX2 code"
)
def test_the_linear_target_times_the_models_own_panel_linear_on_each_build(
    gpt2_model_dir, tmp_path
):
    """--target linear: one of the model's quantised linears through small_linear, under each build
    (a copy of qgemv.c whose int4 tile scales its results is the one that runs under B). 3 rows: the
    one-panel tile on AVX2 and AVX-512 alike (more rows take two-panel tiles on AVX-512)."""
    changed = tmp_path / "csrc"
    shutil.copytree(SOURCE_DIR, changed)
    qgemv = changed / "qgemv.c"
    text = qgemv.read_text()
    line = "    store_rows(L, acc, y, m0, R, p);\n}"
    assert text.count(line) == 1  # the int4 tile's store
    qgemv.write_text(
        text.replace(
            line,
            "    for (int r = 0; r < R; r++) acc[r] = _mm256_mul_ps(acc[r], _mm256_set1_ps(1.001f));\n"
            + line,
        )
    )
    args = ("--quantization", "int4-g32", "--target", "linear", "--linear", "mlp", "--batch", "3")
    report = _run(gpt2_model_dir, tmp_path, f"sources:{changed}", *args)
    assert report["target"] == "linear" and "int4-g32" in report["linear"]
    assert report["batch"] == 3 and len(report["a_ms"]) == 2
    assert report["bits_equal"] is False  # the changed tile ran under B


@pytest.mark.slow
@pytest.mark.skipif(not kernel_available(), reason="the C kernels did not build")
def test_the_norms_switch_times_gemmas_norms_as_torch_ops_and_on_the_c_kernel(
    gpt2_model_dir, tmp_path
):
    """--switch norms: Gemma 3's offset RMSNorms as torch ops under A, on the C RMSNorm under B, in
    one engine (the whole decode); a model without them is refused."""
    from tests.checkpoints import build_checkpoint

    gemma = tmp_path / "gemma3"
    build_checkpoint(gemma, "gemma3")
    report = _run(gemma, tmp_path, "norms", "--target", "decode", "--block", "3")
    assert (report["a"], report["b"]) == ("torch norms", "C norms")
    assert report["target"] == "decode" and len(report["b_ms"]) == 2
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ab_switch.py"), "--model", str(gpt2_model_dir),
           "--switch", "norms", "--target", "decode"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0 and "no offset RMSNorms" in result.stderr
