#!/usr/bin/env bash
# A device call carries at most 64 MiB of working tree; the checkpoints under
# checkpoints/demo are ~150 MB. This packs what the device scripts need and keeps the
# rest out of the carried tree for the duration of the calls:
#
#   bash scripts/device_pack.sh pack      # .devpack/ckpt.tar.xz: demo target, eagle3, block (~48 MB, ~1 min)
#   bash scripts/device_pack.sh hide      # untrack the big checkpoint folders in the INDEX only
#   ... device run calls with carry [".devpack"]; scripts/gpu_trees_round.sh and
#       scripts/device_round.sh run `device_pack.sh unpack` there, which unpacks the
#       archive when it is present and the target is missing ...
#   bash scripts/device_pack.sh restore   # the index as HEAD has it again
#
# `hide` changes nothing on disk: it removes the folders from the index (git rm --cached)
# and lists them in .git/info/exclude; `restore` undoes both. Commit nothing between the
# two (git status shows the folders as deleted while hidden).
set -euo pipefail
cd "$(dirname "$0")/.."
BIG=(checkpoints/demo/target checkpoints/demo/target_32k checkpoints/demo/drafters
     checkpoints/demo/drafters_32k checkpoints/demo/draft benchmarks/data/study2/train.npy)
EXCL=.git/info/exclude
case "${1:-}" in
  pack)
    mkdir -p .devpack .git/info
    grep -qx '/.devpack/' "$EXCL" 2>/dev/null || echo '/.devpack/' >>"$EXCL"
    python3 - <<'EOF'
import tarfile
skip = (".png", ".jsonl")
with tarfile.open(".devpack/ckpt.tar.xz.tmp", "w:xz", preset=6) as t:
    for d in ("checkpoints/demo/target", "checkpoints/demo/drafters/eagle3",
              "checkpoints/demo/drafters/block"):
        t.add(d, filter=lambda ti: None if ti.name.endswith(skip) else ti)
EOF
    mv .devpack/ckpt.tar.xz.tmp .devpack/ckpt.tar.xz
    ls -l .devpack/ckpt.tar.xz ;;
  hide)
    git rm -r -q --cached -- "${BIG[@]}"
    { echo "# device_pack.sh begin"; printf '/%s\n' "${BIG[@]}"; echo "# device_pack.sh end"; } >>"$EXCL"
    (git ls-files; git ls-files --others --exclude-standard) | tr '\n' '\0' \
      | xargs -0 du -cb 2>/dev/null | tail -1 ;;
  unpack)
    if [ -f .devpack/ckpt.tar.xz ] && [ ! -f checkpoints/demo/target/config.json ]; then
      "${PYTHON:-python3}" -c "import tarfile; tarfile.open('.devpack/ckpt.tar.xz').extractall('.')"
    fi ;;
  restore)
    git reset -q HEAD -- "${BIG[@]}"
    [ -f "$EXCL" ] && sed -i '/^# device_pack.sh begin$/,/^# device_pack.sh end$/d' "$EXCL"
    git status --short | head ;;
  *) echo "usage: device_pack.sh pack|hide|unpack|restore" >&2; exit 2 ;;
esac
