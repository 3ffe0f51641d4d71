"""The redone KVShot study (issue 29, section 2) on a lent accelerator: trains the whole
matrix (configs/study2/, every drafter x seeds) with a larger budget than the CPU can
afford, in parallel processes on the one device, then measures every finished run with
benchmarks/studies/kvshot/kvshot_study2.py, and packs what comes back under --out.

    python benchmarks/studies/kvshot/kvshot_device.py train   --out DIR --budget SECONDS \
        [--jobs N] [--dry-run]
    python benchmarks/studies/kvshot/kvshot_device.py measure --out DIR --budget SECONDS \
        [--jobs N] [--dry-run]
    python benchmarks/studies/kvshot/kvshot_device.py all     --out DIR --budget SECONDS \
        [--jobs N] [--dry-run]

Why two steps: a device session returns at most 8 files and 64 MiB, and the 18 exported
drafters are about 370 MB in bf16, so the weights cannot come back; every figure that needs
them is measured on the device (`measure`, on the same warm machine) and only the training
records and result JSONs come back:

- OUT/study_train.tar.gz: per run its config.yaml, metrics.jsonl, drafter/config.json
  (with the best-tau record) and the tail of its log, under runs/study2_device/;
- OUT/study_measure.tar.gz: benchmarks/results/studies/kvshot/kvshot2_device/NAME-sSEED.json
  per run
  (rewritten after every finished measurement, so a stop keeps what was done);
- OUT/study_device.log: this driver's log.

The budget (the same for every run, stated in the report): configs/study2's settings with
`DEVICE_OVERRIDES` (batch 32 rows x 256 tokens x 512 steps: 4.2M tokens, 4x the CPU
matrix's 1M, about 2.9 passes over the 1.45M training tokens), best held-out tau exported.
Runs without a warm start go first, all seeds at once (up to --jobs processes); the
hybrid and its eagle3 control start from their seed's eagle3 export afterwards. At the
deadline, runs still going get SIGTERM (train.py checkpoints and exits) and are reported
unfinished; no run is shortened to fit, so every finished run had the same budget.
Exit status: 0 when every selected run finished (and, with measure/all, has results), 1
otherwise (what was done is packed either way), 2 for bad arguments.

--dry-run runs the same steps on the CPU with a few training steps and tiny measurements
(runs/study2_dryrun, results in OUT only).
"""

from __future__ import annotations

import glob
import io
import os
import signal
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.studies.kvshot.kvshot_runs import (  # noqa: E402
    MATRIX,
    MATRIX_CONFIG_DIR,
    SEEDS,
    WARM_START,
)
from specjax import cli  # noqa: E402

RUNS_ROOT = os.path.join(ROOT, "runs", "study2_device")
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results", "studies", "kvshot",
                           "kvshot2_device")
DEVICE_OVERRIDES = ("train.batch_size=32", "train.checkpoint_every=256",
                    "train.eval_every=32")
DRY_OVERRIDES = ("train.steps=3", "train.batch_size=2", "train.eval_every=3",
                 "train.eval_batches=1", "train.checkpoint_every=3", "optim.warmup_steps=1")
DRY_SIZES = ("--prompts", "2", "--sim-rows", "2", "--new-tokens", "4")
START = time.time()
LOG_LINES: list[str] = []


def log(msg: str) -> None:
    line = f"[kvshot_device {time.time() - START:6.0f} s] {msg}"
    LOG_LINES.append(line)
    print(line, file=sys.stderr, flush=True)


def run_dir(root: str, name: str, seed: int) -> str:
    return os.path.join(root, f"{name}-s{seed}")


def finished(root: str, name: str, seed: int) -> bool:
    return os.path.isfile(os.path.join(run_dir(root, name, seed), "drafter", "config.json"))


