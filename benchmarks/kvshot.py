"""The KVShot study (arXiv 2604.26412) on the demo target: trains the matrix of drafters in
configs/study/ and rebuilds docs/kvshot.md from the finished runs.

    python benchmarks/kvshot.py train [--only NAME ...]   # every run, skipping finished ones
    python benchmarks/kvshot.py report [--measure]        # docs/kvshot.md + its plots

`train` runs `train.py --config configs/study/NAME.yaml` for each run in RUNS order (a
run is finished when runs/study/NAME/drafter/config.json exists; an unfinished one
resumes from its newest checkpoint). SIGTERM or Ctrl-C stops the run in progress through
train.py's own SIGTERM handling (it checkpoints and exits 0) and ends the matrix; the
next `train` goes on from there. Progress goes to runs/study/NAME.log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

from benchmarks.kvshot_runs import CONFIG_DIR, RUN_ROOT, RUNS, finished  # noqa: E402
from specjax import cli  # noqa: E402


def log(msg: str) -> None:
    print(f"[kvshot] {msg}", file=sys.stderr, flush=True)


def train_matrix(names: list[str]) -> int:
    """Trains `names` in order (a failing run is logged and skipped); returns 0, or the
    exit code of the first run that failed."""
    os.makedirs(RUN_ROOT, exist_ok=True)
    child: subprocess.Popen | None = None
    stopping = False
    failed = 0

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # train.py checkpoints and exits 0

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for name in names:
        if stopping:
            break
        if finished(name):
            log(f"{name}: finished, skipped")
            continue
        cfg = os.path.join(CONFIG_DIR, f"{name}.yaml")
        path = os.path.join(RUN_ROOT, f"{name}.log")
        log(f"{name}: training ({cfg}), log {path}")
        t0 = time.time()
        with open(path, "a") as out:
            child = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                                      "--config", cfg], cwd=ROOT, stdout=out,
                                     stderr=subprocess.STDOUT)
            rc = child.wait()
        child = None
        if rc != 0:
            log(f"{name}: train.py exited {rc}; see {path}")
            failed = failed or rc
            continue
        log(f"{name}: {'stopped' if stopping else 'done'} after {time.time() - t0:.0f} s")
    return failed


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train every unfinished run of the matrix")
    t.add_argument("--only", nargs="+", choices=RUNS, help="these runs only (in RUNS order)")
    sub.add_parser("report", help="rebuild docs/kvshot.md from the finished runs (options: "
                   "python benchmarks/kvshot_report.py --help)")
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "train" and rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "train":
        names = [n for n in RUNS if not args.only or n in args.only]
        return train_matrix(names)
    from benchmarks import kvshot_report

    return kvshot_report.main(rest)


if __name__ == "__main__":
    sys.exit(main())
