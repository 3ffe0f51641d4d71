#!/usr/bin/env bash
# The 8B-size accelerator round (issue 54; benchmarks/big_round.py has the steps): a
# Qwen3-8B-shaped target with random bf16 weights made on the device; AR at B = 1/8/32,
# command buffers on/off, a profile summary, the speculative loop at a chosen tau (the
# test-only oracle drafter), draft trees of 16-64 nodes, eagle3 and block heads at 8B
# width, and drafter training at 8B size. Everything lands under --out as it is measured
# (OUT/big_round.json, OUT/profile_summary.json, OUT/big_round.log).
#
#   bash scripts/big_round.sh --budget SECONDS --out DIR [--part 1|2|3] [--dry-run]
#
# Three parts, one call each under the 10-minute per-call limit, into three folders, as
# many as a lent session's 15 device minutes (the machine's start included) allow:
# `--part 1 --budget 560` (ar, profile, spec, heads), `--part 2 --budget 560` (train,
# exact, tree), `--part 3 --budget 420` (bandwidth, cmdbuf, update). Without --part every step
# runs. A step that would not fit what is left of --budget is recorded as skipped. The
# same commands run on a TPU (the layer loop "auto" is the backend's; the cmdbuf step's
# flags are GPU flags and change nothing there). --dry-run runs every step on the CPU at
# tiny shapes (tests/cli/test_big_round.py, in CI). Environment: PYTHON (default python3).
set -uo pipefail
BUDGET=""; OUTD=""; DRY=0; PART=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=${2:-}; shift 2 ;;
    --out) OUTD=${2:-}; shift 2 ;;
    --part) PART=(--part "${2:-}"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n 2,18p "$0"; exit 0 ;;
    *) echo "big_round.sh: error: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$OUTD" ]; then echo "big_round.sh: error: --out DIR is required" >&2; exit 2; fi
[ $DRY = 1 ] && [ -z "$BUDGET" ] && BUDGET=900
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 1 ]; then
  echo "big_round.sh: error: --budget SECONDS (a positive integer) is required" >&2; exit 2
fi
if [ ${#PART[@]} = 2 ] && ! [[ "${PART[1]}" =~ ^[123]$ ]]; then
  echo "big_round.sh: error: --part must be 1, 2 or 3" >&2; exit 2
fi
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
mkdir -p "$OUTD" || exit 2
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--out "$OUTD" --budget "$BUDGET" "${PART[@]}")
if [ $DRY = 1 ]; then
  export JAX_PLATFORMS=cpu
  ARGS+=(--dry-run)
fi
$PY benchmarks/big_round.py "${ARGS[@]}" 2>&1 | tee "$OUTD/big_round.log"
exit "${PIPESTATUS[0]}"
