set -x
PY=/work/main/.venv/bin/python
BIN=/tmp/kv/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
F="linear=int8,head=int8;linear=int4-g32,head=int8"
for r in 1 2; do for tree in base new; do
  cd /tmp/h13h/$tree && PYTHONPATH=/tmp/h13h/$tree $PY benchmarks/quant.py speed --llama-bin $BIN --formats "$F" --batches 1 --out /tmp/h13h/ab_${tree}_$r.json 2>&1 | grep -v Warn
done; done
for tree in base new; do
  cd /tmp/h13h/$tree && PYTHONPATH=/tmp/h13h/$tree $PY benchmarks/step_profile.py --formats "$F;linear=int4-g32,head=int4-g32" --rounds 2 --out /tmp/h13h/profile_$tree.json 2>&1 | grep -v Warn
done
