#!/usr/bin/env bash
# Rounds 2-4 of the target (README.md, "Rounds 2-4: the shipped target"): from the exported 2000-step
# target (round 1), continued pre-training at peak 7e-4 on a prose-heavy mix (round 2), a mixed stage at
# a low peak where a quarter of the rows are instruction pairs made from the corpus (round 3), and a
# short instruction stage where half are (round 4). This is the recipe of the shipped target.
# Resumable: re-running resumes each stage from its checkpoint and skips finished ones. Export chains
# the rounds' cards (README.md, "Export of a chain").
#
#   nohup nice -n 19 bash tools/demo_models/run_v2.sh --cpu-lock > tools/demo_models/work/v2.out 2>&1 &
#
# INIT (default: round 1's target, the one shipped until commit cf54529, taken out of git) is where the
# first stage starts; extra arguments go to every stage.
# THREADS (default 2) torch threads per stage; the shipped run used 2 (~3.2-3.9 s per step here).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
WORK=tools/demo_models/work
ROUND1_COMMIT=cf54529  # the last commit whose kvserve/assets/demo/target is round 1's
if [ -z "${INIT:-}" ]; then
  INIT="$WORK/round1/target"
  if [ ! -f "$INIT/model.safetensors" ]; then
    mkdir -p "$WORK/round1"
    git archive "$ROUND1_COMMIT" kvserve/assets/demo/target | tar -x -C "$WORK/round1" --strip-components 3
  fi
fi
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
mkdir -p "$WORK"
[ -f "$WORK/tokens/train_sft.bin" ] || "$PY" -m tools.demo_models.instruct

"$PY" -m tools.demo_models.train --model target --run-dir "$WORK/runs/target_v4" --init-from "$INIT" \
  --steps 600 --batch-size 8 --seq-len 512 --lr 7e-4 --warmup-steps 30 --threads "$THREADS" \
  --mix code:3,prose:5 --ppl-every 150 --checkpoint-every-s 300 "$@"
"$PY" -m tools.demo_models.train --model target --run-dir "$WORK/runs/target_mix5" \
  --init-from "$WORK/runs/target_v4/final" --steps 240 --batch-size 8 --seq-len 512 \
  --lr 3e-4 --warmup-steps 20 --threads "$THREADS" --mix code:3,prose:3,sft:2 --ppl-every 60 \
  --checkpoint-every-s 120 "$@"
"$PY" -m tools.demo_models.train --model target --run-dir "$WORK/runs/target_sft6" \
  --init-from "$WORK/runs/target_mix5/final" --steps 60 --batch-size 8 --seq-len 512 \
  --lr 3e-4 --warmup-steps 10 --threads "$THREADS" --mix code:2,prose:2,sft:4 --ppl-every 30 \
  --checkpoint-every-s 120 "$@"
echo "rounds 2-4 done: $(date -u +%FT%TZ)"
