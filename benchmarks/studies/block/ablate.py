"""Issue 52's block-drafter ablations: one setting changed at a time from the base recipe
(configs/study_block/base.yaml: 2 layers, G = 7, 64 anchors, soft labels, the target's
depths 2, 4, 5, 512 steps x 8 x 256 = 1.05M tokens of the target's own greedy text), each
trained with train.py and then decoded by decode.py in the loop; eagle3 on the same terms
(configs/study2/eagle3.yaml) is the reference row.

    python benchmarks/studies/block/ablate.py train [NAME ...]    # trains what is missing
    python benchmarks/studies/block/ablate.py eval [NAME ...]     # decode.py per variant
    python benchmarks/studies/block/ablate.py report              # the table (markdown)

Runs go to runs/study_block/NAME (train.py resumes a stopped run); decode.py's summaries
to benchmarks/results/studies/block/NAME.json, the table to
benchmarks/results/studies/block/README.md (docs/block_drafting.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
BASE = "configs/study_block/base.yaml"
RUNS = "runs/study_block"
RESULTS = "benchmarks/results/studies/block"

# name -> (what it tests, train.py --set overrides)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "base": ("the base recipe", []),
    "selector": ("DFlash2's path selector (rank 64, top-16)",
                 ["drafter.selector_rank=64", "drafter.selector_top_k=16"]),
    "selector_conv": ("DFlash2's recipe: the path selector and the two-tap convolution",
                      ["drafter.selector_rank=64", "drafter.selector_top_k=16",
                       "drafter.conv_kernel_size=2", "drafter.conv_group_size=16"]),
    "conv": ("DFlash2's two-tap grouped dynamic convolution (groups of 16)",
             ["drafter.conv_kernel_size=2", "drafter.conv_group_size=16"]),
    "layers4": ("4 draft layers (DFlash: 5 for Qwen3-8B)", ["drafter.num_layers=4"]),
    "jetspec": ("JetSpec's head: causal attention inside the block, uniform position weights",
                ["drafter.block_causal=true", "drafter.gamma_w=1000000.0"]),
    "decay4": ("position decay gamma_w 4 (the producers' at a block of 8)",
               ["drafter.gamma_w=4.0"]),
    "block16": ("block 16: G = 15 (DFlash's block size)", ["drafter.gamma=15"]),
    "hard": ("hard labels (the data's tokens)", ["drafter.soft_labels=false"]),
    "eagle3": ("reference: eagle3 (TTT, 1 layer, the same data, budget, seed and held-out "
               "stream)", []),
}
# variants trained from another config than BASE (same data, budget and evaluation)
CONFIGS = {"eagle3": "configs/study2/eagle3.yaml"}


README_HEAD = """# Block-drafter ablations (issue 52)

Written by `python benchmarks/studies/block/ablate.py report` from the runs' metrics
(runs/study_block/NAME/metrics.jsonl: the best held-out tau, teacher-forced on the
regenerated validation stream, and its step) and decode.py's summaries here (NAME.json:
`python decode.py --drafter runs/study_block/NAME/drafter --gamma fixed --show 0`, the 50
bundled prompts, 128 new tokens, T = 0, G = 7, each against its own interleaved
autoregressive run). Every variant: configs/study_block/base.yaml with the settings
named, 512 steps x 8 x 256 = 1.05M tokens, trained on the 2-core CPU; the eagle3 row is
configs/study2/eagle3.yaml (the KVShot study's eagle3: the same data, steps, batch, seed,
optimizer and held-out evaluation). docs/studies/block.md says when each was measured and
what else ran on the machine then.

"""


def run_dir(name: str) -> str:
    return os.path.join(RUNS, name)


def exported(name: str) -> bool:
    return os.path.exists(os.path.join(run_dir(name), "drafter", "config.json"))


def train(names: list[str]) -> None:
    for name in names:
        if exported(name):
            print(f"{name}: exported, skipped", flush=True)
            continue
        cmd = [sys.executable, "train.py", "--config", CONFIGS.get(name, BASE),
               "--run-dir", run_dir(name),
               "--no-progress"] + [a for s in VARIANTS[name][1] for a in ("--set", s)]
        print(f"{name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        with open(os.path.join(RUNS, f"{name}.log"), "a") as log:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        print(f"{name}: rc {rc}, {time.time() - t0:.0f} s", flush=True)


def evaluate(names: list[str], extra: list[str]) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    for name in names:
        if not exported(name):
            print(f"{name}: not trained, skipped", flush=True)
            continue
        out = os.path.join(RESULTS, f"{name}.json")
        cmd = [sys.executable, "decode.py", "--drafter", os.path.join(run_dir(name), "drafter"),
               "--gamma", "fixed", "--show", "0", "--summary", out] + extra
        print(f"{name}: {' '.join(cmd)}", flush=True)
        subprocess.check_call(cmd, cwd=ROOT)


def held_out(name: str) -> dict:
    """The best held-out eval of the run's metrics (the exported snapshot)."""
    best = None
    path = os.path.join(run_dir(name), "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            if "tau" in r and "event" not in r and (best is None or r["tau"] > best["tau"]):
                best = r
    return best or {}


def report() -> str:
    rows = ["| variant | what | held-out tau (step) | held-out alpha_k | in-loop tau | "
            "in-loop alpha_k | tok/s | AR tok/s | speedup | identical |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (what, _) in VARIANTS.items():
        path = os.path.join(RESULTS, f"{name}.json")
        h = held_out(name)
        ho = f"{h['tau']:.3f} ({h.get('step')})" if h else "-"
        ha = " ".join(f"{a or 0:.2f}" for a in h.get("alpha", []))
        if not os.path.exists(path):
            rows.append(f"| {name} | {what} | {ho} | {ha} | | | | | | |")
            continue
        s = json.load(open(path))
        alpha = " ".join("-" if a is None else f"{a:.2f}" for a in s.get("alpha", []))
        rows.append(f"| {name} | {what} | {ho} | {ha} | {s.get('tau', float('nan')):.3f} | "
                    f"{alpha} | "
                    f"{s.get('tokens_per_s', float('nan')):.1f} | "
                    f"{s.get('ar_tokens_per_s', float('nan')):.1f} | "
                    f"{s.get('speedup', float('nan')):.2f}x | {s.get('ar_identical')} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("train", "eval", "report"))
    p.add_argument("names", nargs="*", help=f"variants (default: all): {', '.join(VARIANTS)}")
    p.add_argument("--decode-args", default="", help="extra decode.py flags for eval")
    a = p.parse_args()
    bad = [n for n in a.names if n not in VARIANTS]
    if bad:
        p.exit(2, f"ablate.py: unknown variant(s) {bad}; choose from {list(VARIANTS)}\n")
    names = a.names or list(VARIANTS)
    os.chdir(ROOT)
    os.makedirs(RUNS, exist_ok=True)
    if a.action == "train":
        train(names)
    elif a.action == "eval":
        evaluate(names, a.decode_args.split())
    else:
        table = report()
        with open(os.path.join(RESULTS, "README.md"), "w") as f:
            f.write(README_HEAD + table + "\n")
        print(table)


if __name__ == "__main__":
    main()
