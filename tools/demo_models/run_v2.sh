#!/usr/bin/env bash
# Round 2 of the target (README.md, "Round 2"): continue the exported 2000-step target with a higher
# peak learning rate and a prose-heavy mix until it beats the draft by 15% on held-out perplexity of
# both kinds (or the step-time budget is spent), then a short instruction-tuning stage on pairs made
# from the corpus. Resumable: re-running skips finished stages and resumes from checkpoints.
#
#   nohup nice -n 19 bash tools/demo_models/run_v2.sh --cpu-lock > tools/demo_models/work/v2.out 2>&1 &
#
# INIT (default: the shipped target) is where stage 1 starts; extra arguments go to both stages.
# V2_STEPS=0 skips stage 1: the instruction stage then starts from INIT (what the shipped target did:
# README.md, "Round 2").
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
WORK=tools/demo_models/work
INIT=${INIT:-kvserve/assets/demo/target}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
mkdir -p "$WORK"
[ -f "$WORK/tokens/train_sft.bin" ] || "$PY" -m tools.demo_models.instruct

SFT_INIT="$WORK/runs/target_v2/final"
if [ "${V2_STEPS:-380}" = 0 ]; then SFT_INIT="$INIT"; else
"$PY" -m tools.demo_models.train --model target --run-dir "$WORK/runs/target_v2" --init-from "$INIT" \
  --steps ${V2_STEPS:-380} --batch-size 8 --seq-len 512 --lr 2e-3 --warmup-steps 30 \
  --mix code:3,prose:5 --ppl-every ${V2_PPL_EVERY:-100} --goal-vs kvserve/assets/demo/draft --goal-margin 0.15 \
  --max-train-s ${V2_MAX_S:-3000} --checkpoint-every-s 300 "$@"
fi
"$PY" -m tools.demo_models.train --model target --run-dir "$WORK/runs/target_sft" \
  --init-from "$SFT_INIT" --steps ${SFT_STEPS:-70} --batch-size 8 --seq-len 512 \
  --lr ${SFT_LR:-5e-4} --warmup-steps 10 --mix code:2,prose:2,sft:4 --ppl-every ${SFT_STEPS:-70} \
  --checkpoint-every-s 300 "$@"
echo "round 2 done: $(date -u +%FT%TZ)"
