"""notebooks/colab_tpu.ipynb: committed without outputs, in sync with its build script, and
executed top to bottom in quick mode (SPECJAX_QUICK=1) with nbclient, as a Colab user
would run it but on this CPU: install skipped (specjax is installed), devices listed,
the demo's summary printed, a drafter trained on a mesh of 2 simulated CPU devices, and
the alpha_k plot displayed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "colab_tpu.ipynb")
BUILD = os.path.join(ROOT, "notebooks", "build_colab_tpu.py")
CELL_TIMEOUT_S = 300  # per cell; the whole quick run takes about 2 minutes here
DEVICES = 2  # simulated CPU devices in the kernel: a real mesh, cheaper to compile than 8


def _text(cell) -> str:
    """A code cell's stream and text/plain outputs, joined."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def test_committed_without_outputs_and_in_sync():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.id
    r = subprocess.run([sys.executable, BUILD, "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow  # the notebook's cells call the library paths that tests/cli/test_demo.py
# and tests/train/ run in the default run; its sync check above runs there too
def test_quick_run(tmp_path, monkeypatch):
    # The kernel inherits this environment (tests/conftest.py sets 8 CPU devices).
    monkeypatch.setenv("SPECJAX_QUICK", "1")
    monkeypatch.setenv("SPECJAX_WORK", str(tmp_path))
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", str(DEVICES))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": ROOT}}).execute()  # raises on any error
    cells = {c.id: c for c in nb.cells if c.cell_type == "code"}

    assert "skipping pip install" in _text(cells["install"])
    assert f"backend cpu, {DEVICES} devices" in _text(cells["devices"])

    demo_out = _text(cells["demo"])
    for row in ("tokens/s", "tau (tokens/step)", "alpha_k", "speedup over AR",
                "identical to AR"):
        assert row in demo_out, row
    with open(tmp_path / "demo_summary.json") as f:
        demo = json.load(f)
    assert demo["prompts"] == 2 and demo["new_tokens"] > 0
    assert demo["drafter"].endswith(os.path.join("drafters", "eagle3")) and demo["gamma"] == 7
    assert demo["ar_identical"] is True and demo["tau"] > 1 and demo["speedup"] > 0
    assert len(demo["alpha"]) == 7

    assert f"over {DEVICES} devices, batch 8 x 128 tokens" in _text(cells["train"])
    run = tmp_path / "run_eagle3"
    with open(run / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    assert metrics[0]["mesh"] == {"data": DEVICES, "fsdp": 1, "model": 1}
    assert metrics[-1]["event"] == "done" and metrics[-1]["step"] == 2
    evals = [r for r in metrics if r.get("alpha")]
    assert len(evals) == 1 and len(evals[0]["alpha"]) == 7
    assert (run / "drafter" / "config.json").is_file()

    plot = cells["plot"]
    assert any("image/png" in out.get("data", {}) for out in plot.outputs)
    assert "step 2: tau" in _text(plot)
    assert (tmp_path / "alpha.png").stat().st_size > 10_000
