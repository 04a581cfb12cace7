#!/usr/bin/env bash
# The whole CPU training run as one background job: corpus and tokenizer if missing, then the draft
# (quick), then the target. Re-running the same command resumes from the latest checkpoints and skips
# finished models. Sizes and step counts are sized for ~3.5 h on one CPU thread (README.md, "Budget").
#
#   nohup bash tools/demo_models/run_training.sh > tools/demo_models/work/train.out 2>&1 &
#
# Extra arguments go to both train invocations (e.g. --device cuda --threads 8).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
WORK=tools/demo_models/work
mkdir -p "$WORK"
echo $$ > "$WORK/train.pid"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}

if [ ! -f "$WORK/tokens/train_code.bin" ]; then
  "$PY" -m tools.demo_models.corpus
  "$PY" -m tools.demo_models.tokenizer
fi
"$PY" -m tools.demo_models.train --model draft --steps 1500 --batch-size 8 --seq-len 512 \
  --lr 3e-3 --warmup-steps 100 "$@"
"$PY" -m tools.demo_models.train --model target --steps 1400 --batch-size 8 --seq-len 512 \
  --lr 1.5e-3 --warmup-steps 100 "$@"
# The 1400-step target lost to the draft on held-out perplexity, so the run was extended: same seed and
# data stream, the cosine recomputed for 2000 steps (README.md, "Budget").
"$PY" -m tools.demo_models.train --model target --steps 2000 --batch-size 8 --seq-len 512 \
  --lr 1.5e-3 --warmup-steps 100 "$@"
bash tools/demo_models/run_v2.sh "$@"
echo "all training done: $(date -u +%FT%TZ)"
