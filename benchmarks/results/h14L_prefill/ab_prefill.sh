#!/bin/bash
# prefill: chunk attention microbenchmark; long_context (128, 4000; 3,000-token TTFT) A B A B; llama-bench pp3000
cd /work/wt/h14L
echo "== chunk attention"; PYTHONPATH=/work/wt/h14L /work/main/.venv/bin/python benchmarks/results/h14L_prefill/chunk_attention.py 2>&1 | grep -v USDT
echo "== llama-bench pp3000"; /tmp/kv/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench -m /tmp/kv/smol-gpt2-f32.gguf -p 3000 -n 0 -r 2 -o json > /tmp/h14L/llama_pp3000.json 2>/tmp/h14L/llama_pp3000.err; grep -E '"avg_ts"|"n_threads"' /tmp/h14L/llama_pp3000.json
for r in 1 2; do
  for tree in main h14L; do
    dir=/work/main; [ $tree = h14L ] && dir=/work/wt/h14L
    echo "== $tree r$r"
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python /work/wt/h14L/benchmarks/long_context.py --model /tmp/kv/smol-gpt2 --contexts 128,4000 --ttft-prompt 3000 --out /tmp/h14L/pf_${tree}_r$r.json 2>&1 | grep -v -i "warn\|USDT")
  done
done
