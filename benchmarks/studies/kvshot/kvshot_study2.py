"""The redone KVShot study's measurements and report (issue 29, section 2): every finished
run of the matrix (configs/study2/, runs/study2/NAME-sSEED, kvshot_runs.py) measured on the
same held-out sequences and prompts, with paired bootstrap intervals.

    python benchmarks/studies/kvshot/kvshot_study2.py measure [--only NAME ...] \
        [--seeds S ...] [--prompts N] [--force]
    python benchmarks/studies/kvshot/kvshot_study2.py report  # docs/kvshot2.md + its plots

`measure` opens only finished runs (drafter/config.json exists; a run still training is
never read) and skips runs already measured unless --force. Per run it writes
benchmarks/results/studies/kvshot/kvshot2/NAME-sSEED.json with, per held-out sequence or prompt:

1. simulated acceptance: the trainer's own validation loss (DrafterTrainer.loss_and_stats,
   evaluation=True: TTT unrolls every position; block-wise draws `num_anchors` blocks with
   a fixed key per sequence) on the sequences at positions SIM_START .. SIM_START+n of the
   held-out stream's order (benchmarks/data/study2/val.npy, data.seed 0). Positions
   0 .. 63 are the ones training validated on and picked its best-tau export by, so they
   are left out. Per sequence: accepted[k] (chains whose drafts 0..k all match the target's
   argmax), chains, correct[k] (draft k right on its own), and the hybrid's gate sum.
2. in-loop acceptance and speed: decode.py's engines, built as a decoding session
   (`benchmarks.lib.sessions`; target f32, the drafter's default bf16 matmuls, its draft
   vocabulary, kernels auto, batch 1, EOS on), on prompts cut from the held-out documents
   of val.npy (the first `prompt_tokens` tokens of evenly spaced documents; documents end
   at EOS), T = 0 and
   T = 1 with block verification (and token verification with --settings), each prompt
   run by the drafter and then by
   autoregressive decoding in the same process with the same key (decode.py's
   interleaving). Per prompt: new tokens, verification steps, accepted[k], wall seconds of
   both, and whether the T = 0 outputs are identical.
3. probes: for hybrid runs the same two measurements with the KV branch zeroed through the
   weights (gate_d = 0, so h = n: exactly EAGLE-3 on the hybrid's own weights,
   specjax/drafters/hybrid.py); for drafters with a KV memory (kv, block with kv context)
   the query cosine and the gradient share at random init and at the trained weights
   (benchmarks/studies/kvshot/kvshot_probes.py).

The measurement itself (`measure_run`, `decode`, `simulated`, `probes`) and the results'
statistics (`interval`, `paired`) live in protocol.py beside this script, which
benchmarks/medc.py shares.

`report` reads only those JSON files and renders docs/kvshot2.md (the whole file is
generated) and its plots; runs without results are listed as missing and their rows say
"not yet measured". Intervals: `bootstrap_ci`, a crossed bootstrap over seeds and prompts.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's specjax first (an installed copy may differ)

from benchmarks.lib.report import fmt as _f  # noqa: E402
from benchmarks.lib.stats import RESAMPLES  # noqa: E402
from benchmarks.studies.kvshot.kvshot_runs import (  # noqa: E402
    MATRIX,
    MATRIX_ROOT,
    SEEDS,
)
from benchmarks.studies.kvshot.protocol import (  # noqa: E402
    DEFAULT_SETTINGS,
    MISSING,
    RESULTS_DIR,
    SETTINGS,
    SIZES,
    acc_point,
    alpha_point,
    interval,
    is_finished,
    load_results,
    log,
    measure,
    paired,
    run_dir,
)
from benchmarks.studies.kvshot.protocol import ci as _ci  # noqa: E402
from specjax import cli  # noqa: E402

SCRIPT = "benchmarks/studies/kvshot/kvshot_study2.py"
DOC = os.path.join(ROOT, "docs", "kvshot2.md")
IMG_DIR = os.path.join(ROOT, "docs", "img")
LABELS = {"eagle3": "eagle3 (hidden, TTT)", "kv2": "kv2 (KV-only, 2 layers, TTT)",
          "block_kv": "block_kv (block, KV context, block-wise)",
          "block_hidden": "block_hidden (block, hidden context, block-wise)",
          "hybrid_from_eagle3": "hybrid_from_eagle3 (TTT, from eagle3)",
          "eagle3_more": "eagle3_more (eagle3 + the hybrid's extra steps)"}


# ------------------------------------------------------------------ report: rendering

def _seeds_cell(results: dict, name: str) -> str:
    have = [s for s in SEEDS if (name, s) in results]
    return ", ".join(map(str, have)) if have else "none"


def verdict(d: dict | None, more: str = "above", what: str = "") -> str:
    """One sentence on a paired difference's interval: above / below / across 0."""
    if d is None:
        return f"{MISSING} (a run it needs has no results yet)."
    note = "" if d["seeds"] > 1 else (" Only one seed per drafter so far: the interval "
                                      "covers prompt-to-prompt variation, not seed-to-seed.")
    lo, hi = d["lo"], d["hi"]
    span = f"{what}{d['estimate']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    if lo > 0:
        side = "lies above 0" if more == "above" else "lies above 0 (against the claim)"
        ok = more == "above"
    elif hi < 0:
        side = "lies below 0" if more == "below" else "lies below 0 (against the claim)"
        ok = more == "below"
    else:
        return f"{span}: the interval includes 0, so the evidence does not decide.{note}"
    return (f"{span}: the interval {side}, so the data {'support' if ok else 'contradict'} "
            f"it.{note}")


