"""Issue 46 item 7: the first start compiled the C kernels for minutes behind "loading ..." on a busy
machine. `make install` now builds them; this checks that the Makefile's own build command leaves
nothing for serving to compile: a fresh kernel cache, the install step's command as the Makefile writes
it, then an engine started with the compiler made unavailable still has its kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests import REPO_ROOT

ROOT = REPO_ROOT

NO_COMPILER = """
import subprocess, sys
real = subprocess.run
def refuse(cmd, *a, **k):
    if any(str(c).endswith(("cc", "gcc", "g++", "c++")) for c in cmd[:1]):
        raise SystemExit("serving tried to compile: " + " ".join(map(str, cmd[:3])))
    return real(cmd, *a, **k)
subprocess.run = refuse
from kvserve import LLM, SamplingParams
from kvserve.model import cpu_kernels
llm = LLM(sys.argv[1], num_blocks=32)
assert cpu_kernels.load_kernel() is not None, "no kernels"
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 3
print("served without compiling")
"""


def test_the_install_step_builds_every_kernel_serving_loads(tmp_path, llama_dir):
    makefile = (ROOT / "Makefile").read_text()
    (command,) = re.findall(r'\$\(BIN\)/python -c "(from kvserve\.model\.cpu_kernels import [^"]+)"',
                            makefile)  # fmt: skip
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path / "cache")}
    built = subprocess.run([sys.executable, "-c", command], env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert list((tmp_path / "cache").rglob("kvserve_cpu-*.so")), "the install step built nothing"
    served = subprocess.run([sys.executable, "-c", NO_COMPILER, str(llama_dir)], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert served.returncode == 0, served.stderr[-3000:]
    assert "served without compiling" in served.stdout
