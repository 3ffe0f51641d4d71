"""medc against eagle3 on equal terms (issue 32, part 2; docs/medc.md).

    python benchmarks/medc.py measure [--force]   # both runs -> benchmarks/results/medc/
    python benchmarks/medc.py report              # the docs/medc.md section from them

The two runs share data, budget, seed, target and held-out stream: runs/medc/medc-s0
(configs/medc/medc.yaml) and the KVShot study's CPU run runs/study2/eagle3-s0
(configs/study2/eagle3.yaml, the same file with kind eagle3). `measure` runs
benchmarks/kvshot_study2.py's measurement on each: simulated acceptance on held-out
sequences, then in-loop tau and speedup at T = 0 and T = 1 (block verification) on the
same held-out prompts, each prompt decoded by the drafter and then autoregressively in the
same process. It adds the parts of one step timed outside the loop
(`Engine.step_timing`, T = 0, batch 1, the first prompt; the median of 7 calls per
drafter, the drafters alternating; redone on every `measure`): draft ms, verify ms, and
draft ms per accepted token (draft ms / in-loop tau at T = 0). `report` renders the comparison
with paired bootstrap intervals over prompts (one seed each, so seed-to-seed variation is
not covered).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import kvshot_study2 as k2  # noqa: E402
from specjax import cli  # noqa: E402

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results", "medc")
DOC = os.path.join(ROOT, "docs", "medc.md")
RUNS = {"eagle3": (os.path.join(ROOT, "runs", "study2"), os.path.join(ROOT, "configs", "study2")),
        "medc": (os.path.join(ROOT, "runs", "medc"), os.path.join(ROOT, "configs", "medc"))}
SEED = 0


def step_engine(name: str):
    """(Engine, prompt ids, new tokens) for timing one step of run NAME-s0 at T = 0, batch
    1, on the first held-out prompt (decode.py's loading defaults)."""

    from specjax.decoding.engine import Engine, prompt_width_for
    from specjax.decoding.loading import load_drafter, load_target, resolve_dtype
    from specjax.decoding.sampling import SamplingParams

    runs_root, config_dir = RUNS[name]
    cfg = k2.load_config_for(name, SEED, runs_root=runs_root, config_dir=config_dir)
    prompts = k2.held_out_prompts(cfg.data.val_tokens_npy, 1, k2.SIZES["prompt_tokens"])
    dtype = resolve_dtype("auto")
    target = load_target(cfg.target_dir, dtype=dtype, matmul_dtype="auto", tokenizer=None)
    sampling = SamplingParams(0.0, 0, 1.0)
    loaded = load_drafter(cfg.export_dir, target, sampling=sampling, dtype=dtype,
                          matmul_dtype="auto", draft_vocab="auto")
    ids = prompts[0][1]
    new = k2.SIZES["new_tokens"]
    eng = Engine(target.model, drafter=loaded.drafter, drafter_params=loaded.params,
                 sampling=sampling, max_length=len(ids) + new,
                 prompt_width=prompt_width_for(len(ids), len(ids) + new), batch_size=1,
                 eos_token_ids=tuple(target.cfg.eos_token_ids))
    return eng, ids, new


def step_parts(rounds: int = 7) -> dict:
    """{name: {"draft_ms", "verify_ms", "step_ms", "rounds"}}: the median of `rounds`
    calls of `Engine.step_timing` per drafter, the drafters alternating call by call so
    that both see the same machine noise (one call alone varies by tens of percent on
    this CPU)."""
    import jax
    import numpy as np

    engines = {name: step_engine(name) for name in RUNS}
    got = {name: [] for name in RUNS}
    for _ in range(rounds):
        for name, (eng, ids, new) in engines.items():
            got[name].append(eng.step_timing([ids], new, jax.random.key(0)))
    return {name: {**{k: float(np.median([r[k] for r in rs])) for k in rs[0]},
                   "rounds": rounds} for name, rs in got.items()}


def measure(force: bool = False) -> None:
    for name, (runs_root, config_dir) in RUNS.items():
        path = k2.result_path(name, SEED, RESULTS_DIR)
        if os.path.isfile(path) and not force:
            k2.log(f"{name}-s{SEED}: measured already (--force to redo)")
            continue
        if not k2.is_finished(name, SEED, runs_root):
            raise SystemExit(f"medc.py: error: {k2.run_dir(name, SEED, runs_root)} has no "
                             "exported drafter; train it first (docs/medc.md)")
        k2.measure_run(name, SEED, runs_root=runs_root, config_dir=config_dir,
                       results_dir=RESULTS_DIR)
    k2.log("step timing: both drafters, alternating")
    parts = step_parts()
    for name in RUNS:
        path = k2.result_path(name, SEED, RESULTS_DIR)
        with open(path) as f:
            rec = json.load(f)
        rec["step_timing"] = parts[name]
        k2._write_json(path, rec)


def render(results: dict) -> str:
    """The markdown between the `medc:results` markers."""
    seeds = (SEED,)
    rows = [("simulated tau (held-out sequences)", "tau_sim"),
            ("in-loop tau, T = 0", "tau_t0"), ("in-loop tau, T = 1 block", "tau_t1_block"),
            ("speedup, T = 0", "speedup_t0"), ("speedup, T = 1 block", "speedup_t1_block")]
    lines = ["| measure | eagle3 | medc | medc - eagle3 |", "|---|---|---|---|"]
    for label, stat in rows:
        a = k2.interval(results, "eagle3", stat, seeds)
        b = k2.interval(results, "medc", stat, seeds)
        d = k2.paired(results, "medc", "eagle3", stat, seeds)
        lines.append(f"| {label} | {k2._ci(a)} | {k2._ci(b)} | {k2._ci(d, '+.2f')} |")
    for key, label in (("draft_ms", "draft ms per step (G = 7, T = 0, B = 1; median of "
                                    "alternating calls)"),
                       ("verify_ms", "verify ms per step")):
        cells = [k2._f((results.get((n, SEED)) or {}).get("step_timing", {}).get(key))
                 for n in ("eagle3", "medc")]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | |")
    per = []
    for n in ("eagle3", "medc"):
        r = results.get((n, SEED))
        t = k2.interval(results, n, "tau_t0", seeds)
        per.append(k2._f(r["step_timing"]["draft_ms"] / t["estimate"], ".2f")
                   if r and "step_timing" in r and t else "-")
    lines.append(f"| draft ms per accepted token (draft ms / tau T = 0) | {per[0]} | {per[1]} "
                 "| |")
    params = [k2._f((results.get((n, SEED)) or {}).get("train", {}).get("params"), ",")
              for n in ("eagle3", "medc")]
    lines.append(f"| own parameters | {params[0]} | {params[1]} | |")
    same = [all(results[n, SEED]["decode"]["t0"]["identical"]) if (n, SEED) in results
            else None for n in ("eagle3", "medc")]
    lines.append(f"| T = 0 output identical to autoregressive | {same[0]} | {same[1]} | |")
    meta = next(iter(results.values()), None)
    where = "" if meta is None else (
        f"Measured on {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
        f"{meta['machine']['backend']}), code {meta['code']['rev']}; sizes "
        + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items()) + ". ")
    return (where + "One seed each: the 95% intervals (paired bootstrap over prompts or "
            "held-out sequences) cover prompt-to-prompt variation only. Speedups are "
            "ratios within one process, drafter then autoregressive on each prompt.\n\n"
            + "\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="measure both runs (skips measured ones)")
    m.add_argument("--force", action="store_true")
    sub.add_parser("report", help="render the docs/medc.md section")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    if args.cmd == "measure":
        from specjax.compile_cache import enable_compile_cache

        enable_compile_cache(None)
        measure(args.force)
        return 0
    from benchmarks._common import replace_doc_section

    results = k2.load_results(RESULTS_DIR)
    replace_doc_section(DOC, "medc:results", render(results), "# medc\n\n")
    k2.log(f"{len(results)} runs with results; wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
