#!/usr/bin/env bash
# Issue 30 on an accelerator: benchmarks/trees.py (chain vs K drafts vs EAGLE-2 trees vs
# LogitSpec vs n-gram, each against autoregressive decoding in the same process) in
# stages that each fit their own time limit, so a stage cut off still leaves the
# stages before it in OUT/trees_gpu.json.
#
#   bash scripts/gpu_trees_round.sh OUT_DIR [BUDGET_SECONDS]
#
# The working tree a device call carries is limited (64 MiB); the demo target and the
# two drafters alone are ~68 MB, so a caller may bring them packed as
# .devpack/ckpt.tar.xz (checkpoints/demo/{target,drafters/eagle3,drafters/block}),
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
if [ -f .devpack/ckpt.tar.xz ] && [ ! -f checkpoints/demo/target/config.json ]; then
  $PY -c "import tarfile; tarfile.open('.devpack/ckpt.tar.xz').extractall('.')" || exit 2
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} >"$OUTD/environment.txt" 2>&1
cat "$OUTD/environment.txt" | tee -a "$LOG"
J="$OUTD/trees_gpu.json"
stage() {  # stage NAME SECONDS ARGS...: one trees.py run merged into $J
  local name=$1 secs=$2; shift 2
  local l; l=$(left)
  [ "$secs" -gt $(( l - 10 )) ] && secs=$(( l - 10 ))
  if [ "$secs" -lt 30 ]; then echo "[gpu_trees] skip $name ($l s left)" | tee -a "$LOG"; return; fi
  echo "[gpu_trees] $name: up to $secs s" | tee -a "$LOG"
  timeout "$secs" $PY benchmarks/trees.py --json "$J" --merge "$@" 2>&1 \
    | grep -v "^\s*$" | tail -60 >>"$LOG"
  echo "[gpu_trees] $name rc=${PIPESTATUS[0]} after $(( $(date +%s) - START )) s" | tee -a "$LOG"
}
stage t0_b1 "${T0_S:-230}" --temperatures 0 --batch-sizes 1 --warmup 1
stage t1_b1 "${T1_S:-170}" --temperatures 1 --batch-sizes 1 --warmup 1 --no-step-timing \
  --only "eagle3 chain" "eagle3 K=2" "eagle3 K=4" "eagle3 tree 4x32" "ngram chain" "ngram K=3"
stage t0_b4 "${T4_S:-200}" --temperatures 0 --batch-sizes 4 --warmup 1 --no-step-timing \
  --only "eagle3 chain" "eagle3 K=4" "eagle3 tree 2x12" "eagle3 tree 4x32" "logitspec" "ngram chain"
echo "[gpu_trees] done after $(( $(date +%s) - START )) s" | tee -a "$LOG"
