"""Rebuilds docs/kvshot.md's tables and plots from the finished study runs.

    python benchmarks/studies/kvshot/kvshot.py report [--measure] [--only NAME ...] [--prompts N]

Sources, per run in runs/study/NAME/: metrics.jsonl (validation alpha_k, tau and the
hybrid's gate over training) and drafter/ (the exported best-tau drafter). With
--measure it also runs, on a quiet machine, for each finished run (or --only):
  - decode.py on the first N bundled held-out prompts (128 new tokens, EOS on, batch 1,
    the drafter's G = 7): T=0, T=1 token verification and T=1 block verification, each
    against autoregressive decoding in the same process (--compare-ar);
  - benchmarks/profile_step.py (T=0, 2 prompts): the drafter's ms per step;
  - the probes of benchmarks/studies/kvshot/kvshot_probes.py (KV runs).
Measurements are merged into docs/kvshot/results.json (committed: the report can be
rebuilt without the runs); the markdown between `<!-- kvshot:NAME -->` and
`<!-- /kvshot:NAME -->` markers in docs/kvshot.md is regenerated, the prose around it is
left alone. Plots: docs/kvshot/alpha.png, docs/kvshot/training.png.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.append(ROOT)

from benchmarks.studies.kvshot.kvshot_runs import RUN_ROOT, RUNS, finished  # noqa: E402
from specjax import cli  # noqa: E402

DOC = os.path.join(ROOT, "docs", "kvshot.md")
OUT_DIR = os.path.join(ROOT, "docs", "kvshot")
RESULTS = os.path.join(OUT_DIR, "results.json")
LABELS = {"eagle3": "EAGLE-3 (hidden), ttt", "kv1": "KV-only 1 layer, ttt",
          "kv2": "KV-only 2 layers, ttt", "kv4": "KV-only 4 layers, ttt",
          "hybrid": "hybrid, ttt, random init",
          "hybrid_from_eagle3": "hybrid, ttt, from eagle3",
          "block_hidden": "block, hidden context, block-wise",
          "block_kv": "block, KV context (= KV-only 2 layers), block-wise",
          "block_both": "block, hidden + KV context, block-wise"}
# KVShot's figures (Qwen3-8B, third-party notes of arXiv 2604.26412): alpha_0, alpha_6, MAT
PAPER = [("EAGLE-3 (hidden-only)", .638, .469, 2.37),
         ("KV-only, 1 layer", .494, .353, 1.84), ("KV-only, 2 layers", .594, .463, 2.23),
         ("KV-only, 4 layers", .614, .495, 2.34),
         ("hybrid, from the EAGLE-3 checkpoint", .665, .514, 2.54)]
SETTINGS = {"t0": ("0", "block"), "t1_token": ("1", "token"), "t1_block": ("1", "block")}


def log(msg: str) -> None:
    print(f"[kvshot] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ training records

def read_run(name: str) -> dict:
    """{"evals": [{"step", "tokens", "val_loss", "alpha", "tau", "gate"?}], "best": the
    exported drafter's train record, "tok_s": mean training tokens/s, "params"}."""
    run = os.path.join(RUN_ROOT, name)
    evals, rates, params = [], [], None
    tokens_per_step = 8 * 256
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") in ("start", "resume") and r.get("params"):
                params = r["params"]
            if "tau" in r and "event" not in r:
                evals.append({"step": r["step"], "tokens": r["step"] * tokens_per_step,
                              **{k: r[k] for k in ("val_loss", "alpha", "tau", "gate")
                                 if k in r}})
            if r.get("event") == "done" and r.get("tokens_per_s"):
                rates.append(r["tokens_per_s"])  # the run's mean (the last start's, if resumed)
    from specjax.fileio import read_config_json

    best = read_config_json(os.path.join(run, "drafter"), "drafter")["train"]
    return {"evals": evals, "best": best, "params": params,
            "tok_s": rates[-1] if rates else None}


# ------------------------------------------------------------------ measurements

def _prompt_file(n: int) -> str:
    src = os.path.join(ROOT, "checkpoints", "demo", "prompts.jsonl")
    with open(src) as f:
        lines = [x for x in f if x.strip()][:n]
    fd, path = tempfile.mkstemp(suffix=".jsonl", prefix="kvshot-prompts-")
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
    return path


def measure_decode(name: str, prompts: str) -> dict:
    """{setting: decode.py's summary} for the three SETTINGS."""
    out = {}
    drafter = os.path.join(RUN_ROOT, name, "drafter")
    for setting, (temp, verify) in SETTINGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            summary = os.path.join(tmp, "summary.json")
            cmd = [sys.executable, os.path.join(ROOT, "decode.py"), "--drafter", drafter,
                   "--prompts", prompts, "--temperature", temp, "--verify", verify,
                   "--summary", summary, "--show", "0", "--seed", "0"]
            log(f"{name} {setting}: {' '.join(cmd[1:])}")
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"decode.py failed for {name}: {proc.stderr[-2000:]}")
            with open(summary) as f:
                out[setting] = json.load(f)
    return out


