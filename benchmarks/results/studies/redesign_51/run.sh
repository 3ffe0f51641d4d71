#!/bin/bash
# Alternating `python decode.py` (defaults) in the pre-issue-51 tree (/tmp/base, git 7c1ee87)
# and in the new tree (/work/main); one summary JSON per run.
. /work/main/.venv/bin/activate
i=0
for round in warm 1 2; do
  for tree in base main; do
    dir=/tmp/base; [ $tree = main ] && dir=/work/main
    (cd $dir && PYTHONPATH=$dir python decode.py --show 0 --summary /tmp/speed/${tree}_${round}.json > /tmp/speed/${tree}_${round}.log 2>&1)
    echo "$tree $round rc=$? $(date +%T)" >> /tmp/speed/progress.txt
  done
done
