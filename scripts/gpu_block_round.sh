#!/usr/bin/env bash
# One round of block-drafter training on a single GPU, inside a fixed wall-clock budget
# (issue 52): scripts/gpu_eagle3_round.sh's four stages (regenerate data on the GPU, a
# probe, a train run sized from the probe to end inside the budget, the hot vocabulary
# and the copy to OUT_DIR) with configs/drafters/block_gpu.yaml, into runs/drafter_block_gpu.
#
#   bash scripts/gpu_block_round.sh BUDGET_S OUT_DIR
#
# The same knobs as gpu_eagle3_round.sh (PYTHON, DATA, REGEN_*, BATCH, PROBE_STEPS, STEPS,
# VAL, TRAIN_EXTRA); CONFIG and RUN default to the block drafter's. A CPU smoke run (a few
# minutes): DATA=/tmp/d RUN=/tmp/r REGEN_EXTRA="--limit 100" REGEN_BATCH=20 \
#   REGEN_LIMIT_S=20 BATCH=8 PROBE_STEPS=10 PYTHON=python bash scripts/gpu_block_round.sh 300 /tmp/out
set -uo pipefail
export CONFIG=${CONFIG:-configs/drafters/block_gpu.yaml}
export RUN=${RUN:-runs/drafter_block_gpu}
exec bash "$(dirname "$0")/gpu_eagle3_round.sh" "$@"
