"""Benchmark scripts check their output paths (--json, --plot) before any work: a path
that cannot be written as a file is one stderr line naming the flag and exit code 2,
not a traceback (or a lost result) at the end of a long run."""

from __future__ import annotations

import importlib
import os

import jax  # noqa: F401  (before decode_speed, which drops JAX_NUM_CPU_DEVICES on import)
import pytest

# script -> the module attribute (on the script or on the module it imports from inside
# main) that its work starts with; the test replaces it by a tripwire, so that a check
# that comes too late fails at once instead of starting the long default run.
WORK = {
    "context_length": ("specjax.models.checkpoint", "load_model"),
    "decode_speed": ("benchmarks.decode_speed", "measure_bandwidth"),
    "draft_vocab": ("specjax.models.checkpoint", "load_model"),
    "prefill": ("specjax.models.checkpoint", "load_model"),
    "profile_step": ("specjax.models.checkpoint", "load_model"),
    "soak": ("benchmarks.soak", "held_out_windows"),
}
CASES = [(s, "--json") for s in WORK] + [("context_length", "--plot")]


def _import(script, monkeypatch):
    for k in ("JAX_NUM_CPU_DEVICES", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if k in os.environ:  # decode_speed's import changes these: restored after the test
            monkeypatch.setenv(k, os.environ[k])
        else:
            monkeypatch.delenv(k, raising=False)
    mod = importlib.import_module(f"benchmarks.{script}")

    def tripwire(*args, **kwargs):
        raise RuntimeError(f"{script}: work started before the output paths were checked")

    where, name = WORK[script]
    monkeypatch.setattr(importlib.import_module(where), name, tripwire)
    return mod


def _main(mod, argv):
    try:
        return mod.main(argv)
    except SystemExit as e:  # decode_speed and soak refuse through argparse (exit 2)
        return e.code


@pytest.mark.parametrize("bad", ["directory", "under_a_file"])
@pytest.mark.parametrize("script,flag", CASES)
def test_unwritable_output_is_refused_before_work(script, flag, bad, tmp_path, monkeypatch,
                                                  capsys):
    mod = _import(script, monkeypatch)
    capsys.readouterr()
    if bad == "directory":
        path = tmp_path / "out"
        path.mkdir()
    else:  # its "directory" is a regular file: no script can create or write under it
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "out.json"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    argv = [flag, str(path)]
    if script == "soak":  # its --json has a default; keep the default run otherwise
        argv += ["--no-progress"]
    assert _main(mod, argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert flag in err and str(path) in err and "error:" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
