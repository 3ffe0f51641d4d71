"""Atomic file writes: a reader sees the old file or the complete new one, never a part."""

from __future__ import annotations

import contextlib
import os


def atomic_write(path: str, write) -> None:
    """Calls `write(f)` on a binary temporary file next to `path`, then renames it to
    `path`; on any error the temporary file is removed and the error re-raised."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
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
