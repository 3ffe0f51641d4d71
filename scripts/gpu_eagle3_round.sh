#!/usr/bin/env bash
# One round of eagle3 training on a single GPU, inside a fixed wall-clock budget:
#   1. regenerate data: the demo target's f32 greedy continuations (full matmul precision:
#      the model decode.py runs on CPU, up to f32 summation order) of every `def` site of
#      the corpus's training files (specjax.regenerate, stopped by --time-limit,
#      resumable);
#   2. probe: 30 steps of configs/drafters/eagle3_gpu.yaml, to measure tokens/s and the
#      compile time;
#   3. train: the same config with train.steps set so that the run (cosine schedule,
#      validation, best-tau snapshots) ends inside the budget; SIGTERM at the deadline
#      as a backstop (the best-tau snapshot is then exported here);
#   4. count the hot draft vocabulary (2,048 ids) on the new data, and copy the export,
#      the metrics and the data (gzip, in parts under 15 MiB) to OUT_DIR.
#
#   bash scripts/gpu_eagle3_round.sh BUDGET_S OUT_DIR
#
# A CPU smoke run (about 3 minutes): DATA=/tmp/d RUN=/tmp/r REGEN_EXTRA="--limit 100"
#   REGEN_BATCH=20 REGEN_LIMIT_S=20 BATCH=8 PROBE_STEPS=10 PYTHON=python \
#   bash scripts/gpu_eagle3_round.sh 300 /tmp/out
# Environment knobs: PYTHON, DATA, RUN, REGEN_LIMIT_S,
# REGEN_BATCH, REGEN_SEED, REGEN_EXTRA (more regenerate flags, e.g. --root DIR), BATCH,
# PROBE_STEPS, CONFIG, STEPS (train.steps; skips the probe), VAL (validation stream),
# TRAIN_EXTRA (more train.py flags, e.g. --set optim.lr=1.5e-4).
set -uo pipefail
BUDGET=${1:?budget in seconds}
OUTD=${2:?output directory}
START=$(date +%s)
el() { echo $(( $(date +%s) - START )); }
log() { echo "[$(el) s] $*"; }
PY=${PYTHON:-python3}
CFG=${CONFIG:-configs/drafters/eagle3_gpu.yaml}
DATA=${DATA:-runs/data/regen-gpu}
RUN=${RUN:-runs/drafter_eagle3_gpu}
BATCH=${BATCH:-128}
VAL=${VAL:-}
SEQ=256
PROBE_STEPS=${PROBE_STEPS:-30}
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-20}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/specjax_jaxcc}
mkdir -p "$OUTD"

$PY -c "import sys, jax, flax, optax, orbax.checkpoint, tokenizers, transformers
print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__,
      'optax', optax.__version__, jax.devices())" || exit 3
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv

log "1. regenerate -> $DATA"
JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m specjax.regenerate --out "$DATA" \
    --prompts-per-file 100000 --seed "${REGEN_SEED:-5}" --max-new-tokens 256 --dtype float32 \
    --batch-size "${REGEN_BATCH:-1024}" --time-limit "${REGEN_LIMIT_S:-120}" \
    ${REGEN_EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" || exit 4
[ -s "$DATA/train.npy" ] || exit 4

DSET=(--set data.tokens_npy="$DATA/train.npy" --set data.val_tokens_npy="${VAL:-$DATA/val.npy}")
if [ -n "${STEPS:-}" ]; then
  EVERY=$(( STEPS / 8 > 25 ? STEPS / 8 : 25 ))
  log "2. probe skipped: STEPS=$STEPS"
else
  log "2. probe ($PROBE_STEPS steps)"
  rm -rf "$RUN.probe"
  P0=$(date +%s)
  $PY train.py --config "$CFG" --run-dir "$RUN.probe" "${DSET[@]}" --set train.steps="$PROBE_STEPS" \
      --set train.batch_size="$BATCH" --set train.eval_every=0 --set train.eval_batches=1 \
      --set train.log_every=10 --set train.checkpoint_every=0 --set export.enabled=false \
      2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -5 || exit 5
  PROBE_S=$(( $(date +%s) - P0 ))
  read -r STEPS EVERY <<<"$($PY - "$RUN.probe/metrics.jsonl" "$PROBE_S" "$BUDGET" "$(el)" \
      "$BATCH" "$SEQ" "$PROBE_STEPS" <<'EOF'
import json, sys
path, probe_s, budget, now, batch, seq, probe_steps = sys.argv[1:]
recs = [json.loads(l) for l in open(path)]
tps = [r["tokens_per_s"] for r in recs if r.get("tokens_per_s")][-1]
step_s = int(batch) * int(seq) / tps
fixed = max(5.0, float(probe_s) - int(probe_steps) * step_s)  # compile, load, save
left = float(budget) - float(now) - 30 - 1.3 * fixed  # 30 s for step 4
steps = max(50, int(0.85 * left / step_s))  # 15% for validation and logging
print(steps, max(25, steps // 8))
print(f"probe: {tps:.0f} tokens/s, {step_s * 1e3:.1f} ms/step, fixed {fixed:.0f} s; "
      f"{left:.0f} s left -> {steps} steps", file=sys.stderr)
EOF
  )" || exit 6
fi
log "3. train $STEPS steps (validation every $EVERY)"
rm -rf "$RUN"
DEADLINE=$(( BUDGET - 45 - $(el) ))
timeout -s TERM "$DEADLINE" $PY train.py --config "$CFG" --run-dir "$RUN" "${DSET[@]}" \
    --set train.steps="$STEPS" --set train.batch_size="$BATCH" \
    --set train.eval_every="$EVERY" ${TRAIN_EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -25
log "train exited"

log "4. export, vocabulary, copy"
EXPORT=$RUN/drafter
if [ ! -f "$EXPORT/config.json" ]; then
  log "no export (stopped early): exporting the best-tau snapshot in bf16"
  $PY - "$RUN/best_drafter" "$EXPORT" <<'EOF' || exit 7
import json, os, sys
import jax.numpy as jnp
from specjax.drafters.io import load_drafter, save_drafter
src, dst = sys.argv[1:]
dcfg, params, meta = load_drafter(src, dtype=jnp.float32)
rec = json.load(open(os.path.join(src, "config.json")))
target = rec.get("target", {}).get("path") or "checkpoints/demo/target"
save_drafter(dst, dcfg, params, target, jnp.bfloat16, train_record=rec.get("train"))
EOF
fi
$PY -m specjax.drafters.vocab "$EXPORT" --size 2048 --tokens-npy "$DATA/train.npy" || exit 8
cp "$EXPORT/model.safetensors" "$OUTD/"
STAGE=$(mktemp -d)
cp "$EXPORT/config.json" "$EXPORT/draft_vocab.json" "$RUN/metrics.jsonl" \
   "$DATA/manifest.json" "$DATA/val.npy" "$STAGE/"
[ -f "$RUN.probe/metrics.jsonl" ] && cp "$RUN.probe/metrics.jsonl" "$STAGE/probe_metrics.jsonl"
tar -czf "$OUTD/results.tgz" -C "$STAGE" .
gzip -1 -c "$DATA/train.npy" | split -b 15M -d - "$OUTD/train.npy.gz.part"
ls -la "$OUTD"
log "done"