def measure_draft_cost(name: str) -> dict:
    """profile_step.py's ms per step (T=0, 2 prompts x 128 tokens, one traced run)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.json")
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "profile_step.py"),
               "--drafter", os.path.join(RUN_ROOT, name, "drafter"), "--num-prompts", "2",
               "--runs", "1", "--json", path]
        log(f"{name} profile: {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"profile_step.py failed for {name}: {proc.stderr[-2000:]}")
        with open(path) as f:
            return json.load(f)


def measure(names: list[str], results: dict, n_prompts: int, probes: bool,
            timing: bool = True) -> None:
    prompts = _prompt_file(n_prompts)
    try:
        for name in names if timing else ():
            r = results.setdefault("runs", {}).setdefault(name, {})
            r["decode"] = measure_decode(name, prompts)
            r["decode_prompts"] = n_prompts
            prof = measure_draft_cost(name)
            r["profile"] = {"ms_per_step": prof["ms_per_step"], "step_ms": prof["step_ms"],
                            "tau": prof["tau"]}
            _save(results)
    finally:
        os.unlink(prompts)
    if probes:
        from benchmarks.studies.kvshot import kvshot_probes

        for name in names:
            if name.startswith("kv"):
                log(f"{name}: query probe")
                results["runs"][name]["query_cosine"] = kvshot_probes.query_cosines(name)
            if name in ("kv2", "block_kv"):
                log(f"{name}: gradient probe")
                results["runs"][name]["grad"] = kvshot_probes.grad_fractions(name)
            _save(results)


def _save(results: dict) -> None:
    from specjax.fileio import atomic_write

    os.makedirs(OUT_DIR, exist_ok=True)
    text = (json.dumps(results, indent=1) + "\n").encode()
    atomic_write(RESULTS, lambda f: f.write(text))


# ------------------------------------------------------------------ rendering

def _f(x, spec=".3f", suffix=""):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) + suffix


def _retention(alpha):
    if not alpha or alpha[0] in (None, 0) or alpha[-1] is None:
        return None
    return alpha[-1] / alpha[0]


def table_simulated(results: dict) -> str:
    lines = ["| drafter | own params | acc_0 | acc_6 | retention acc_6/acc_0 | alpha_0..alpha_6 "
             "(conditional) | tau (simulated) | best step | train tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        r = results["runs"].get(name)
        if not r or "train" not in r or "eval" not in r:
            continue
        t, e = r["train"], r["eval"]
        acc = e["acc"]
        alpha = " ".join(_f(x, ".2f") for x in e["alpha"])
        lines.append(f"| {LABELS[name]} | {t['params'] / 1e6:.2f}M | {_f(acc[0])} "
                     f"| {_f(acc[-1])} | {_f(_retention(acc), '.1%')} | {alpha} "
                     f"| {_f(e['tau'], '.2f')} | {t['best']['step']} | {_f(t['tok_s'], '.0f')} |")
    return "\n".join(lines)


def table_paper() -> str:
    lines = ["| drafter (KVShot, Qwen3-8B) | alpha_0 | alpha_6 | retention | MAT |",
             "|---|---|---|---|---|"]
    for name, a0, a6, mat in PAPER:
        lines.append(f"| {name} | {a0:.3f} | {a6:.3f} | {a6 / a0:.1%} | {mat:.2f} |")
    return "\n".join(lines)


def table_decode(results: dict) -> str:
    lines = ["| drafter | alpha_0 in loop | alpha_6 in loop | tau in loop (T=0) | draft ms "
             "per step | verify ms per step | T=0 tok/s (AR) | T=0 speedup | T=0 == AR "
             "| T=1 token speedup (tau) | T=1 block speedup (tau) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        r = results["runs"].get(name) or {}
        d = r.get("decode")
        if not d:
            continue
        t0, tk, bk = d["t0"], d["t1_token"], d["t1_block"]
        ms = r.get("profile", {}).get("ms_per_step", {})
        a = t0["alpha"]
        lines.append(
            f"| {LABELS[name]} | {_f(a[0], '.2f')} | {_f(a[-1], '.2f')} | {_f(t0['tau'], '.2f')} "
            f"| {_f(ms.get('drafter_propose'), '.2f')} "
            f"| {_f(ms.get('target_verify_forward'), '.2f')} "
            f"| {t0['tokens_per_s']:.1f} ({t0['ar_tokens_per_s']:.1f}) | {t0['speedup']:.2f}x "
            f"| {t0.get('ar_identical')} | {tk['speedup']:.2f}x ({tk['tau']:.2f}) "
            f"| {bk['speedup']:.2f}x ({bk['tau']:.2f}) |")
    return "\n".join(lines)


def table_gate(results: dict) -> str:
    rows = []
    for name in ("hybrid", "hybrid_from_eagle3"):
        r = results["runs"].get(name)
        if r and "train" in r:
            ev = [e for e in _with_init(r) if "gate" in e]
            rows.append((name, ev))
    if not rows:
        return "(no finished hybrid run)"
    steps = sorted({e["step"] for _, ev in rows for e in ev})
    lines = ["| step | " + " | ".join(LABELS[n] for n, _ in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for s in steps:
        cells = []
        for _, ev in rows:
            g = next((e["gate"] for e in ev if e["step"] == s), None)
            cells.append(_f(g))
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_init(r: dict) -> list[dict]:
    """The run's validation records, with its step-0 record first when known."""
    init = r.get("eval_init")
    first = [{"step": 0, "tokens": 0, **init}] if init else []
    return first + r["train"]["evals"]


