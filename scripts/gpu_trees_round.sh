#!/usr/bin/env bash
# Issue 30 on an accelerator: benchmarks/trees.py (chain vs K drafts vs EAGLE-2 trees vs
# LogitSpec vs n-gram, each against autoregressive decoding in the same process) in
# stages that each fit their own time limit, so a stage cut off still leaves the
# stages before it in OUT/trees_gpu*.json.
#
#   [STAGES="f32 t1_b4 ..."] bash scripts/gpu_trees_round.sh OUT_DIR [BUDGET_SECONDS]
#
# The working tree a device call carries is limited (64 MiB); the demo target and the
# two drafters alone are ~68 MB, so the caller brings them packed as
# .devpack/ckpt.tar.xz (scripts/device_pack.sh pack / hide, carry [".devpack"], restore),
# which this script unpacks first.
set -uo pipefail
OUTD=${1:?usage: gpu_trees_round.sh OUT_DIR [BUDGET_SECONDS]}
BUDGET=${2:-520}
cd "$(dirname "$0")/.." || exit 2
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
mkdir -p "$OUTD"
LOG="$OUTD/trees_gpu.log"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TQDM_DISABLE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PYTHON=$PY bash scripts/device_pack.sh unpack || exit 2
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} >"$OUTD/environment.txt" 2>&1
cat "$OUTD/environment.txt" | tee -a "$LOG"
stage() {  # stage NAME SECONDS JSON ARGS...: one trees.py run merged into OUT/JSON
  local name=$1 secs=$2 json="$OUTD/$3"; shift 3
  local l; l=$(left)
  [ "$secs" -gt $(( l - 10 )) ] && secs=$(( l - 10 ))
  if [ "$secs" -lt 30 ]; then echo "[gpu_trees] skip $name ($l s left)" | tee -a "$LOG"; return; fi
  echo "[gpu_trees] $name: up to $secs s" | tee -a "$LOG"
  timeout "$secs" $PY benchmarks/trees.py --json "$json" --merge "$@" 2>&1 \
    | grep -v "^\s*$" | tail -60 >>"$LOG"
  echo "[gpu_trees] $name rc=${PIPESTATUS[0]} after $(( $(date +%s) - START )) s" | tee -a "$LOG"
}
# What the H200 round of 2026-11-27 left open (benchmarks/results/trees_h200_raw:
# T = 0 at B = 1 took 137 s with step timing, the four-system T = 1 run 163 s, the T = 0
# B = 4 stage 83 s): greedy identity with an f32 target, T = 1 at B = 4, and the T = 1
# systems not yet measured there. STAGES picks and orders them (default: all three).
for st in ${STAGES:-f32 t1_b4 t1_b1_rest}; do
  case $st in
    f32) stage f32 "${F32_S:-110}" trees_gpu_f32.json --dtype float32 --temperatures 0 \
           --batch-sizes 1 --warmup 1 --no-step-timing \
           --only "eagle3 chain" "eagle3 tree 4x32" "logitspec" "ngram chain" ;;
    t1_b4) stage t1_b4 "${T4_S:-190}" trees_gpu.json --temperatures 1 --batch-sizes 4 \
             --warmup 1 --no-step-timing --only "eagle3 chain" "eagle3 K=4" "ngram chain" ;;
    t1_b1_rest) stage t1_b1_rest "${TR_S:-200}" trees_gpu.json --temperatures 1 \
                  --batch-sizes 1 --warmup 1 --no-step-timing --only "eagle3 K=2" \
                  "eagle3 tree 2x12" "block chain" "block tree 4x16" "logitspec" "ngram K=3" ;;
    t0_b1) stage t0_b1 "${T0_S:-200}" trees_gpu.json --temperatures 0 --batch-sizes 1 \
             --warmup 1 ;;
    *) echo "[gpu_trees] unknown stage $st" | tee -a "$LOG" ;;
  esac
done
echo "[gpu_trees] done after $(( $(date +%s) - START )) s" | tee -a "$LOG"
