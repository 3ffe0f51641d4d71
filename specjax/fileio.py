"""File helpers: atomic writes (a reader sees the old file or the complete new one, never
a part), output-path checks, and the one reader of a directory's config.json."""

from __future__ import annotations

import contextlib
import errno
import json
import os

from specjax.errors import SpecjaxError


def existing_ancestor(path: str) -> str:
    """The absolute `path` if it exists (a dangling link counts), else its nearest
    ancestor that does: where `os.makedirs(path)` would start creating."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    return probe


def read_config_json(path: str, kind: str, *, hint: str = "", fix: str = "") -> dict:
    """The config.json of directory `path` as a dict: the one reader of HF checkpoint,
    drafter and external head configs (callers check the keys they need).

    Args:
      path: the directory.
      kind: what the directory is, for the messages ("HF checkpoint", "drafter").
      hint: appended to the message for a missing directory (what to pass instead).
      fix: appended to the messages for a missing or unreadable config.json.
    Raises: SpecjaxError (one line naming the directory or file) for a missing
      directory or config.json, one that cannot be read or is not JSON, or JSON that
      is not an object."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise SpecjaxError(f"{kind} directory {path} does not exist" + (f"; {hint}" if hint else ""))
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise SpecjaxError(f"{cfg_path} is missing; a {kind} directory needs config.json"
                           + (f" ({fix})" if fix else "")) from None
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise SpecjaxError(f"{cfg_path} is unreadable ({' '.join(str(e).split())[:200]})"
                           + (f"; {fix}" if fix else "")) from None
    if not isinstance(raw, dict):
        raise SpecjaxError(f"{cfg_path} must hold a JSON object")
    return raw


def check_output_file(path: str, flag: str, *, create_parent: bool = False) -> None:
    """Checks, before any work, that `path` can be written as a file: it is not a
    directory, and its directory exists and is writable, or (create_parent: the caller
    creates it when it writes the file) the nearest existing ancestor is a writable
    directory. Creates nothing.

    Raises: SpecjaxError (one line naming `flag` and `path`) otherwise."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SpecjaxError(f"{flag} {path} is a directory; pass a file name")
    if create_parent and not os.path.isdir(parent):
        base = existing_ancestor(parent)
        if not os.path.isdir(base):
            raise SpecjaxError(f"{flag} {path}: {base} is not a directory")
        if not os.access(base, os.W_OK | os.X_OK):
            raise SpecjaxError(f"{flag} {path}: cannot create {parent}: {base} is not "
                               "writable")
        return
    if not os.path.isdir(parent):
        raise SpecjaxError(f"{flag} {path}: its directory does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SpecjaxError(f"{flag} {path}: its directory {parent} is not writable")


def _write_temp(path: str, write, index: int = 0) -> str:
    """Writes a binary temporary file next to `path` with `write(f)`, synced; returns
    its name (removed again if `write` fails)."""
    tmp = f"{path}.tmp{os.getpid()}" + (f".{index}" if index else "")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return tmp


def atomic_write(path: str, write) -> None:
    """Calls `write(f)` on a binary temporary file next to `path`, then renames it to
    `path`; on any error the temporary file is removed and the error re-raised.

    Raises: whatever `write` raises, and OSError (IsADirectoryError where `path` is a
      directory) when the file cannot be written or renamed."""
    atomic_write_all([(path, write)])


def atomic_write_all(items) -> None:
    """Writes several files all or none: each `(path, write)` of `items` goes to a
    temporary file next to its path first, and only when every one is complete are they
    renamed into place (a failure before that leaves no file and no temporary behind;
    a rename fails only where the paths were not checked, see `check_output_file`).

    Raises: as `atomic_write`."""
    temps = []
    try:
        for i, (path, write) in enumerate(items):
            if os.path.isdir(path):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            temps.append((_write_temp(path, write, i), path))
        while temps:
            tmp, path = temps[0]
            os.replace(tmp, path)
            temps.pop(0)
    except BaseException:
        for tmp, _ in temps:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise


def save_figure(fig, path: str, dpi: int = 110) -> None:
    """Renders a matplotlib figure to PNG in memory, closes it, and writes `path`
    atomically (no half-written image on an error)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    data = buf.getvalue()
    atomic_write(path, lambda f: f.write(data))
