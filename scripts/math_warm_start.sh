#!/usr/bin/env bash
# The warm start of the real-task example (configs/math.yaml, docs/TASKS.md "The example"):
# six chained `looprl sft` calls on configs/data/math_copy's reference answers (70 AdamW steps
# in all, lr 3e-3, batch 32), each from the last one's checkpoint with its own seed, from the
# fresh tiny Huginn (model.family/size/init_seed of the config). The result, OUT/s70, answers
# in the " #### N" format and has begun to read the number in the question (greedy test
# accuracy 0.38); `looprl run --config configs/math.yaml model.path=OUT/s70` then trains it
# with GRPO. Deterministic on one machine (two runs here wrote identical weights).
#
#   bash scripts/math_warm_start.sh [OUT]     # from the repository root; OUT: runs/math-sft
#
# Why chained: one 60-100 step `looprl sft` call from the fresh model (seed 0, lr 3e-3 or 5e-3)
# learned the format but not yet the number (accuracy 0.04-0.14); this chain had, at 70 steps.
# One 120-step call had just crossed over (0.23), but RL from it kept the format with one
# seed of two (docs/TASKS.md).
set -euo pipefail
OUT=${1:-runs/math-sft}
SFT=(looprl sft --config configs/math.yaml)
"${SFT[@]}" --out "$OUT/s10" --steps 10 --seed 0
"${SFT[@]}" --model "$OUT/s10" --out "$OUT/s20" --steps 10 --seed 10
"${SFT[@]}" --model "$OUT/s20" --out "$OUT/s40" --steps 20 --seed 20
"${SFT[@]}" --model "$OUT/s40" --out "$OUT/s50" --steps 10 --seed 40
"${SFT[@]}" --model "$OUT/s50" --out "$OUT/s60" --steps 10 --seed 50
"${SFT[@]}" --model "$OUT/s60" --out "$OUT/s70" --steps 10 --seed 60