def table_status(results: dict, runs_root: str) -> tuple[str, list[str]]:
    """The matrix: per drafter and seed, measured / finished (not measured) / missing."""
    missing = []
    lines = ["| drafter | " + " | ".join(f"seed {s}" for s in SEEDS) + " |",
             "|---|" + "---|" * len(SEEDS)]
    for n in MATRIX:
        cells = []
        for s in SEEDS:
            if (n, s) in results:
                cells.append("measured")
            else:
                missing.append(f"{n}-s{s}")
                if is_finished(n, s, runs_root):
                    cells.append("trained, " + MISSING)
                elif os.path.isdir(run_dir(n, s, runs_root)):
                    cells.append("training (no export yet)")
                else:
                    cells.append("not trained yet")
        lines.append(f"| {LABELS[n]} | " + " | ".join(cells) + " |")
    return "\n".join(lines), missing


def table_provenance(results: dict) -> str:
    lines = ["| run | measured (UTC) | code (git) | machine | load avg (start, end) | drafter "
             "sha256 | export's step (of last eval) | its validation tau (positions 0-63) "
             "| train tok/s | seconds (sim, probes, decode) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (n, s), r in sorted(results.items(), key=lambda kv: (kv[0][1], MATRIX.index(kv[0][0])
                                                               if kv[0][0] in MATRIX else 99)):
        m, c, sec = r["machine"], r["code"], r["seconds"]
        dirty = f" + {len(c['dirty'])} changed files" if c.get("dirty") else ""
        la = f"{m['loadavg'][0]:.1f}, {m.get('loadavg_end', [math.nan])[0]:.1f}"
        where = m["cpu"] if m["backend"] == "cpu" else m.get("device", m["backend"])
        lines.append(f"| {n}-s{s} | {r['measured_at']} | `{c['rev']}`{dirty} | {where}, "
                     f"{m['cores']} cores, jax {m['jax']} ({m['backend']}) | {la} "
                     f"| `{r['weights']['drafter_sha256'][:12]}` "
                     f"| {_best_step(r['train'])} "
                     f"| {_f(r['train']['best'].get('tau'), '.3f')} "
                     f"| {_f(r['train'].get('tokens_per_s'), '.0f')} "
                     f"| {sec['simulated']:.0f}, {sec['probes']:.0f}, {sec['decode']:.0f} |")
    return "\n".join(lines)