def train_command(root: str, name: str, seed: int, overrides) -> list[str]:
    """train.py for NAME-sSEED under ROOT (warm starts from the same seed's export)."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
           os.path.join(MATRIX_CONFIG_DIR, f"{name}.yaml"), "--run-dir",
           run_dir(root, name, seed), "--set", f"train.seed={seed}"]
    if name in WARM_START:
        cmd += ["--set", "train.init_from="
                + os.path.join(run_dir(root, WARM_START[name], seed), "drafter")]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def run_parallel(jobs: list[tuple[str, list[str], str]], n: int, deadline: float,
                 on_done=None) -> dict[str, int | None]:
    """Runs (label, command, log path) with at most n at once; at `deadline` (time.time())
    the running ones get SIGTERM (then SIGKILL after 30 s) and queued ones never start.
    Returns {label: exit code, or None when not started or stopped}."""
    pending = list(jobs)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    codes: dict[str, int | None] = {label: None for label, _, _ in jobs}
    stopping = False
    while pending or running:
        now = time.time()
        if now >= deadline and not stopping:
            stopping = True
            log(f"deadline: stopping {', '.join(running) or 'nothing'}; "
                f"not started: {', '.join(j[0] for j in pending) or 'none'}")
            pending.clear()
            for p, _ in running.values():
                p.send_signal(signal.SIGTERM)
        while pending and len(running) < n and not stopping:
            label, cmd, path = pending.pop(0)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            out = open(path, "a")
            running[label] = (subprocess.Popen(cmd, cwd=ROOT, stdout=out,
                                               stderr=subprocess.STDOUT), time.time())
            out.close()
            log(f"{label}: started")
        for label, (p, t0) in list(running.items()):
            rc = p.poll()
            if rc is None:
                if stopping and time.time() > deadline + 30:
                    p.kill()
                continue
            del running[label]
            codes[label] = None if stopping else rc
            log(f"{label}: exit {rc} after {time.time() - t0:.0f} s")
            if on_done is not None:
                on_done(label)
        time.sleep(1)
    return codes


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def pack(path: str, files: list[tuple[str, str]], tails: list[tuple[str, str]] = ()) -> None:
    """Writes tar.gz PATH atomically: files [(arcname, path)] whole, tails [(arcname, path)]
    as their last 200 lines (carriage returns turned into newlines)."""
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for arc, p in files:
            if os.path.isfile(p):
                tar.add(p, arcname=arc)
        for arc, p in tails:
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    lines = f.read().replace(b"\r", b"\n").splitlines()
                _add_bytes(tar, arc, b"\n".join(ln for ln in lines[-200:] if ln.strip()))
    os.replace(tmp, path)


def pack_train(out: str, root: str) -> None:
    files, tails = [], []
    base = os.path.basename(root)
    for rdir in sorted(glob.glob(os.path.join(root, "*-s*"))):
        if not os.path.isdir(rdir):
            continue
        r = os.path.basename(rdir)
        for rel in ("config.yaml", "metrics.jsonl", "drafter/config.json"):
            files.append((f"runs/{base}/{r}/{rel}", os.path.join(rdir, rel)))
        tails.append((f"runs/{base}/{r}.log", rdir + ".log"))
    pack(os.path.join(out, "study_train.tar.gz"), files, tails)


def pack_measure(out: str, results: str) -> None:
    where = os.path.relpath(RESULTS_DIR, ROOT)  # where they go in the checkout
    pack(os.path.join(out, "study_measure.tar.gz"),
         [(f"{where}/{os.path.basename(p)}", p)
          for p in sorted(glob.glob(os.path.join(results, "*.json")))])


def selected(only) -> list[str]:
    """MATRIX order, limited to `only` plus the warm starts' parents (None: all)."""
    if not only:
        return list(MATRIX)
    keep = set(only) | {WARM_START[n] for n in only if n in WARM_START}
    return [n for n in MATRIX if n in keep]