def table_probes(results: dict) -> str:
    lines = ["| drafter | drafter layer | its memory's initial target layer | cos(q_drafter, "
             "q_target) trained | at random init | best-matching target layer (cos) "
             "| target's own queries, layers a vs b |",
             "|---|---|---|---|---|---|---|"]
    any_q = False
    for name in RUNS:
        q = (results["runs"].get(name) or {}).get("query_cosine")
        if not q:
            continue
        any_q = True
        a, b = q["target_between_layers"]
        for x in q["layers"]:
            lines.append(f"| {LABELS[name]} | {x['layer']} | {x['target_layer']} "
                         f"| {x['trained']:.3f} | {x['init']:.3f} "
                         f"| {x['best_target_layer']} ({x['best']:.3f}) "
                         f"| {q['target_between']:.3f} ({a} vs {b}) |")
    out = lines if any_q else ["(no query probe yet)"]
    glines = ["", "| drafter, objective | weights | \\|grad\\| total | k_proj | v_proj "
              "| merge_k | merge_v | q_proj |", "|---|---|---|---|---|---|---|---|"]
    any_g = False
    for name in ("kv2", "block_kv"):
        g = (results["runs"].get(name) or {}).get("grad")
        if not g:
            continue
        any_g = True
        for which in ("init", "trained"):
            x = g[which]
            cells = " | ".join(f"{x['parts'][p]['fraction']:.3f}" for p in
                               ("k_proj", "v_proj", "merge_k", "merge_v", "q_proj"))
            glines.append(f"| {LABELS[name]} ({g['objective']}) | {which} "
                          f"| {x['total']:.3g} | {cells} |")
    return "\n".join(out + (glines if any_g else []))


