"""Where a measurement came from, written once for every benchmark: the code (git commit
and the tracked files changed against it), the weights (sha256), the machine and its
software, and the command line.

    from benchmarks.lib import provenance
    rec = {"git": provenance.git_rev(), "date": provenance.today(), **provenance.stamp()}

Nothing here imports jax at module level (a benchmark sets its environment first);
`environment` and `machine` import it inside.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the code a benchmark measures: a change elsewhere (documents, results) is not "dirty"
CODE_PATHS = ("specjax", "decode.py", "benchmarks")


def _git(*args: str, root: str = ROOT) -> str | None:
    """git's stdout (not stripped: porcelain lines may start with a space), or None
    outside a checkout or when git fails."""
    try:
        p = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
    except OSError:
        return None
    return p.stdout if p.returncode == 0 else None


def _dirty(root: str) -> list[str]:
    """Tracked files under CODE_PATHS (results files aside) that differ from HEAD."""
    out = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS,
               ":(exclude)benchmarks/results", root=root) or ""
    return sorted(line[3:] for line in out.splitlines() if line.strip())


def git_rev(root: str = ROOT) -> str:
    """The short hash of HEAD in the checkout at `root` (the code a benchmark measured),
    with "+dirty" when tracked files under specjax/, decode.py or benchmarks/ (results
    files aside: a benchmark that ran before this one changes them, not the code) differ
    from HEAD (the code measured is then HEAD plus uncommitted changes), or "" outside a
    git checkout."""
    rev = (_git("rev-parse", "--short", "HEAD", root=root) or "").strip()
    if rev and _dirty(root):
        rev += "+dirty"
    return rev


def git_state(root: str = ROOT) -> dict:
    """{"rev": HEAD's 12-digit hash, "dirty": tracked files under specjax/, decode.py and
    benchmarks/ that differ from HEAD (the code measured is HEAD plus these)}."""
    rev = (_git("rev-parse", "--short=12", "HEAD", root=root) or "").strip()
    out = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS,
               root=root) or ""
    return {"rev": rev or None, "dirty": sorted(line[3:] for line in out.splitlines())}


def changed_files(root: str = ROOT) -> list[str]:
    """Tracked files that differ from HEAD, documents (*.md) and results files left out."""
    out = _git("status", "--porcelain", "--untracked-files=no", root=root) or ""
    changed = [x[3:] for x in out.splitlines() if x.strip()]
    return [x for x in changed if not x.endswith(".md")
            and not x.startswith("benchmarks/results/")]


def sha256(path: str) -> str:
    """The hex sha256 of a file (weights: the hash the documents quote)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_prefix(path: str, n: int = 12) -> str:
    """The first n hex digits of `sha256(path)`."""
    return sha256(path)[:n]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def today() -> str:
    return time.strftime("%Y-%m-%d")


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this benchmark, as a reader would type it from the
    repository root: "python benchmarks/NAME.py ARGS"."""
    argv = sys.argv if argv is None else argv
    script = os.path.abspath(argv[0]) if argv else ""
    if script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    return " ".join(["python", script, *argv[1:]]).strip()


def processor() -> str:
    """platform.processor(), else the machine's architecture (as the results files
    name the machine)."""
    return platform.processor() or platform.machine()


def stamp() -> dict:
    """The header fields of a CPU results record: {"git", "date", "cores", "machine",
    "jax"} (git: `git_rev`)."""
    import jax

    return {"git": git_rev(), "date": today(), "cores": os.cpu_count(),
            "machine": processor(), "jax": jax.__version__}


def environment(threads: list[int]) -> dict:
    """Versions, backend, devices and core counts of this process (torch and transformers
    where installed; `threads`: the torch thread counts used)."""
    import jax

    env = {"python": platform.python_version(), "jax": jax.__version__,
           "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
           "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
           "torch_threads": threads, "machine": platform.machine(),
           "processor": platform.processor()}
    try:
        import flax
        env["flax"] = flax.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        import torch
        import transformers
        env["torch"] = torch.__version__
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def installed_environment() -> dict:
    """Code and machine of a run without importing jax (versions from the installed
    distributions; for a benchmark that runs decode.py in subprocesses)."""
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    commit = _git("rev-parse", "--short", "HEAD")
    return {"commit": commit.strip() if commit else None,
            # tracked files that differ from the commit, documents and results left out
            "changed_files": changed_files(),
            "python": platform.python_version(), "jax": version("jax"),
            "jaxlib": version("jaxlib"), "flax": version("flax"),
            "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
            "machine": platform.machine(), "processor": platform.processor(),
            "env": {k: os.environ[k] for k in ("XLA_FLAGS", "GLIBC_TUNABLES", "JAX_PLATFORMS",
                                               "JAX_COMPILATION_CACHE_DIR")
                    if k in os.environ}}


def machine() -> dict:
    """The measuring machine: CPU model, cores, load average, jax version, backend and
    device, python."""
    import jax

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "python": platform.python_version()}
