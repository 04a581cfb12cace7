"""benchmarks/act_rounding_mix.py on a tiny GGUF model (Q4_1 matrices, a Q8_0 tied table): every kind
of linear is found in the loader's order and rounded as its mix says (one kind twice is closer to the
exact model than none, all of them twice closer still), and a mix naming no kind is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.quant.kernels import kernels_available
from tests import REPO_ROOT
from tests.checkpoints import build_checkpoint
from tests.gguf_files import write_llama_gguf

SCRIPT = REPO_ROOT / "benchmarks" / "act_rounding_mix.py"


@pytest.mark.slow
@pytest.mark.skipif(not kernels_available(), reason="the integer panel kernel did not build")
def test_each_kind_is_rounded_as_its_mix_says(tmp_path):
    hf = build_checkpoint(tmp_path / "hf", "llama_tied", vocab_size=320, rope_scaling=None)
    gguf = write_llama_gguf(tmp_path / "m.gguf", hf, "Q4_1", "Q8_0")
    out = tmp_path / "mix.json"
    cmd = [sys.executable, str(SCRIPT), "all=int8", "all=int8,gate_up=int8x2", "all=int8x2",
           "--model", str(gguf), "--num-prompts", "1", "--greedy-tokens", "2", "--window", "32",
           "--max-tokens", "96", "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mix"] for r in rows] == ["all=int8", "all=int8,gate_up=int8x2", "all=int8x2"]
    assert rows[1]["rounding"] == {"qkv": "int8", "o": "int8", "gate_up": "int8x2",
                                   "down": "int8", "head": "int8"}  # fmt: skip
    kl = [r["prose"]["kl_mean"] + r["code"]["kl_mean"] for r in rows]
    assert kl[2] < kl[1] < kl[0]
    bad = subprocess.run([sys.executable, str(SCRIPT), "mlp=int8"], capture_output=True, text=True,
                         timeout=60, cwd=REPO_ROOT)  # fmt: skip
    assert bad.returncode != 0 and "bad mix item" in bad.stderr
