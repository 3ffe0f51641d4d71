"""The run directory of `specjax.train.loop.train`: its lock (`RunDirLock`, one train.py
per run dir), what a call creates before its first step and removes again when it fails
there (`NewFiles`), the checks that a directory can be created or written
(`check_creatable`, `writable_dir`), the temporaries a killed export leaves
(`remove_stale_temps`), and the resume's comparison with the saved config.yaml
(`check_resume_config`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

import yaml

from specjax.errors import SpecjaxError
from specjax.fileio import existing_ancestor
from specjax.train.config import DEFAULT_TARGET, TrainConfig

LOCK_NAME = "train.lock"


def writable_dir(path: str, what: str) -> None:
    """Creates `path` if needed; SpecjaxError (one line) if it cannot be created or
    written."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SpecjaxError(f"{what} {path} cannot be created ({e.strerror}); choose a "
                           "writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SpecjaxError(f"{what} {path} is not writable; choose a writable directory")


class RunDirLock:
    """An exclusive flock on <run_dir>/train.lock for the process that writes the run dir
    (process 0): a second train.py on the same run dir is refused, and the kernel drops
    the lock when its holder dies, even by SIGKILL, so it never stays stuck.

    With several processes only process 0 takes it, for the whole job: its partners
    share the run dir by design (each writes its checkpoint shards), while process 0 of
    another job on the same run dir is refused, and with it that whole job
    (`multihost.agree`). One lock file per process would instead let two jobs that
    differ in their process count write the same run dir."""

    def __init__(self, run_dir: str):
        import fcntl

        self.path = os.path.join(run_dir, LOCK_NAME)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):  # held
                holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(self.fd)
                raise SpecjaxError(f"run_dir {run_dir} is in use by another train.py (pid "
                                   f"{holder}); wait for it, stop it, or pass another "
                                   "--run-dir") from None
            # a filesystem without flock (some FUSE mounts): run, unguarded
            print(f"[train] warning: {self.path} cannot be locked on this filesystem "
                  f"({e.strerror}); nothing stops a second train.py on this run dir",
                  file=sys.stderr, flush=True)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


STALE_PREFIXES = (".tmp-export-", ".tmp-drafter-", ".old-drafter-")


def remove_stale_temps(run_dir: str) -> None:
    """Deletes the temporary directories a killed export left in `run_dir` (the caller
    holds the run dir's lock, so no other process is writing them)."""
    import shutil

    for name in os.listdir(run_dir):
        if name.startswith(STALE_PREFIXES):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _topmost_missing(path: str) -> str | None:
    """The outermost directory that `os.makedirs(path)` would create, or None if `path`
    exists."""
    path = os.path.abspath(path)
    base = existing_ancestor(path)
    if base == path:
        return None
    return os.path.join(base, os.path.relpath(path, base).split(os.sep)[0])


class NewFiles:
    """What one `train` call adds to the filesystem before its first training step, so
    that a call that fails there (a bad config, a missing file, a target that does not
    fit) leaves nothing behind: the run dir and the export directory's parents it
    created, and the entries it added to an existing run dir (train.lock, config.yaml,
    checkpoints/, data/, ...). What was there before, a resumed run's files, stays.
    Process 0 only; `keep()` once the run has started."""

    def __init__(self, cfg: TrainConfig):
        self.run_dir = cfg.run_dir
        self.created_run_dir = _topmost_missing(cfg.run_dir)
        self.created_other = []
        if cfg.export.enabled:
            top = _topmost_missing(os.path.dirname(os.path.abspath(cfg.export_dir)))
            if top is not None and top != self.created_run_dir:
                self.created_other.append(top)
        self.before = None  # the run dir's entries once this call holds its lock
        self.kept = False

    def locked(self, lock_existed: bool) -> None:
        """Records the run dir's entries, right after the lock was taken."""
        self.before = set(os.listdir(self.run_dir))
        if not lock_existed:
            self.before.discard(LOCK_NAME)

    def keep(self) -> None:
        self.kept = True

    def remove(self) -> None:
        """Deletes what this call created (call while holding the lock)."""
        import shutil

        if self.kept:
            return
        if self.created_run_dir is not None:
            shutil.rmtree(self.created_run_dir, ignore_errors=True)
        elif self.before is not None and os.path.isdir(self.run_dir):
            for name in set(os.listdir(self.run_dir)) - self.before:
                path = os.path.join(self.run_dir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.remove(path)
        for top in self.created_other:  # an export parent: removed only while empty
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)


def check_creatable(path: str, what: str) -> None:
    """SpecjaxError (one line) unless `path` is a writable directory or could be created
    as one. Leaves nothing behind (a missing `path` is probed with an empty temporary
    directory in its nearest existing ancestor, removed at once)."""
    import tempfile

    probe = existing_ancestor(path)
    if not os.path.isdir(probe):
        raise SpecjaxError(f"{what} {path} cannot be created ({probe} is not a directory); "
                           "choose a writable directory")
    if probe == os.path.abspath(path):
        if not os.access(probe, os.W_OK | os.X_OK):
            raise SpecjaxError(f"{what} {path} is not writable; choose a writable directory")
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specjax-probe-", dir=probe))
    except OSError as e:
        raise SpecjaxError(f"{what} {path} cannot be created ({e.strerror}); choose a "
                           "writable directory") from None


def _flat(d, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_config(cfg: TrainConfig, path: str, keys=("model",)) -> list[str]:
    """Raises SpecjaxError if the run dir's saved config differs in `keys` (lm: the model;
    drafters: objective, target, drafter). Returns the other settings that differ, as
    "name old -> new" (a resumed run continues under the new values: a changed
    `train.steps` or `optim` section reshapes the learning-rate schedule from here on)."""
    try:
        with open(path) as f:
            saved = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return []
    mine = cfg.to_dict()
    if "target" in keys:  # unset means the default target; compare normalised paths
        saved["target"] = os.path.normpath(saved.get("target") or DEFAULT_TARGET)
        mine["target"] = os.path.normpath(cfg.target_dir)
    diff = [k for k in keys if saved.get(k) != mine[k]]
    if diff == ["model"]:
        raise SpecjaxError(f"run_dir {cfg.run_dir} holds checkpoints of a different model "
                           f"(see {path}); use a new run_dir or the same model section")
    if diff:
        raise SpecjaxError(f"run_dir {cfg.run_dir} holds checkpoints of another "
                           f"{' / '.join(diff)} (see {path}); use a new run_dir or the same "
                           "settings")
    rest_saved = _flat({k: v for k, v in saved.items() if k not in keys})
    rest_mine = _flat({k: v for k, v in mine.items() if k not in keys})
    return [f"{k} {rest_saved.get(k, '(unset)')} -> {rest_mine.get(k, '(unset)')}"
            for k in sorted(set(rest_saved) | set(rest_mine))
            if k != "run_dir" and rest_saved.get(k) != rest_mine.get(k)]