def _best_step(train: dict) -> str:
    """"BEST of LAST" and whether validation tau still rose at the last evaluation."""
    ev = train.get("evals") or []
    best = train["best"].get("step", "-")
    if not ev:
        return str(best)
    rising = len(ev) > 1 and ev[-1]["tau"] > ev[-2]["tau"]
    return f"{best} of {ev[-1]['step']}{' (tau still rising)' if rising else ''}"


def table_simulated(results: dict) -> str:
    lines = ["| drafter | params | seeds | tau (simulated) [95% CI] | vs eagle3 | acc_0 | acc_6 "
             "| retention acc_6/acc_0 [95% CI] | alpha_0..alpha_6 (conditional) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in MATRIX:
        tau = interval(results, n, "tau_sim")
        if tau is None:
            lines.append(f"| {LABELS[n]} | | none | {MISSING} | | | | | |")
            continue
        d = paired(results, n, "eagle3", "tau_sim") if n != "eagle3" else None
        acc = acc_point(results, n)
        al = alpha_point(results, n, "sim")
        counts = sorted({r["train"].get("params") for (m, _), r in results.items() if m == n
                         and r["train"].get("params")})
        size = ", ".join(f"{c / 1e6:.2f}M" for c in counts) or "-"
        lines.append(f"| {LABELS[n]} | {size} | {_seeds_cell(results, n)} | {_ci(tau)} "
                     f"| {_ci(d, '+.2f') if n != 'eagle3' else '-'} | {acc[0]:.3f} "
                     f"| {acc[-1]:.3f} | {_ci(interval(results, n, 'retention'), '.1%')} "
                     f"| {' '.join(_f(x) for x in al)} |")
    return "\n".join(lines)


def table_loop(results: dict) -> str:
    """The in-loop table; a T = 1 column that no run measured (`--settings` left it
    out) is dropped and named below the table instead of showing "not yet measured"
    in every row."""
    optional = [("tau T=1 token", "tau_t1_token"), ("tau T=1 block", "tau_t1_block"),
                ("speedup T=1 token", "speedup_t1_token"),
                ("speedup T=1 block", "speedup_t1_block")]
    cols = [(h, k) for h, k in optional
            if any(interval(results, n, k) is not None for n in MATRIX)]
    dropped = [h for h, k in optional if (h, k) not in cols]
    lines = ["| drafter | seeds | tau T=0 [95% CI] | vs eagle3 | alpha_0..alpha_6 T=0 "
             "| speedup T=0 [95% CI] | T=0 == AR |" + "".join(f" {h} |" for h, _ in cols),
             "|" + "---|" * (7 + len(cols))]
    for n in MATRIX:
        tau = interval(results, n, "tau_t0")
        if tau is None:
            lines.append(f"| {LABELS[n]} | none | {MISSING} |" + " |" * (4 + len(cols)))
            continue
        d = paired(results, n, "eagle3", "tau_t0") if n != "eagle3" else None
        al = alpha_point(results, n, "t0")
        same = [x for s in SEEDS if (n, s) in results
                for x in results[n, s]["decode"]["t0"]["identical"]]
        lines.append(
            f"| {LABELS[n]} | {_seeds_cell(results, n)} | {_ci(tau)} "
            f"| {_ci(d, '+.2f') if n != 'eagle3' else '-'} | {' '.join(_f(x) for x in al)} "
            f"| {_ci(interval(results, n, 'speedup_t0'))} | {sum(same)}/{len(same)} |"
            + "".join(f" {_ci(interval(results, n, k))} |" for _, k in cols))
    if dropped:
        lines += ["", "Not measured in any run (`measure --settings` left them out): "
                  + ", ".join(dropped) + "."]
    return "\n".join(lines)


def table_hybrid(results: dict) -> str:
    h, c = "hybrid_from_eagle3", "eagle3_more"
    rows = [("simulated tau", interval(results, h, "tau_sim"),
             interval(results, h, "tau_sim_nokv"),
             paired(results, h, h, "tau_sim", stat_b="tau_sim_nokv"),
             interval(results, c, "tau_sim"), paired(results, h, c, "tau_sim")),
            ("in-loop tau, T=0", interval(results, h, "tau_t0"),
             interval(results, h, "tau_t0_nokv"),
             paired(results, h, h, "tau_t0", stat_b="tau_t0_nokv"),
             interval(results, c, "tau_t0"), paired(results, h, c, "tau_t0")),
            ("in-loop tau, T=1 block", interval(results, h, "tau_t1_block"),
             interval(results, h, "tau_t1_block_nokv"),
             paired(results, h, h, "tau_t1_block", stat_b="tau_t1_block_nokv"),
             interval(results, c, "tau_t1_block"), paired(results, h, c, "tau_t1_block"))]
    lines = ["| measure | hybrid_from_eagle3 | same, KV branch zeroed (gate_d = 0) "
             "| hybrid - zeroed | eagle3_more (control) | hybrid - eagle3_more |",
             "|---|---|---|---|---|---|"]
    for label, *cells in rows:
        fmt = [_ci(cells[0]), _ci(cells[1]), _ci(cells[2], "+.2f"), _ci(cells[3]),
               _ci(cells[4], "+.2f")]
        lines.append(f"| {label} | " + " | ".join(fmt) + " |")
    gates = []
    for s in SEEDS:
        r = results.get((h, s))
        if r:
            sim = r["simulated"]
            g = sum(sim.get("gate", [])) / max(sum(sim.get("gate_count", [])), 1)
            gates.append(f"seed {s}: {g:.3f} (export, held-out) / "
                         f"{_f(r['train']['best'].get('gate'), '.3f')} (training's record)")
    lines.append("")
    lines.append("Mean gate g of the hybrid: " + ("; ".join(gates) if gates else MISSING)
                 + ". The gate mean alone does not say how much the KV branch is used "
                 "(h = n + g * gate_d (o - n) also scales with gate_d and o - n); the "
                 "zeroed-branch columns measure it.")
    return "\n".join(lines)


def table_probes(results: dict) -> str:
    lines = ["| run | drafter layer | memory's initial target layer | cos(q_drafter, q_target) "
             "trained | at random init | mask positions trained (init) | best target layer "
             "(cos) | target's own queries, layers a vs b |",
             "|---|---|---|---|---|---|---|---|"]
    glines = ["| run | objective | weights | \\|grad\\| total | k_proj | v_proj | merge_k "
              "| merge_v | q_proj |", "|---|---|---|---|---|---|---|---|---|"]
    any_q = any_g = False
    for (n, s), r in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        p = r.get("probes") or {}
        q = p.get("query_cosine")
        if q:
            any_q = True
            a, b = q["target_between_layers"]
            for x in q["layers"]:
                mask = (f"{x['trained_mask']:.3f} ({x['init_mask']:.3f})"
                        if "trained_mask" in x else "-")
                lines.append(f"| {n}-s{s} | {x['layer']} | {x['target_layer']} "
                             f"| {x['trained']:.3f} | {x['init']:.3f} | {mask} "
                             f"| {x['best_target_layer']} ({x['best']:.3f}) "
                             f"| {q['target_between']:.3f} ({a} vs {b}) |")
        g = p.get("grad")
        if g:
            any_g = True
            for which in ("init", "trained"):
                x = g[which]
                cells = " | ".join(_f(x["parts"][k]["fraction"], ".3f") for k in
                                   ("k_proj", "v_proj", "merge_k", "merge_v", "q_proj"))
                glines.append(f"| {n}-s{s} | {g['objective']} | {which} | {x['total']:.3g} "
                              f"| {cells} |")
    q_text = "\n".join(lines) if any_q else f"Query probe: {MISSING} (no kv2 or block_kv run)."
    g_text = "\n".join(glines) if any_g else f"Gradient probe: {MISSING}."
    return q_text + "\n\n" + g_text


def claims(results: dict) -> str:
    """Per claim (a)-(d) of docs/kvshot.md (and the hybrid's), what the intervals allow."""
    a = paired(results, "kv2", "eagle3", "retention")
    c_sim = paired(results, "block_kv", "kv2", "tau_sim")
    c_t0 = paired(results, "block_kv", "kv2", "tau_t0")
    d_sim = paired(results, "block_kv", "block_hidden", "tau_sim")
    d_t0 = paired(results, "block_kv", "block_hidden", "tau_t0")
    d_sp = paired(results, "block_kv", "block_hidden", "speedup_t0")
    h = "hybrid_from_eagle3"
    e_ctl = paired(results, h, "eagle3_more", "tau_sim")
    e_ctl0 = paired(results, h, "eagle3_more", "tau_t0")
    e_abl = paired(results, h, h, "tau_sim", stat_b="tau_sim_nokv")
    e_abl0 = paired(results, h, h, "tau_t0", stat_b="tau_t0_nokv")
    return "\n".join([
        "**(a) KV-only retention (acc_6/acc_0) above EAGLE-3's.** kv2 minus eagle3, "
        "simulated retention: " + verdict(a, "above", "difference ") ,
        "",
        "**(b) Depth helps KV-only.** Not tested by this matrix: its minimum set has the "
        "2-layer KV-only drafter only (the pilot's kv1 and kv4 are not retrained), so the "
        "pilot's reading stands as a single-seed pilot result.",
        "",
        "**(c) Block-wise training lifts KV drafters.** block_kv (the KV-only 2-layer "
        "weights trained block-wise) minus kv2 (the same weights, TTT): simulated tau "
        + verdict(c_sim, "above", "") + " In the loop at T=0: " + verdict(c_t0, "above", ""),
        "",
        "**(d) A block drafter with KV context beats one with hidden context.** block_kv "
        "minus block_hidden: simulated tau " + verdict(d_sim, "above", "") + " In the loop "
        "at T=0, tau " + verdict(d_t0, "above", "") + " Speedup at T=0: "
        + verdict(d_sp, "above", ""),
        "",
        "**The hybrid's KV branch.** hybrid_from_eagle3 minus its control eagle3_more "
        "(eagle3 trained on for the same steps): simulated tau " + verdict(e_ctl, "above", "")
        + " In the loop at T=0: " + verdict(e_ctl0, "above", "") + " Against itself with "
        "the KV branch zeroed (simulated tau): " + verdict(e_abl, "above", "") + " In the "
        "loop at T=0: " + verdict(e_abl0, "above", ""),
    ])


def write_plots(results: dict, img_dir: str = IMG_DIR) -> list[str]:
    """docs/img/kvshot2_tau.png (tau with intervals per drafter: simulated, T=0, T=1 block)
    and docs/img/kvshot2_alpha.png (acc_k simulated, alpha_k in the loop at T=0)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specjax.fileio import atomic_write

    os.makedirs(img_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    stats = [("tau_sim", "simulated"), ("tau_t0", "in loop, T=0"),
             ("tau_t1_block", "in loop, T=1 block")]
    for j, (st, label) in enumerate(stats):
        xs, ys, err = [], [], []
        for i, n in enumerate(MATRIX):
            x = interval(results, n, st)
            if x is None or not math.isfinite(x["estimate"]):
                continue
            xs.append(i + (j - 1) * 0.25)
            ys.append(x["estimate"])
            err.append([x["estimate"] - x["lo"], x["hi"] - x["estimate"]])
        if xs:
            ax.errorbar(xs, ys, yerr=np.asarray(err).T, fmt="o", capsize=4, label=label)
    ax.set_xticks(range(len(MATRIX)))
    ax.set_xlim(-0.6, len(MATRIX) - 0.4)
    ax.set_xticklabels(MATRIX, rotation=15)
    ax.set_ylabel("tau (tokens per verification), 95% CI")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.set_title("Redone KVShot study: tau per drafter (missing drafters have no point)")
    fig.tight_layout()
    paths.append(_save_fig(fig, os.path.join(img_dir, "kvshot2_tau.png"), atomic_write, io))
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, n in enumerate(MATRIX):
        style = "--" if n.startswith("block") else "-"
        acc = acc_point(results, n)
        if acc:
            axes[0].plot(range(len(acc)), acc, style, marker="o", color=f"C{i}", label=n)
        al = alpha_point(results, n, "t0")
        if al:
            axes[1].plot(range(len(al)), [np.nan if a is None else a for a in al], style,
                         marker="o", color=f"C{i}", label=n)
    axes[0].set_title("acc_k, simulated (teacher-forced, held-out)")
    axes[1].set_title("alpha_k in the loop (T=0, held-out prompts)")
    for ax in axes:
        ax.set_xlabel("draft position k")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save_fig(fig, os.path.join(img_dir, "kvshot2_alpha.png"), atomic_write, io))
    plt.close(fig)
    return paths


def _save_fig(fig, path, atomic_write, io) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    atomic_write(path, lambda f: f.write(buf.getvalue()))
    return path


def provenance(results_dir: str) -> dict:
    """RESULTS_DIR/provenance.json when there is one (written by hand for runs made
    elsewhere, e.g. on a lent accelerator): {"commands": [lines of the commands block],
    "report": the report command, "weights": where the exports were, "machine": the
    machine paragraph, "notes": [more setup items]}; {} otherwise."""
    path = os.path.join(results_dir, "provenance.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def budget_text(results: dict, runs_root: str) -> tuple[str, str]:
    """(the training budget read from the runs' saved config.yaml files, a sentence on
    whether validation tau still rose at the end)."""
    import yaml

    plans, warm = set(), set()
    for (n, s) in results:
        path = os.path.join(run_dir(n, s, runs_root), "config.yaml")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            c = yaml.safe_load(f) or {}
        t, d = c.get("train", {}), c.get("data", {})
        plan = (t.get("steps"), t.get("batch_size"), t.get("grad_accum", 1), d.get("seq_len"))
        (warm if t.get("init_from") else plans).add(plan)
    def one(p):
        steps, b, acc, seq = p
        return f"{steps} steps of B {b * acc} x T {seq} = {steps * b * acc * seq:,} tokens"
    if not plans:
        budget = "runs' configs not found"
    else:
        budget = "; ".join(one(p) for p in sorted(plans))
    if warm:
        budget += ("; eagle3_more and hybrid_from_eagle3 train "
                   + "; ".join(one(p) for p in sorted(warm))
                   + " more from the same seed's eagle3 export")
    rising = [(n, s) for (n, s), r in results.items()
              if len(r["train"].get("evals") or []) > 1
              and r["train"]["evals"][-1]["tau"] > r["train"]["evals"][-2]["tau"]]
    gains = [r["train"]["evals"][-1]["tau"] - r["train"]["evals"][-2]["tau"]
             for (n, s), r in results.items() if (n, s) in rising]
    if rising:
        plateau = (f"A stated budget, not a plateau: validation tau still rose at the last "
                   f"evaluation in {len(rising)} of {len(results)} runs (by "
                   f"{min(gains):.3f} to {max(gains):.3f} over the last evaluation interval, "
                   "with the learning rate at the end of its cosine decay), so every "
                   "figure is a figure at this budget, the same for all.")
    else:
        plateau = "Every run's validation tau stopped rising before its last evaluation."
    return budget, plateau


def render(results: dict, *, runs_root: str = MATRIX_ROOT, doc: str = DOC,
           img_dir: str | None = IMG_DIR, results_dir: str = RESULTS_DIR) -> str:
    """The text of docs/kvshot2.md from `results` (`load_results`); writes it to `doc`
    (None: not written) and the plots to `img_dir` (None: none). Returns the text."""
    status, missing = table_status(results, runs_root)
    sizes = sorted({json.dumps(r["sizes"], sort_keys=True) for r in results.values()})
    sizes_text = "; ".join(", ".join(f"{k} {v}" for k, v in json.loads(s).items())
                           for s in sizes) or "-"
    imgs = []
    if img_dir is not None:
        imgs = write_plots(results, img_dir)
    rel = [os.path.relpath(p, os.path.dirname(doc) if doc else ROOT) for p in imgs]
    missing_text = ", ".join(missing) if missing else "none"
    prov = provenance(results_dir)
    commands = prov.get("commands") or [
        "python benchmarks/studies/kvshot/kvshot.py matrix          # trains the runs",
        "python benchmarks/studies/kvshot/kvshot_study2.py measure  # runs without results",
        "python benchmarks/studies/kvshot/kvshot_study2.py report   # this page and its plots"]
    budget, plateau = budget_text(results, runs_root)
    gpu = sorted({r["machine"].get("device", r["machine"]["backend"]) for r in results.values()
                  if r["machine"]["backend"] != "cpu"})
    cpu = any(r["machine"]["backend"] == "cpu" for r in results.values())
    target_dtype = ("f32" if not gpu else "bf16" if not cpu else
                    "f32 on CPU, bf16 on an accelerator")
    weights_where = prov.get("weights", "runs/study2/NAME-sSEED/drafter")
    machine_text = prov.get("machine") or (
        "every figure below was measured on this 2-core CPU (no accelerator), beside the "
        "matrix's training job (load averages in the provenance table); speedups are ratios "
        "within one process and one prompt, but absolute tokens/s on a shared CPU are not "
        "comparable across runs.")
    parts = [
        "# The KVShot study, redone (issue 29): seeds, equal terms, intervals",
        "",
        f"<!-- generated by `{prov.get('report', 'python ' + SCRIPT + ' report')}`"
        f" from {os.path.relpath(results_dir, ROOT)}/*.json: edit the generator, not this "
        "file -->",
        "",
        f"**Status: {len(results)} of {len(MATRIX) * len(SEEDS)} runs measured.** Missing: "
        f"{missing_text}. Rows of drafters without results say \"{MISSING}\"; a figure "
        "marked ¹ comes from one seed, so its interval covers the prompts only. The pilot "
        "study (one seed, unequal terms) is docs/kvshot.md, left as it was.",
        "",
        "```bash",
        *commands,
        "```",
        "",
        "## Setup",
        "",
        "- Target: checkpoints/demo/target (24.7M parameters, frozen). Drafters: "
        "configs/study2/*.yaml, the same regenerated data (the target's own greedy text, "
        f"benchmarks/data/study2/), the same budget ({budget}), 64 TTT chains or 64 "
        "blocks of G = 7 per sequence, every context at target depths 2, 4, 5, seeds 0, 1, "
        "2 (train.seed). Each export is the best-tau snapshot of its run's validation "
        "(held-out positions 0-63).",
        f"- {plateau}",
        "- Simulated: the trainer's own validation statistics "
        "(DrafterTrainer.loss_and_stats, evaluation mode) per held-out sequence, on "
        "sequences that took no part in choosing the export (positions sim_start .. "
        "sim_start + sim_rows of the held-out order, T = 256). tau = 1 + sum of accepted "
        "drafts / chains; acc_k: draft k right on its own; alpha_k: conditional.",
        "- In the loop: specjax.decoding.engine.Engine as decode.py builds it "
        f"({target_dtype} target, bf16 drafter matmuls, batch 1, EOS on, kernels auto) on "
        "`prompts` prompts cut from held-out documents (their first prompt_tokens tokens), "
        "new_tokens new tokens each; each prompt decoded by the drafter and then "
        "autoregressively with the same key, so the speedup is a within-process ratio. "
        "tau = 1 + accepted / verification steps.",
        f"- Sizes: {sizes_text}.",
        f"- Weights: each run's exported drafter ({weights_where}; sha256 "
        "prefix of its model.safetensors in the provenance table); target fingerprint "
        "(specjax.models.checkpoint.fingerprint) "
        + (", ".join(sorted({f"`{r['weights']['target_fingerprint'][:12]}`"
                             for r in results.values()})) or "-") + ".",
        f"- Intervals: 95% percentile intervals of a crossed bootstrap ({RESAMPLES} "
        "resamples, numpy seed 0) that draws seeds and prompts (or held-out sequences) with "
        "replacement, independently, and recomputes the statistic from totals; a difference "
        "between two drafters resamples both with the same seeds and prompts (paired; seed "
        "pairs share the seed index, and a warm-started run shares its seed's eagle3).",
        f"- Machine: {machine_text}",
        *[f"- {x}" for x in prov.get("notes", [])],
        "",
        "## Runs",
        "",
        status,
        "",
        "Provenance (code = the git revision measured; + N changed files = uncommitted "
        "changes under specjax/, decode.py or benchmarks/ at the time):",
        "",
        table_provenance(results) if results else MISSING,
        "",
        "## Simulated acceptance on held-out sequences",
        "",
        table_simulated(results),
        "",
        "## In the decoding loop",
        "",
        table_loop(results),
        "",
        *[f"![{os.path.basename(p)}]({p})" for p in rel],
        "",
        "## The hybrid: its KV branch zeroed, and its control",
        "",
        table_hybrid(results),
        "",
        "## Probes",
        "",
        "Query cosine: per drafter layer, the cosine between its queries and the target's "
        "own queries at the layer its merged memory started from (kv2: TTT step 0; block_kv: "
        "block position 0, the anchor token, and the mask positions). Gradient share: the "
        "fraction of the loss gradient's norm reaching the drafter's own K/V projections and "
        "merge maps, at random init and at the trained weights.",
        "",
        table_probes(results),
        "",
        "## What the intervals allow, per claim of the pilot (docs/kvshot.md)",
        "",
        claims(results),
        "",
    ]
    text = "\n".join(parts)
    if doc is not None:
        from specjax.fileio import atomic_write

        os.makedirs(os.path.dirname(doc), exist_ok=True)
        atomic_write(doc, lambda f: f.write(text.encode()))
    return text


# ------------------------------------------------------------------ CLI

def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs-root", default=MATRIX_ROOT, help="where NAME-sSEED runs live")
    ap.add_argument("--results-dir", default=RESULTS_DIR, help="per-run result JSON files")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure finished runs that have no results yet")
    m.add_argument("--only", nargs="+", choices=MATRIX, help="these drafters only")
    m.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    m.add_argument("--prompts", type=int, default=SIZES["prompts"], help="in-loop prompts")
    m.add_argument("--sim-rows", type=int, default=SIZES["sim_rows"],
                   help="held-out sequences for the simulated figures")
    m.add_argument("--new-tokens", type=int, default=SIZES["new_tokens"])
    m.add_argument("--force", action="store_true", help="measure again runs with results")
    m.add_argument("--settings", nargs="+", choices=tuple(SETTINGS),
                   default=list(DEFAULT_SETTINGS), help="in-loop settings")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override the runs were trained with (repeatable)")
    r = sub.add_parser("report", help="render docs/kvshot2.md and plots from the results")
    r.add_argument("--doc", default=DOC)
    r.add_argument("--img-dir", default=IMG_DIR)
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # configs name the target and data relative to the checkout
    if args.cmd == "measure":
        names = [n for n in MATRIX if not args.only or n in args.only]
        sizes = {"prompts": args.prompts, "sim_rows": args.sim_rows,
                 "new_tokens": args.new_tokens}
        from specjax.compile_cache import enable_compile_cache

        enable_compile_cache(None)  # decode.py's default: the AR loops compile once
        done = measure(names, args.seeds, force=args.force, runs_root=args.runs_root,
                       results_dir=args.results_dir, sizes=sizes,
                       settings=tuple(args.settings), overrides=tuple(args.set))
        log(f"measured {len(done)} runs: {', '.join(done) or 'none'}")
        return 0
    results = load_results(args.results_dir)
    render(results, runs_root=args.runs_root, doc=args.doc, img_dir=args.img_dir,
           results_dir=args.results_dir)
    log(f"{len(results)} runs with results; wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
