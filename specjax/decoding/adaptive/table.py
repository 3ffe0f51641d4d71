"""The cost table of adaptive draft length: its key, and reading and writing it (a JSON
file: milliseconds per step at each draft length, the autoregressive baseline, the
calibration's acceptance)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from specjax.decoding.adaptive.policy import Baseline
from specjax.errors import SpecjaxError


def table_key(**parts) -> str:
    """A stable hex key of everything a cost table depends on (the target's and drafter's
    shapes and dtypes, batch size, lengths, choices, sampling, kernels, device)."""
    text = json.dumps({k: str(v) for k, v in sorted(parts.items())}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def read_table(path: str, choices: tuple[int, ...]) -> list[float]:
    """Milliseconds per step for `choices` from a cost-table JSON file
    ({"ms_per_step": {"0": ms, "1": ms, ...}}, written by `write_table` or by hand).

    Raises: SpecjaxError (one line) for an unreadable file, missing choices or values
      that are not positive numbers."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        table = raw["ms_per_step"]
        if not isinstance(table, dict):
            raise TypeError("ms_per_step is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecjaxError(f"--cost-table {path} is unreadable ({type(e).__name__}: {e}); "
                           'write {"ms_per_step": {"0": MS, "1": MS, ...}}') from None
    out = []
    for g in choices:
        v = table.get(str(g))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise SpecjaxError(f"--cost-table {path} needs a positive ms_per_step for draft "
                               f"length {g} (choices {list(choices)}), got {v!r}")
        out.append(float(v))
    return out


def read_field(path: str, name: str):
    """The cost table's top-level `name` (None where absent). Raises: SpecjaxError (one
    line) for an unreadable file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get(name)
    except (OSError, ValueError, AttributeError) as e:
        raise SpecjaxError(f"--cost-table {path} is unreadable ({type(e).__name__}: {e})") \
            from None


def read_baseline(path: str) -> Baseline | None:
    """The table's optional "baseline" object ({"prefill_ms", "ar_prefill_ms",
    "ar_ms_per_step"} and optionally "margin", see `Baseline`), or None where the table
    has none (a table written by hand, or by an older specjax): then every batch runs
    the speculative program. Raises: SpecjaxError (one line) for a baseline that is not
    three numbers >= 0 (and a margin in [0, 1))."""
    raw = read_field(path, "baseline")
    if raw is None:
        return None
    try:
        # a field with a default (margin) may be left out; the others are required
        return Baseline(**{f.name: raw[f.name] for f in dataclasses.fields(Baseline)
                           if f.name in raw or f.default is dataclasses.MISSING})
    except (KeyError, TypeError, ValueError) as e:
        raise SpecjaxError(f"--cost-table {path}: baseline needs prefill_ms, ar_prefill_ms "
                           f"and ar_ms_per_step, numbers >= 0, and an optional margin in "
                           f"[0, 1) ({type(e).__name__}: {e})") from None


def read_alpha(path: str, gamma: int):
    """The table's optional "alpha": the per-position acceptance f32[G] that
    `AdaptiveEngine.calibrate` observed on its batch (G = `gamma`, the schedule's longest draft),
    which seeds `AdaptiveEngine.alpha0` in place of the prior; None where the table has none.
    Raises: SpecjaxError (one line) for an unreadable file or an alpha that is not G
    numbers in [0, 1]."""
    raw = read_field(path, "alpha")
    if raw is None:
        return None
    if (not isinstance(raw, list) or len(raw) != max(gamma, 1)
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1
                       for a in raw)):
        raise SpecjaxError(f"--cost-table {path}: alpha needs {max(gamma, 1)} acceptance "
                           f"rates in [0, 1], got {raw!r}")
    return [float(a) for a in raw]


def write_table(path: str, choices: tuple[int, ...], ms: list[float], meta: dict,
                baseline: Baseline | None = None) -> None:
    """Writes a cost table atomically (see `read_table`, `read_baseline`), with `meta`
    for the reader."""
    from specjax.fileio import atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = {"ms_per_step": {str(g): float(m) for g, m in zip(choices, ms, strict=True)},
            **({} if baseline is None else {"baseline": dataclasses.asdict(baseline)}),
            **meta}
    atomic_write(path, lambda f: f.write((json.dumps(data, indent=1) + "\n").encode()))