def write_plots(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specjax.fileio import atomic_write

    os.makedirs(OUT_DIR, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, name in enumerate(RUNS):
        r = results["runs"].get(name)
        if not r or "train" not in r:
            continue
        if "eval" not in r:
            continue
        a = r["eval"]["acc"]
        style = "--" if name.startswith("block") else "-"
        axes[0].plot(range(len(a)), a, style, marker="o", color=f"C{i}", label=LABELS[name])
        d = (r.get("decode") or {}).get("t0")
        if d:
            axes[1].plot(range(len(d["alpha"])), d["alpha"], style, marker="o",
                         color=f"C{i}", label=LABELS[name])
    axes[0].set_title("acc_k: simulated on held-out data (teacher-forced, per step)")
    axes[1].set_title("alpha_k: measured in decode.py (T=0, held-out prompts)")
    for ax in axes:
        ax.set_xlabel("draft position k")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("KVShot study on the demo target: per-position acceptance, G = 7")
    fig.tight_layout()
    _savefig(fig, os.path.join(OUT_DIR, "alpha.png"), atomic_write)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, name in enumerate(RUNS):
        r = results["runs"].get(name)
        if not r or "train" not in r:
            continue
        ev = _with_init(r)
        style = "--" if name.startswith("block") else "-"
        axes[0].plot([e["tokens"] / 1e6 for e in ev], [e["tau"] for e in ev], style,
                     marker=".", color=f"C{i}", label=LABELS[name])
        gates = [e for e in ev if "gate" in e]
        if gates:
            axes[1].plot([e["tokens"] / 1e6 for e in gates], [e["gate"] for e in gates],
                         marker="o", color=f"C{i}", label=LABELS[name])
    axes[0].set_ylabel("tau (simulated, held-out)")
    axes[1].set_ylabel("hybrid gate mean (held-out)")
    axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.set_xlabel("training tokens (millions)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    _savefig(fig, os.path.join(OUT_DIR, "training.png"), atomic_write)
    plt.close(fig)


def _savefig(fig, path, atomic_write):
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write(path, lambda f: f.write(buf.getvalue()))


SECTIONS = {"paper": lambda r: table_paper(), "simulated": table_simulated,
            "decode": table_decode, "gate": table_gate, "probes": table_probes}


def render_doc(results: dict) -> None:
    """Replaces each marked section of docs/kvshot.md with its regenerated table."""
    from specjax.fileio import atomic_write

    with open(DOC) as f:
        text = f.read()
    for key, fn in SECTIONS.items():
        pat = re.compile(rf"(<!-- kvshot:{key} -->\n).*?(<!-- /kvshot:{key} -->)", re.S)
        text = pat.sub(lambda m, fn=fn: m.group(1) + fn(results) + "\n" + m.group(2), text)
    atomic_write(DOC, lambda f: f.write(text.encode()))


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true",
                    help="run decode.py, profile_step.py and the probes (quiet machine)")
    ap.add_argument("--only", nargs="+", choices=RUNS, help="measure these runs only")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per decode run")
    ap.add_argument("--no-probes", action="store_true")
    ap.add_argument("--probes-only", action="store_true",
                    help="with --measure: only the probes (no timing: runs beside training)")
    args = ap.parse_args(argv)
    results = {"runs": {}}
    if os.path.isfile(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    done = [n for n in RUNS if finished(n)]
    for name in done:
        results["runs"].setdefault(name, {})["train"] = read_run(name)
    from benchmarks.studies.kvshot import kvshot_probes

    for name in done:  # no timing involved: runs beside training
        r = results["runs"][name]
        if "eval" not in r:
            log(f"{name}: evaluating the export on the held-out batches")
            r["eval"] = kvshot_probes.evaluate_export(name)
            _save(results)
        if name.startswith("hybrid") and "eval_init" not in r:
            log(f"{name}: evaluating its starting weights (the gate at step 0)")
            r["eval_init"] = kvshot_probes.evaluate_init(name)
            _save(results)
    if args.measure:
        names = [n for n in done if not args.only or n in args.only]
        measure(names, results, args.prompts, not args.no_probes, not args.probes_only)
    _save(results)
    write_plots(results)
    if os.path.isfile(DOC):
        render_doc(results)
    log(f"{len(done)} finished runs; wrote {RESULTS}, plots and {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
