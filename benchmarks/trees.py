"""Draft trees against one chain (issue 30): measured on this CPU with decode.py's engines
(each system a decoding session of its flags: `system_config`), as decode.py measures
(speculative and autoregressive runs interleaved per batch of prompts, in one process),
and projected to accelerators.

    python benchmarks/trees.py                      # the full table (slow on 2 cores)
    python benchmarks/trees.py --quick              # 4 prompts x 32 tokens, T = 0 only
    python benchmarks/trees.py --render-only        # docs/trees.md's table from the JSON
    python benchmarks/trees.py --sweep              # tree shapes (T = 0), K x G (T = 1)

Systems (`SYSTEMS`): the shipped eagle3 drafter as one chain (its G = 7), as K = 2 and 4
drafts per step (`--num-drafts`) and as EAGLE-2 dynamic trees (`--tree-topk K
--tree-nodes N`); the shipped block drafter as a chain and as a tree of its per-position
top-K; LogitSpec (its CPU defaults); n-gram lookup as a chain and as K = 3 drafts.
`--sweep` (`SWEEP`): the eagle3 head as EAGLE-2 trees of every shape in TREE_SHAPES at
T = 0, and as K drafts of G tokens (DRAFT_SHAPES) with block verification at T = 1, at
batch 1, into benchmarks/results/trees_sweep.json and docs/img/trees_sweep.png.
Settings: T = 0 (greedy), T = 1
with token-level and with block verification (block only where the tree is K independent
drafts), batch 1 and 4, on two prompt sets: the first --prompts bundled
demo prompts and as many held-out prompts cut from the regenerated validation stream
(benchmarks/data/study2/val.npy, `benchmarks.lib.prompts.held_out_prompts`). Per
(setting, batch, prompt set) one autoregressive engine runs interleaved with every system,
so speedups are ratios measured on the same machine state. Outputs must equal the
autoregressive ones at T = 0 (recorded per run).

Projection (labelled as such everywhere it is quoted): the two right columns turn a
measured tau into a speedup for a Qwen3-8B-shaped target on an H100 and a TPU v5e
(`benchmarks.lib.system_table.project`: its module doc gives the model).

Results: benchmarks/results/trees.json and the `<!-- trees:results -->` section of
docs/trees.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib.report import save_results  # noqa: E402
from benchmarks.lib.system_table import (  # noqa: E402
    SWEEP,
    SYSTEMS,
    measure,
    measured_on_cpu,
    merge,
    render,
)

RESULTS = os.path.join(ROOT, "benchmarks", "results", "trees.json")
SWEEP_RESULTS = os.path.join(ROOT, "benchmarks", "results", "trees_sweep.json")
DOC = os.path.join(ROOT, "docs", "trees.md")
SWEEP_PLOT = os.path.join(ROOT, "docs", "img", "trees_sweep.png")


def write_doc(res: dict, doc: str = DOC, plot: str | None = SWEEP_PLOT) -> None:
    """Replaces the `<!-- trees:results -->` section of docs/trees.md (created if missing),
    `<!-- trees:device -->` for a record measured on an accelerator, or
    `<!-- trees:sweep -->` for a `--sweep` record (and then draws `plot`, if given)."""
    from benchmarks.lib.report import replace_doc_section

    if res.get("sweep"):
        section = "trees:sweep"
        if plot:
            plot_sweep(res, plot)
    else:
        section = "trees:results" if measured_on_cpu(res) else "trees:device"
    replace_doc_section(doc, section, render(res), "# Draft trees\n\n")


def plot_sweep(res: dict, path: str) -> None:
    """A PNG of a `--sweep` record: speedup against the nodes verified per step for each
    tree top-k at T = 0 (left), and speedup against tau for K drafts x G at T = 1 with
    block verification (right, joined in order of G); one colour per top-k or K, solid
    filled markers for the bundled prompts and dashed hollow ones for the held-out, the
    chain a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"bundled": ("-", "o", "full"), "held-out": ("--", "s", "none")}
    colour = {}  # one colour per top-k (left) and per K (right), shared by both prompt sets

    def c(key):
        return colour.setdefault(key, f"C{len(colour) % 10}")

    smallest = min(r["batch"] for r in res["runs"])
    rows = [r for r in res["runs"] if r["batch"] == smallest]
    for prompts, (line, marker, fill) in styles.items():
        greedy = [r for r in rows if r["temperature"] == 0 and r["prompts"] == prompts]
        for k in sorted({int(r["system"].split()[2].split("x")[0]) for r in greedy
                         if " tree " in r["system"]}):
            pts = sorted((r["nodes"], r["speedup"]) for r in greedy
                         if r["system"].startswith(f"eagle3 tree {k}x"))
            left.plot([p[0] for p in pts], [p[1] for p in pts], line, marker=marker,
                      fillstyle=fill, color=c(("tree", k)), label=f"top-{k} tree, {prompts}")
        for r in greedy:
            if r["system"] == "eagle3 chain":
                left.plot(r["nodes"], r["speedup"], "*", color="k", markersize=13,
                          fillstyle=fill, label=f"chain (G = {r['gamma']}), {prompts}")
        sampled = [r for r in rows if r["temperature"] > 0 and r["prompts"] == prompts]
        for k in sorted({r.get("num_drafts", 1) for r in sampled}):
            pts = sorted((r["gamma"], r["tau"], r["speedup"]) for r in sampled
                         if r.get("num_drafts", 1) == k)
            right.plot([p[1] for p in pts], [p[2] for p in pts], line, marker=marker,
                       fillstyle=fill, color=c(("drafts", k)), label=f"K = {k}, {prompts}")
            for g, t, v in pts:
                right.annotate(f"G={g}", (t, v), fontsize=7, xytext=(3, 3),
                               textcoords="offset points")
    left.set(xlabel="nodes verified per step (N)", ylabel="speedup over autoregressive",
             title="T = 0: EAGLE-2 trees of the eagle3 head")
    right.set(xlabel="tau (tokens per step)", ylabel="speedup over autoregressive",
              title="T = 1, block verification: K drafts x G")
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    where = f"CPU, {res['cores']} cores" if measured_on_cpu(res) else res["device"]
    fig.suptitle(f"{where}, git {res['git']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--only", nargs="+", help="these systems only (names as in SYSTEMS)")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens, T=0, B=1")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--no-step-timing", action="store_true",
                    help="skip the draft/verify ms of each system (two compilations each)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed passes of every engine before timing (default 2)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the target's dtype (auto: float32 on CPU, bfloat16 on GPU/TPU)")
    ap.add_argument("--sweep", action="store_true",
                    help="the eagle3 head over tree shapes at T=0 and over K drafts x G "
                         "with block verification at T=1 (SWEEP; batch 1 unless "
                         "--batch-sizes; results trees_sweep.json, docs/trees.md)")
    ap.add_argument("--json", default=None,
                    help="results file (default benchmarks/results/trees.json, or "
                         "trees_sweep.json with --sweep)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other rows of --json: replace only the (setting, batch, "
                         "system) rows measured now, each tagged with its own git and date")
    args = ap.parse_args(argv)
    if args.json is None:
        args.json = SWEEP_RESULTS if args.sweep else RESULTS
        if args.sweep and "--batch-sizes" not in (argv or sys.argv[1:]):
            args.batch_sizes = [1]
    if args.render_only:
        write_doc(json.load(open(args.json)))
        return 0
    if args.quick:
        args.prompts, args.new_tokens, args.temperatures, args.batch_sizes = 4, 32, [0.0], [1]
    res = measure(args.prompts, args.new_tokens, args.temperatures, args.batch_sizes,
                  args.only, timing=not args.no_step_timing, warmup=args.warmup,
                  dtype=args.dtype, systems=SWEEP if args.sweep else SYSTEMS)
    if args.merge and os.path.exists(args.json):
        res = merge(json.load(open(args.json)), res)
    save_results(args.json, res, SWEEP_RESULTS if args.sweep else RESULTS, write_doc)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
