set -x
PY=/work/main/.venv/bin/python
BIN=/tmp/kv/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
F="linear=int8,head=int8;linear=int4-g32,head=int8"
cd /tmp/h13h/final && PYTHONPATH=/tmp/h13h/final $PY benchmarks/step_profile.py --formats "$F" --rounds 2 --out /tmp/h13h/profile_final.json 2>&1 | grep -v Warn
for tree in base final; do
  cd /tmp/h13h/$tree && PYTHONPATH=/tmp/h13h/$tree $PY benchmarks/quant.py speed --llama-bin $BIN --formats "$F" --batches 1 --out /tmp/h13h/ab_${tree}_3.json 2>&1 | grep -v Warn
done
