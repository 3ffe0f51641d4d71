"""What the device rounds share (benchmarks/device_round.py, benchmarks/big_round.py):
the results file with its budget (`Round`), the device's name and vendor figures, a
timing helper, the environment and copy-bandwidth steps, and the Qwen3-8B config (a
reduced one for dry runs)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks.lib import roofline
from specjax.fileio import atomic_write


def log(msg: str) -> None:
    """One line on stderr, "[SCRIPT HH:MM:SS] msg"."""
    name = os.path.splitext(os.path.basename(sys.argv[0] or "round"))[0]
    print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Round:
    """The results file OUT/NAME.json and the budget: `step(name, fn, est_s)` runs a step
    if it fits, recording it (an exception in it is recorded with its traceback)."""

    def __init__(self, out: str, budget: float, dry_run: bool, name: str = "device_round"):
        self.out, self.budget, self.dry_run = out, budget, dry_run
        self.t0 = time.time()
        self.results = {"started": datetime.datetime.now(datetime.UTC).isoformat(),
                        "dry_run": dry_run, "budget_s": budget, "steps": {}}
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, f"{name}.json")

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.time() - self.t0, 1)
        text = json.dumps(self.results, indent=1, default=str) + "\n"
        atomic_write(self.path, lambda f: f.write(text.encode()))

    def save_partial(self, rec: dict) -> None:
        """Records the running step's results so far (a step with many rows calls it per
        row), so a round cut off mid-step still returns them."""
        self.results["steps"][self.current] = rec
        self.save()

    def run(self, fns: dict, est: dict, only) -> None:
        """Runs fns {name: fn(rec)} in order (only those in `only` when it is not empty),
        each when its estimate est[name] fits what is left (no estimate in a dry run)."""
        for name, fn in fns.items():
            if not only or name in only:
                self.step(name, fn, 0 if self.dry_run else est[name])

    def finish(self) -> int:
        """Records the failed steps (an error, passed False or identical False), saves,
        logs a line; -> the exit code (1 if any failed)."""
        failed = [n for n, r in self.results["steps"].items() if "error" in r
                  or r.get("passed") is False or r.get("identical") is False]
        self.results["failed"] = failed
        self.save()
        log(f"done in {time.time() - self.t0:.0f} s; failed: {failed or 'none'}; {self.path}")
        return 1 if failed else 0

    def step(self, name: str, fn, est_s: float):
        if self.left() < est_s:
            log(f"skip {name}: {self.left():.0f} s left, needs about {est_s:.0f} s")
            self.results["steps"][name] = {"skipped": f"{self.left():.0f} s left < {est_s} s"}
            self.save()
            return None
        log(f"{name} ({self.left():.0f} s left)")
        self.current = name
        t = time.time()
        rec: dict = {}
        try:
            fn(rec)
        except Exception as e:  # a failing step is a result; the round goes on
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-4000:]
            log(f"{name} FAILED: {rec['error'][:300]}")
        rec["seconds"] = round(time.time() - t, 1)
        self.results["steps"][name] = rec
        self.save()
        return rec


def device_name() -> str:
    """"H100", "H200", "TPU v5e"... (a key of benchmarks.lib.roofline.BANDWIDTH) or the kind."""
    import jax

    kind = jax.devices()[0].device_kind
    for k in roofline.BANDWIDTH:
        if k.lower() in kind.lower() or kind.lower() in k.lower():
            return k
    return kind


def bandwidth() -> float | None:
    return roofline.BANDWIDTH.get(device_name())


def roofline_fraction(nbytes: int, ms: float) -> float | None:
    """(bytes / the device's vendor bandwidth) / measured ms; None off the known devices."""
    bw = bandwidth()
    return nbytes / bw * 1e3 / ms if bw else None


def bench(fn, *args, repeats: int) -> float:
    """Median ms per call of a jitted `fn` (one call first: compile and warm-up)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    if not np.array_equal(finite, np.isfinite(a)):
        return float("inf")
    scale = max(float(np.max(np.abs(b[finite]), initial=0.0)), 1e-30)
    return float(np.max(np.abs(a[finite] - b[finite]), initial=0.0)) / scale


def step_environment(rec: dict) -> None:
    import importlib.metadata as md

    import jax

    rec["python"] = platform.python_version()
    rec["backend"] = jax.default_backend()
    rec["devices"] = [str(d) for d in jax.devices()]
    rec["device_kind"] = jax.devices()[0].device_kind
    rec["device"] = device_name()
    rec["vendor_bandwidth_Bps"] = bandwidth()
    pkgs = {}
    for p in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt",
              "jax-cuda13-pjrt", "libtpu", "flax", "optax", "orbax-checkpoint", "triton",
              "numpy", "transformers", "tokenizers"):
        with contextlib.suppress(md.PackageNotFoundError):
            pkgs[p] = md.version(p)
    rec["packages"] = pkgs
    with contextlib.suppress(Exception):
        rec["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()


def step_bandwidth(rec: dict, dry_run: bool) -> None:
    """Measured copy bandwidth (read + write bytes / time of y = x + 1 on a big array)."""
    import jax
    import jax.numpy as jnp

    n = (1 << 20) if dry_run else (1 << 30)  # f32 elements: 4 MiB / 4 GiB
    x = jnp.zeros((n,), jnp.float32)
    ms = bench(jax.jit(lambda x: x + 1), x, repeats=3 if dry_run else 10)
    rec["bytes"] = 8 * n
    rec["ms"] = ms
    rec["measured_Bps"] = 8 * n / (ms / 1e3)
    bw = bandwidth()
    if bw:
        rec["fraction_of_vendor"] = rec["measured_Bps"] / bw


def big_config(dry_run: bool):
    from specjax.models.config import ModelConfig
    from specjax.testing import hf_configs

    tmp = tempfile.mkdtemp()
    hf_configs.write("Qwen3-8B", tmp)
    if dry_run:  # 2 small layers, a small vocabulary
        path = os.path.join(tmp, "config.json")
        with open(path) as f:
            hf = json.load(f)
        hf.update(num_hidden_layers=2, hidden_size=512, intermediate_size=1024,
                  vocab_size=4096, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
        with open(path, "w") as f:
            json.dump(hf, f)
    return ModelConfig.from_dir(tmp)