def train_phase(args, root: str, deadline: float) -> bool:
    overrides = list(DRY_OVERRIDES if args.dry_run else DEVICE_OVERRIDES)
    seeds = args.seeds
    names = selected(args.only)
    waves = [[n for n in names if n not in WARM_START], [n for n in names if n in WARM_START]]
    for wave in waves:
        jobs = [(f"{n}-s{s}", train_command(root, n, s, overrides),
                 run_dir(root, n, s) + ".log")
                for s in seeds for n in wave if not finished(root, n, s)
                and (n not in WARM_START or finished(root, WARM_START[n], s))]
        if not jobs:
            continue
        run_parallel(jobs, args.jobs, deadline, on_done=lambda _: pack_train(args.out, root))
        if time.time() >= deadline:
            break
    pack_train(args.out, root)
    done = [f"{n}-s{s}" for s in seeds for n in names if finished(root, n, s)]
    log(f"train: {len(done)} of {len(names) * len(seeds)} runs finished: {', '.join(done)}")
    return len(done) == len(names) * len(seeds)


def measure_phase(args, root: str, results: str, deadline: float) -> bool:
    extra = list(DRY_SIZES) if args.dry_run else []
    overrides = list(DRY_OVERRIDES if args.dry_run else DEVICE_OVERRIDES)
    jobs = []
    for s in args.seeds:
        for n in selected(args.only):
            if not finished(root, n, s) or os.path.isfile(os.path.join(results,
                                                                       f"{n}-s{s}.json")):
                continue
            cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "kvshot_study2.py"),
                   "--runs-root", root, "--results-dir", results, "measure", "--only", n,
                   "--seeds", str(s), *extra]
            for o in overrides:
                cmd += ["--set", o]
            jobs.append((f"measure {n}-s{s}", cmd,
                         os.path.join(root, f"measure-{n}-s{s}.log")))
    run_parallel(jobs, args.jobs, deadline, on_done=lambda _: pack_measure(args.out, results))
    pack_measure(args.out, results)
    n = len(glob.glob(os.path.join(results, "*.json")))
    log(f"measure: {n} runs with results in {results}")
    return all(os.path.isfile(os.path.join(results, f"{m}-s{s}.json"))
               for s in args.seeds for m in selected(args.only))


def environment() -> None:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = "no nvidia-smi"
    log(f"device: {smi}; python {sys.version.split()[0]}")


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("train", "measure", "all"))
    ap.add_argument("--out", required=True, help="folder for what comes back")
    ap.add_argument("--budget", type=int, required=True, help="seconds for this command")
    ap.add_argument("--jobs", type=int, default=8, help="processes at once (default 8)")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--only", nargs="+", choices=MATRIX,
                    help="these drafters only (a warm start's parent is trained too)")
    ap.add_argument("--runs-root", default=None,
                    help="where runs go (default runs/study2_device; --dry-run: "
                    "runs/study2_dryrun, its results under RUNS_ROOT/results)")
    ap.add_argument("--measure-share", type=float, default=0.45,
                    help="with `all`: the share of the budget kept for measuring")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, a few training steps, tiny measurements (plumbing check)")
    args = ap.parse_args(argv)
    if args.budget < 1 or args.jobs < 1:
        ap.error("--budget and --jobs must be positive")
    if not 0.0 < args.measure_share < 1.0:
        ap.error("--measure-share must be in (0, 1)")
    os.makedirs(args.out, exist_ok=True)
    os.chdir(ROOT)
    root = os.path.abspath(args.runs_root or (os.path.join(ROOT, "runs", "study2_dryrun")
                                              if args.dry_run else RUNS_ROOT))
    results = os.path.join(root, "results") if args.dry_run else RESULTS_DIR
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["JAX_NUM_CPU_DEVICES"] = "1"  # batch 2 on one device
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("TQDM_MININTERVAL", "20")
    os.environ["PYTHONUNBUFFERED"] = "1"
    end = START + args.budget - 15  # packing and exit
    environment()
    ok = True
    try:
        if args.phase in ("train", "all"):
            tend = end - args.measure_share * args.budget if args.phase == "all" else end
            ok = train_phase(args, root, tend)
        if args.phase in ("measure", "all"):
            ok = measure_phase(args, root, results, end) and ok
    finally:
        with open(os.path.join(args.out, "study_device.log"), "a") as f:
            f.write("\n".join(LOG_LINES) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
