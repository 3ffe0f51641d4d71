"""Writes notebooks/colab_tpu.ipynb (no outputs) from the cells below.

    python notebooks/build_colab_tpu.py            # rewrite the notebook
    python notebooks/build_colab_tpu.py --check    # exit 1 if the notebook differs

The .ipynb is what ships (Colab opens it); this script is its source, so that a change
is a reviewable diff of Python text. tests/cli/test_notebook.py checks that the two agree
and executes the notebook with SPECJAX_QUICK=1.
"""

from __future__ import annotations

import argparse
import os
import sys

import nbformat
from nbformat import v4

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "colab_tpu.ipynb")

# (cell id, "md" | "code", source): ids are fixed so the file is the same on every build.
CELLS = [
    ("title", "md", """\
# specjax on a Colab TPU

Lossless speculative decoding in JAX: a small drafter proposes tokens, the target model
verifies them in one forward pass, and the output is exactly what the target alone would
have produced (greedy) or exactly its distribution (sampling).

This notebook
1. installs specjax from its repository with the `tpu` extra,
2. shows the devices JAX found,
3. runs the demo: the bundled 24.7M-parameter target and its EAGLE-3 drafter (both
   trained by the project on the Python standard library) complete code prompts, and the
   same prompts also run autoregressively for the speedup and the identity check,
4. trains a new EAGLE-3 drafter for a few steps on a mesh of all the devices it finds,
5. plots its acceptance rate alpha_k at each draft position k.

**On Colab:** *Runtime -> Change runtime type -> TPU*, then *Runtime -> Run all*.
It also runs on a GPU runtime (set `EXTRA = "cuda"` below) or on a CPU.
Everything runs in this kernel's process: a TPU can be held by one process only, so the
notebook decodes through the library (`specjax.decoding.session.build(DecodeConfig(...))`:
the decoding session that `decode.py` runs, with `decode.py`'s options) and trains through
`train.py`'s Python entry point (`train.main`) instead of starting them with `!python`.

With the environment variable `SPECJAX_QUICK=1` every step shrinks (2 prompts of 32 new
tokens, 2 training steps on a 377 kB corpus) so that the whole notebook runs in a few
minutes on a CPU; the project's tests execute it that way (`tests/cli/test_notebook.py`)."""),
    ("install-md", "md", """\
## 1. Install

Finds the specjax checkout this notebook sits in (or clones `REPO_URL` into
`/content/specjax` on Colab) and runs `pip install -e ".[tpu]"` there. When specjax is
already installed, as in the repository's own test environment or after a runtime
restart, nothing is installed. If pip asks you to restart the runtime, do so and run all
cells again."""),
    ("install", "code", """\
import importlib.metadata
import os
import subprocess
import sys

QUICK = os.environ.get("SPECJAX_QUICK") == "1"  # CI and CPU runs: a few minutes in all
REPO_URL = os.environ.get("SPECJAX_REPO_URL", "https://github.com/OWNER/specjax.git")  # your clone
EXTRA = "tpu"  # pip extra: "tpu", "cuda" (GPU runtime) or "" (CPU)


def find_checkout(start):
    \"\"\"The specjax checkout holding `start` (decode.py beside specjax/), or None.\"\"\"
    d = os.path.abspath(start)
    while True:
        if os.path.isfile(os.path.join(d, "decode.py")) and os.path.isdir(os.path.join(d, "specjax")):
            return d
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)


def installed(name):
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


CLONE = "/content/specjax" if os.path.isdir("/content") else os.path.abspath("specjax")
REPO = find_checkout(os.getcwd()) or find_checkout(CLONE)
if REPO is None:
    subprocess.run(["git", "clone", "--depth", "1", REPO_URL, CLONE], check=True)
    REPO = CLONE
if installed("specjax") and installed("jax"):
    print("specjax is already installed: skipping pip install")
else:
    target = f"{REPO}[{EXTRA}]" if EXTRA else REPO
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", target, "matplotlib"],
                   check=True)
os.chdir(REPO)  # train.py resolves the bundled checkpoints and configs from here
sys.path.insert(0, REPO)  # import train (and specjax before a restart sees the install)
print(f"checkout {REPO}; quick mode {QUICK}")"""),
    ("devices-md", "md", """\
## 2. Devices

On a TPU runtime JAX lists one `TpuDevice` per TPU core (8 on a v2-8, 1 on a v5e-1). A
`cpu` backend here means the runtime has no accelerator (or `EXTRA` did not match it)."""),
    ("devices", "code", """\
import jax

print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
for d in jax.devices():
    print(" ", d)"""),
    ("demo-md", "md", """\
## 3. The demo: target + its best drafter

The demo is `python decode.py` with its defaults, here as a library call:
`DecodeConfig()` holds every `decode.py` option at its default (its fields are
`decode.py`'s flags), `build` makes the session, `session.run` decodes. The defaults:
target `checkpoints/demo/target`, the best bundled drafter
`checkpoints/demo/drafters/eagle3` (trained for G = 7 draft tokens per step), `--gamma
auto` (every step picks its draft length, 0 to 7, by expected tokens per millisecond from
a cost table the session measures once and caches; docs/adaptive.md), greedy decoding of
the bundled held-out prompts with EOS on, and autoregressive decoding of the same prompts
interleaved batch by batch for the speedup. Only the number of prompts and of new tokens
differ from `decode.py`'s defaults, and only in quick mode (`max_new_tokens=32`, the
first 2 prompts). The summary is `decode.py`'s: tokens/s (compilation excluded), tau
(tokens per target forward, bonus token included), the draft lengths chosen, alpha_k
(acceptance rate at draft position k given the earlier ones were accepted), the speedup
over autoregressive decoding, and whether the outputs are identical to it.

On CPU the target runs float32 and the outputs are identical. On TPU it runs bfloat16
(`dtype="auto"`), where a one-token and a multi-token forward may round differently, so
a few outputs can differ from the autoregressive ones; pass `DecodeConfig(dtype="float32")`
for the exact check. Both loops are compiled before the first prompt (`compile (s)` in
the summary); tokens/s excludes it."""),
    ("demo", "code", """\
import json

from specjax.decoding.options import DecodeConfig
from specjax.decoding.report import format_summary, title
from specjax.decoding.session import build

WORK = os.environ.get("SPECJAX_WORK", "/tmp/specjax_colab")  # everything this notebook writes
os.makedirs(WORK, exist_ok=True)
n_prompts, new_tokens = (2, 32) if QUICK else (50, 128)  # 50 x 128: decode.py's defaults
session = build(DecodeConfig(max_new_tokens=new_tokens))  # every other option: decode.py's
prompts, chat = session.read_prompts()  # the bundled held-out prompts
report = session.run(prompts[:n_prompts], chat=chat)  # loads, compiles, calibrates, decodes
demo = report.summary  # what `decode.py --summary FILE` writes
with open(os.path.join(WORK, "demo_summary.json"), "w") as f:
    json.dump(demo, f, indent=2)
first = report.records[0]
print(f"=== prompt {first['id']}: completion ({len(first['output_ids'])} tokens)")
print(first["text"])
print("\\n" + title(demo))
print(format_summary(demo))"""),
    ("train-md", "md", """\
## 4. Train a drafter on a mesh of all devices

`train.py --config configs/drafters/eagle3.yaml` trains an EAGLE-3 drafter with
training-time test against the frozen demo target, which runs inside every jitted step
and hands the drafter its hidden states. The config's mesh is `{data: -1, fsdp: 1,
model: 1}`: every device found above holds a slice of the batch, so the batch is rounded
up to a multiple of the device count. The corpus is the Python standard library
(tokenized once into `WORK/data`). `--set` overrides shorten the run; every `eval_every`
steps (and at the end) the run measures alpha_k and tau on held-out text (simulated
greedy: a draft token counts when it equals the target's argmax) and writes them to
`metrics.jsonl`. At the end it exports the best drafter to `<run dir>/drafter/`.

The shipped drafter took 2,000 steps of 8 x 256 tokens (4.1M tokens); the 300 steps here
(2 in quick mode) show the mechanics, not a finished drafter."""),
    ("train", "code", """\
import shutil
import sysconfig

import train

n_dev = jax.device_count()
steps, eval_every, rows, seq_len = (2, 0, 8, 128) if QUICK else (300, 50, 8, 256)
batch = -(-rows // n_dev) * n_dev  # rows rounded up to a multiple of the data axis
run_dir = os.path.join(WORK, "run_eagle3")
shutil.rmtree(run_dir, ignore_errors=True)  # a run dir with checkpoints would be resumed
sets = [f"train.steps={steps}", f"train.batch_size={batch}", f"data.seq_len={seq_len}",
        f"train.eval_every={eval_every}", "train.eval_batches=1" if QUICK else "train.eval_batches=4",
        "train.log_every=1" if QUICK else "train.log_every=10", "train.checkpoint_every=0",
        f"optim.warmup_steps={min(100, steps // 10)}", f"data.cache_dir={WORK}/data"]
if QUICK:  # the stdlib's email package (29 files) instead of the whole library
    sets.append(f"data.corpus_root={os.path.join(sysconfig.get_paths()['stdlib'], 'email')}")
argv = ["--config", "configs/drafters/eagle3.yaml", "--run-dir", run_dir]
for s in sets:
    argv += ["--set", s]
rc = train.main(argv)
assert rc == 0, f"train.py exited with {rc}"
with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f if line.strip()]
start = next(r for r in metrics if r.get("event") == "start")
print(f"mesh {start['mesh']} over {start['devices']} devices, batch {batch} x {seq_len} tokens")"""),
    ("plot-md", "md", """\
## 5. alpha_k by draft position

Left: the drafter just trained, one line per evaluation (held-out text, simulated
greedy acceptance). Right, for scale: the shipped drafter's alpha_k measured while
decoding in section 3 (a different measurement: real decoding of the demo prompts).
A missing point means no chain reached that position."""),
    ("plot", "code", """\
import matplotlib.pyplot as plt
from IPython.display import Image, display

evals = [r for r in metrics if r.get("alpha")]
nan = float("nan")
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for i, r in enumerate(evals):
    ys = [nan if a is None else a for a in r["alpha"]]
    ax.plot(range(len(ys)), ys, marker="o", color=plt.cm.viridis(i / max(len(evals) - 1, 1)),
            label=f"step {r['step']} (tau {r['tau']:.2f})")
    print(f"step {r['step']}: tau {r['tau']:.3f}, alpha_k "
          + " ".join("-" if a is None else f"{a:.2f}" for a in r["alpha"]))
ax.set_title(f"trained here: {evals[-1]['step']} steps, held-out (simulated)")
ys = [nan if a is None else a for a in demo["alpha"]]
ax2.plot(range(len(ys)), ys, marker="o", color="C3",
         label=f"shipped eagle3 (tau {demo['tau']:.2f})")
ax2.set_title("shipped drafter, decoding the demo prompts")
for a in (ax, ax2):
    a.set_xticks(range(max(len(evals[-1]["alpha"]), len(demo["alpha"]))))
    a.set_xlabel("draft position k")
    a.set_ylim(-0.02, 1.02)
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
ax.set_ylabel("alpha_k (acceptance given earlier accepted)")
fig.tight_layout()
png = os.path.join(WORK, "alpha.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))"""),
    ("next-md", "md", """\
## Next

- Decode with the drafter just trained: `build(DecodeConfig(drafter=f"{run_dir}/drafter"))`
  in place of section 3's session (or `python decode.py --drafter DIR` in a shell).
- Train it for longer (`train.steps`, and `train.eval_every` for more lines in the
  plot), or another kind: `configs/drafters/block.yaml` (DFlash-style block drafter),
  `kv.yaml`, `hybrid.yaml`.
- A larger target: `--target DIR` for decode.py and train.py takes any local Qwen3 or
  Llama-3 HF directory (README.md)."""),
]


def build() -> nbformat.NotebookNode:
    """The notebook: CELLS with fixed ids, no outputs, Colab's TPU runtime in metadata."""
    cells = []
    for cell_id, kind, source in CELLS:
        make = v4.new_markdown_cell if kind == "md" else v4.new_code_cell
        cells.append(make(source, id=cell_id))
    nb = v4.new_notebook(cells=cells)
    nb.metadata = {
        "accelerator": "TPU",
        "colab": {"provenance": []},
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    return nb


def render() -> str:
    return nbformat.writes(build()) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the notebook differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(PATH, encoding="utf-8") as f:
            same = f.read() == text
        print(f"{PATH}: {'up to date' if same else 'differs; rerun this script'}")
        return 0 if same else 1
    with open(PATH, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
