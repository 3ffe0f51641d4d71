"""The KVShot study (arXiv 2604.26412) on the demo target: trains the matrix of drafters in
configs/study/ and rebuilds docs/kvshot.md from the finished runs.

    python benchmarks/studies/kvshot/kvshot.py train [--only NAME ...]  # every run, skipping
                                                                        # finished ones
    python benchmarks/studies/kvshot/kvshot.py report [--measure]       # docs/kvshot.md + plots
    python benchmarks/studies/kvshot/kvshot.py matrix [--only NAME ...] [--seeds 0 1 2]
                                      # the redone study: configs/study2/, runs/study2/NAME-sSEED

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.append(ROOT)  # uninstalled checkout

from benchmarks.studies.kvshot.kvshot_runs import (  # noqa: E402
    CONFIG_DIR,
    MATRIX,
    MATRIX_CONFIG_DIR,
    RUN_ROOT,
    RUNS,
    SEEDS,
    WARM_START,
    finished,
    matrix_finished,
    matrix_order,
    matrix_run_dir,
)
from specjax import cli  # noqa: E402


def log(msg: str) -> None:
    print(f"[kvshot] {msg}", file=sys.stderr, flush=True)


def train_matrix(names: list[str]) -> int:
    """Trains `names` in order (a failing run is logged and skipped); returns 0, or the
    exit code of the first run that failed."""
    jobs = [(n, [sys.executable, os.path.join(ROOT, "train.py"), "--config",
                 os.path.join(CONFIG_DIR, f"{n}.yaml")], os.path.join(RUN_ROOT, f"{n}.log"),
             finished(n)) for n in names]
    os.makedirs(RUN_ROOT, exist_ok=True)
    return _run_jobs(jobs)


def matrix_jobs(names: list[str], seeds: list[int]) -> list[tuple]:
    """(label, train.py command, log path, finished) per (run, seed) of the redone study:
    run dir runs/study2/NAME-sSEED, train.seed = SEED, warm starts from the same seed's
    export (WARM_START)."""
    jobs = []
    for name, seed in matrix_order(names, seeds):
        run = matrix_run_dir(name, seed)
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
               os.path.join(MATRIX_CONFIG_DIR, f"{name}.yaml"), "--run-dir", run,
               "--set", f"train.seed={seed}"]
        if name in WARM_START:
            cmd += ["--set", "train.init_from="
                    + os.path.join(matrix_run_dir(WARM_START[name], seed), "drafter")]
        jobs.append((f"{name}-s{seed}", cmd, run + ".log", matrix_finished(name, seed)))
    return jobs


def _run_jobs(jobs: list[tuple]) -> int:
    """Runs train.py jobs (label, cmd, log, finished) in order, skipping finished ones."""
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
    for name, cmd, path, done in jobs:
        if stopping:
            break
        if done:
            log(f"{name}: finished, skipped")
            continue
        log(f"{name}: {' '.join(cmd[1:])}, log {path}")
        t0 = time.time()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as out:
            child = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
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
    m = sub.add_parser("matrix", help="train the redone study (configs/study2/, seeds), "
                       "skipping finished runs")
    m.add_argument("--only", nargs="+", choices=MATRIX, help="these drafters only")
    m.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS),
                   help=f"seeds (default: {' '.join(map(str, SEEDS))})")
    sub.add_parser("report", help="rebuild docs/kvshot.md from the finished runs (options: "
                   "python benchmarks/studies/kvshot/kvshot_report.py --help)")
    args, rest = ap.parse_known_args(argv)
    if args.cmd in ("train", "matrix") and rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "matrix":
        names = [n for n in MATRIX if not args.only or n in args.only]
        for n in names:
            need = WARM_START.get(n)
            if need and need not in names and not all(matrix_finished(need, s)
                                                      for s in args.seeds):
                ap.error(f"{n} starts from {need}'s export: add {need} to --only")
        return _run_jobs(matrix_jobs(names, args.seeds))
    if args.cmd == "train":
        names = [n for n in RUNS if not args.only or n in args.only]
        return train_matrix(names)
    from benchmarks.studies.kvshot import kvshot_report

    return kvshot_report.main(rest)


if __name__ == "__main__":
    sys.exit(main())
