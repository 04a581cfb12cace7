#!/bin/bash
# A B A B: main vs h14L, long_context.py decode steps (batch 1) and 128-token TTFT
for r in 1 2; do
  for tree in main h14L; do
    dir=/work/main; [ $tree = h14L ] && dir=/work/wt/h14L
    echo "== $tree r$r"
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python /work/wt/h14L/benchmarks/long_context.py --model /tmp/kv/smol-gpt2 --ttft-prompt 128 --out /tmp/h14L/long_${tree}_r$r.json 2>&1 | grep -v Warning)
  done
done
