#!/usr/bin/env bash
# One device round inside a wall-clock budget; everything it writes lands under --out
# (the folder a device session brings back):
#   1-4. benchmarks/device_round.py: environment, every Pallas kernel against its jnp
#        reference (verification greedy/token/block, decode attention causal/block/split-S/
#        layer-major, packed attention forward + backward; demo and Qwen3-8B shapes, f32
#        and bf16), their timings against the jnp path with bytes and roofline fraction,
#        decode.py --kernels pallas against --kernels off on the demo, and a Qwen3-8B-shaped
#        random bf16 target (autoregressive tokens/s, self-drafting loop overhead);
#        -> OUT/device_round.json, OUT/device_round.log
#   5.   with what is left (STUDY_S or more seconds): the KVShot study's data, the demo
#        target's f32 greedy continuations (the settings of configs/study2/'s
#        benchmarks/data/study2: seed 5, 256 new tokens), -> OUT/study_{train,val}.npy.gz and
#        OUT/study_manifest.json; STEP5=eagle3 runs scripts/gpu_eagle3_round.sh instead;
#        STEP5=study trains and measures the KVShot matrix (benchmarks/studies/kvshot/kvshot_device.py all
#        -> OUT/study_train.tar.gz, OUT/study_measure.tar.gz).
#
#   bash scripts/device_round.sh --budget SECONDS --out DIR [--dry-run]
#
# --dry-run runs every step on the CPU (Pallas interpret mode, tiny shapes; step 5
# regenerates 4 prompts x 8 tokens);
# tests/cli/test_device_round.py runs it in CI. Environment: PYTHON (default python3),
# STUDY_S (least seconds left for step 5, default 120), STEP5 (regen | eagle3 | study | none).
set -uo pipefail
BUDGET=""; OUTD=""; DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=${2:-}; shift 2 ;;
    --out) OUTD=${2:-}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "device_round.sh: error: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$OUTD" ]; then echo "device_round.sh: error: --out DIR is required" >&2; exit 2; fi
[ $DRY = 1 ] && [ -z "$BUDGET" ] && BUDGET=900
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 1 ]; then
  echo "device_round.sh: error: --budget SECONDS (a positive integer) is required" >&2; exit 2
fi
cd "$(dirname "$0")/.." || exit 2
START=$(date +%s)
PY=${PYTHON:-python3}
# a call that carried the demo checkpoints packed (scripts/device_pack.sh) unpacks them
PYTHON=$PY bash scripts/device_pack.sh unpack || exit 2
mkdir -p "$OUTD" || exit 2
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TQDM_MININTERVAL=20
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--out "$OUTD" --budget "$BUDGET")
if [ $DRY = 1 ]; then
  export JAX_PLATFORMS=cpu
  ARGS+=(--dry-run)
fi
$PY benchmarks/device_round.py "${ARGS[@]}" 2>&1 | tee "$OUTD/device_round.log"
RC=${PIPESTATUS[0]}
LEFT=$(( BUDGET - ($(date +%s) - START) ))
STEP5=${STEP5:-regen}
if [ "$STEP5" != none ] && { [ $DRY = 1 ] || [ "$LEFT" -ge "${STUDY_S:-120}" ]; }; then
  echo "[device_round.sh] step 5 ($STEP5) with $LEFT s left" | tee -a "$OUTD/device_round.log"
  if [ "$STEP5" = study ]; then
    STUDY=(--out "$OUTD" --budget $(( LEFT - 20 )))
    [ $DRY = 1 ] && STUDY+=(--dry-run --seeds 0 --only eagle3 --jobs 1)
    $PY benchmarks/studies/kvshot/kvshot_device.py all "${STUDY[@]}" 2>&1 | tail -40 >>"$OUTD/device_round.log"
  elif [ "$STEP5" = eagle3 ] && [ $DRY = 0 ]; then
    bash scripts/gpu_eagle3_round.sh $(( LEFT - 20 )) "$OUTD/eagle3" 2>&1 | tail -40 \
      >>"$OUTD/device_round.log"
  else
    REGEN=$(mktemp -d)/regen
    SIZE=(--max-new-tokens 256 --batch-size 1024 --time-limit $(( LEFT - 90 )))
    [ $DRY = 1 ] && SIZE=(--max-new-tokens 8 --batch-size 4 --limit 4)
    JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m specjax.regenerate --out "$REGEN" \
        --prompts-per-file 100000 --seed 5 --dtype float32 "${SIZE[@]}" 2>&1 | tr '\r' '\n' \
        | grep -v "it/s\]$" | tail -5 >>"$OUTD/device_round.log"
    for s in train val; do
      [ -f "$REGEN/$s.npy" ] && gzip -1 -c "$REGEN/$s.npy" >"$OUTD/study_$s.npy.gz"
    done
    [ -f "$REGEN/manifest.json" ] && cp "$REGEN/manifest.json" "$OUTD/study_manifest.json"
  fi
fi
exit $RC
