"""medc against eagle3 on equal terms (issue 32, part 2; docs/medc.md).

    python benchmarks/medc.py measure [--force]   # both runs -> benchmarks/results/studies/medc/
    python benchmarks/medc.py reuse               # medc with and without --draft-reuse
    python benchmarks/medc.py tree                # medc's trees: shared chain or per node
    python benchmarks/medc.py report              # the docs/medc.md sections from them

The two runs share data, budget, seed, target and held-out stream: runs/medc/medc-s0
(configs/medc/medc.yaml) and the KVShot study's CPU run runs/study2/eagle3-s0
(configs/study2/eagle3.yaml, the same file with kind eagle3). `measure` runs
the KVShot redo's measurement (benchmarks/studies/kvshot/protocol.py) on each: simulated
acceptance on held-out sequences, then in-loop tau and speedup at T = 0 and T = 1 (block
verification) on the same held-out prompts, each prompt decoded by the drafter and then
autoregressively in the same process. It adds the parts of one step timed outside the loop
(`Engine.step_timing`, T = 0, batch 1, the first prompt; the median of 7 calls per
drafter, the drafters alternating; redone on every `measure`): draft ms, verify ms, and
draft ms per accepted token (draft ms / in-loop tau at T = 0). `report` renders the comparison
with paired bootstrap intervals over prompts (one seed each, so seed-to-seed variation is
not covered).

`reuse` decodes the same held-out prompts with medc (runs/medc/medc-s0) three ways per
prompt, interleaved in one process: without reuse, with `--draft-reuse`, and
autoregressively (one AR run shared by both), at T = 0 and T = 1 (block verification).
Both drafter runs are ratios to the same AR run, so their difference is paired by
prompt and machine state. It writes benchmarks/results/studies/medc/medc_noreuse-s0.json and
medc_reuse-s0.json (the same record layout as `measure`'s decode part, plus the reuse
counts per prompt).

`tree` times medc's dynamic draft trees (`--tree-topk K --tree-nodes N`, T = 0, batch 1)
built two ways that give the same tree: from one shared hidden-state chain (the default
for medc, `Eagle3Drafter.share_tree_chain`) and with one drafter forward per frontier
node (eagle3's way). Per (K, N): the draft and step milliseconds of `Engine.step_timing`
(median of 7 calls, the two alternating) and the loop's tokens per second on the
held-out prompts (both ways and AR interleaved per prompt). Output:
benchmarks/results/studies/medc/tree.json and the `medc:tree` section of docs/medc.md.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.lib import sessions  # noqa: E402
from benchmarks.lib.prompts import held_out_prompts  # noqa: E402
from benchmarks.lib.provenance import git_state, machine  # noqa: E402
from benchmarks.lib.report import fmt, write_json  # noqa: E402
from benchmarks.studies.kvshot import protocol  # noqa: E402
from specjax import cli  # noqa: E402

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results", "studies", "medc")
TREE_RESULTS = os.path.join(RESULTS_DIR, "tree.json")
DOC = os.path.join(ROOT, "docs", "medc.md")
RUNS = {"eagle3": (os.path.join(ROOT, "runs", "study2"), os.path.join(ROOT, "configs", "study2")),
        "medc": (os.path.join(ROOT, "runs", "medc"), os.path.join(ROOT, "configs", "medc"))}
SEED = 0


def run_config(name: str, **options):
    """decode.py's options for run NAME-s0's exported drafter against its target (its
    loading defaults: dtype, drafter dtype, draft vocabulary and kernels auto; the
    drafter's own G; batch 1, EOS on, protocol.SIZES' new tokens) plus `options`."""
    runs_root, config_dir = RUNS[name]
    cfg = protocol.load_config_for(name, SEED, runs_root=runs_root, config_dir=config_dir)
    return cfg, sessions.config(target=cfg.target_dir, drafter=cfg.export_dir, gamma="fixed",
                                max_new_tokens=protocol.SIZES["new_tokens"], **options)


def step_engine(name: str):
    """(engine, prompt ids, new tokens) for timing one step of run NAME-s0 at T = 0, batch
    1, on the first held-out prompt (decode.py's engine for the run's drafter)."""
    cfg, dcfg = run_config(name)
    prompts = held_out_prompts(cfg.data.val_tokens_npy, 1, protocol.SIZES["prompt_tokens"])
    ids = prompts[0][1]
    return sessions.engine(dcfg, [ids]), ids, protocol.SIZES["new_tokens"]


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
        path = protocol.result_path(name, SEED, RESULTS_DIR)
        if os.path.isfile(path) and not force:
            protocol.log(f"{name}-s{SEED}: measured already (--force to redo)")
            continue
        if not protocol.is_finished(name, SEED, runs_root):
            raise SystemExit(f"medc.py: error: {protocol.run_dir(name, SEED, runs_root)} has no "
                             "exported drafter; train it first (docs/medc.md)")
        protocol.measure_run(name, SEED, runs_root=runs_root, config_dir=config_dir,
                       results_dir=RESULTS_DIR)
    protocol.log("step timing: both drafters, alternating")
    parts = step_parts()
    for name in RUNS:
        path = protocol.result_path(name, SEED, RESULTS_DIR)
        with open(path) as f:
            rec = json.load(f)
        rec["step_timing"] = parts[name]
        write_json(path, rec)


def medc_setup(n_prompts: int):
    """(run config, dtype, target, held-out prompts, Engine settings at batch 1) for run
    medc-s0: decode.py's loading defaults, protocol.SIZES' prompt and new-token lengths."""
    from specjax.decoding.engine import prompt_width_for
    from specjax.decoding.loading import load_target, resolve_dtype

    runs_root, config_dir = RUNS["medc"]
    cfg = protocol.load_config_for("medc", SEED, runs_root=runs_root, config_dir=config_dir)
    dtype = resolve_dtype("auto")
    target = load_target(cfg.target_dir, dtype=dtype, matmul_dtype="auto", tokenizer=None)
    eos = target.cfg.eos_token_ids
    prompts = held_out_prompts(cfg.data.val_tokens_npy, n_prompts,
                               protocol.SIZES["prompt_tokens"], eos=eos[0] if eos else 0)
    longest = max(len(ids) for _, ids in prompts)
    max_length = longest + protocol.SIZES["new_tokens"]
    common = dict(max_length=max_length, prompt_width=prompt_width_for(longest, max_length),
                  batch_size=1, eos_token_ids=tuple(eos), kernels="auto")
    return cfg, dtype, target, prompts, common


def reuse_decode(settings=("t0", "t1_block")) -> dict:
    """{label: record} for labels medc_noreuse and medc_reuse (module docstring)."""
    import time

    import jax

    from specjax.models.config import ModelConfig

    sizes = dict(protocol.SIZES)
    cfg, _ = run_config("medc")
    eos = ModelConfig.from_dir(cfg.target_dir).eos_token_ids
    prompts = held_out_prompts(cfg.data.val_tokens_npy, sizes["prompts"],
                               sizes["prompt_tokens"], eos=eos[0] if eos else 0)
    new = sizes["new_tokens"]
    base = jax.random.key(protocol.DECODE_SEED)
    labels = {"medc_noreuse": False, "medc_reuse": True}
    recs = {label: {"run": f"{label}-s{SEED}", "name": label, "seed": SEED,
                    "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "code": git_state(), "machine": machine(), "sizes": sizes,
                    "prompt_ids": [p for p, _ in prompts],
                    "weights": {"drafter": "runs/medc/medc-s0/drafter",
                                "target": os.path.relpath(cfg.target_dir, ROOT)},
                    "draft_reuse": reuse, "decode": {}}
            for label, reuse in labels.items()}
    for setting in settings:
        temp, verify = protocol.SETTINGS[setting]
        # decode.py's engines: `--drafter runs/medc/medc-s0/drafter [--draft-reuse]` and
        # `--drafter none`, at this setting's temperature and rule
        engines = {label: sessions.engine(run_config("medc", temperature=temp, verify=verify,
                                                     draft_reuse=reuse)[1], prompts)
                   for label, reuse in labels.items()}
        ar = sessions.autoregressive(run_config("medc", temperature=temp, verify=verify)[1],
                                     prompts)
        compile_s = sum(e.compile() for e in engines.values()) + ar.compile()
        got = {label: {k: [] for k in ("new_tokens", "steps", "wall_s", "ar_new_tokens",
                                       "ar_wall_s", "accepted", "identical", "reused")}
               for label in labels}
        protocol.log(f"reuse {setting}: {len(prompts)} prompts, medc / medc+reuse / AR each")
        for i, (_, ids) in enumerate(prompts):
            key = jax.random.fold_in(base, i)
            outs = {label: eng.run([ids], new, key) for label, eng in engines.items()}
            a = ar.run([ids], new, key)
            for label, m in outs.items():
                g = got[label]
                g["new_tokens"].append(len(m.outputs[0]))
                g["steps"].append(int(m.steps[0]))
                g["accepted"].append([int(x) for x in m.accepted[0]])
                g["wall_s"].append(m.wall_s)
                g["ar_new_tokens"].append(len(a.outputs[0]))
                g["ar_wall_s"].append(a.wall_s)
                g["identical"].append(m.outputs[0] == a.outputs[0] if temp == 0 else None)
                g["reused"].append(None if m.reused is None else [int(x) for x in m.reused])
        for label in labels:
            got[label]["compile_s"] = compile_s
            got[label]["gamma"] = engines[label].gamma
            recs[label]["decode"][setting] = got[label]
    return recs


def reuse(settings=("t0", "t1_block")) -> None:
    for label, rec in reuse_decode(settings).items():
        write_json(protocol.result_path(label, SEED, RESULTS_DIR), rec)
        protocol.log(f"wrote {protocol.result_path(label, SEED, RESULTS_DIR)}")


TREE_SETTINGS = ((4, 32), (8, 64))  # (K, N)
TREE_PROMPTS = 16


def tree(settings=TREE_SETTINGS, n_prompts: int = TREE_PROMPTS, rounds: int = 7) -> dict:
    """medc's trees, shared chain against per-node forwards (module docstring). Engines
    built by hand: the per-node way is a drafter variant (`share_tree_chain=False`) that
    no decoding session exposes, and both ways must share everything else."""
    import dataclasses
    import time

    import jax
    import numpy as np

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.engine import Engine, Stats
    from specjax.decoding.loading import load_drafter
    from specjax.drafters.dynamic_tree import DynamicTree

    cfg, dtype, target, prompts, base = medc_setup(n_prompts)
    new = protocol.SIZES["new_tokens"]
    sampling = SamplingParams(0.0, 0, 1.0)
    loaded = load_drafter(cfg.export_dir, target, sampling=sampling, dtype=dtype,
                          matmul_dtype="auto", draft_vocab="auto")
    rec = {"measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "code": git_state(), "machine": machine(), "weights": "runs/medc/medc-s0",
           "prompts": len(prompts), "new_tokens": new, "gamma": loaded.gamma, "rows": []}
    for K, N in settings:
        common = dict(base, sampling=sampling, verify="token")
        ways = {"shared": loaded.drafter,
                "per_node": dataclasses.replace(loaded.drafter, share_tree_chain=False)}
        engines = {w: Engine(target.model, drafter=DynamicTree(d, K, N),
                             drafter_params=loaded.params, **common)
                   for w, d in ways.items()}
        engines["AR"] = Engine(target.model, **{**common, "verify": "block"})
        for e in engines.values():
            e.compile()
        protocol.log(f"tree K={K} N={N}: step timing, then {len(prompts)} prompts")
        ids0 = prompts[0][1]
        timing = {w: [] for w in ways}
        for _ in range(rounds):
            for w in ways:
                timing[w].append(engines[w].step_timing([ids0], new, jax.random.key(0)))
        stats = {w: Stats() for w in engines}
        same = True
        for i, (_, ids) in enumerate(prompts):
            key = jax.random.fold_in(jax.random.key(protocol.DECODE_SEED), i)
            outs = {w: e.run([ids], new, key) for w, e in engines.items()}
            for w, o in outs.items():
                stats[w].add(o)
            same &= outs["shared"].outputs == outs["per_node"].outputs == outs["AR"].outputs
        ar = stats["AR"].tokens_per_s
        rec["rows"].append({
            "topk": K, "nodes": N, "identical": bool(same), "ar_tokens_per_s": ar,
            **{w: {**{k: float(np.median([t[k] for t in timing[w]])) for k in timing[w][0]},
                   "tokens_per_s": stats[w].tokens_per_s,
                   "speedup": stats[w].tokens_per_s / ar, "tau": stats[w].tau}
               for w in ways}})
        del engines
        jax.clear_caches()
    return rec


def render_tree(rec: dict | None) -> str:
    """The markdown between the `medc:tree` markers."""
    if rec is None:
        return "Not measured yet: `python benchmarks/medc.py tree`.\n"
    lines = ["| K | N | tau | draft ms, per node | draft ms, shared | step ms, per node "
             "| step ms, shared | speedup, per node | speedup, shared | same output |",
             "|" + "---|" * 10]
    for r in rec["rows"]:
        a, b = r["per_node"], r["shared"]
        lines.append(f"| {r['topk']} | {r['nodes']} | {b['tau']:.2f} | {a['draft_ms']:.2f} | "
                     f"{b['draft_ms']:.2f} | {a['step_ms']:.2f} | {b['step_ms']:.2f} | "
                     f"{a['speedup']:.2f}x | {b['speedup']:.2f}x | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    m = rec["machine"]
    return (f"Measured on {m['cpu']} ({m['cores']} cores, {m['backend']}), code "
            f"{rec['code']['rev']}{' + uncommitted changes' if rec['code']['dirty'] else ''}"
            f", weights {rec['weights']} (not shipped); T = 0, token verification, batch 1, "
            f"G = {rec['gamma']}; draft and step ms: median of 7 `Engine.step_timing` calls "
            f"(the two ways alternating); speedup: {rec['prompts']} held-out prompts x "
            f"{rec['new_tokens']} new tokens, both ways and AR interleaved per prompt.\n\n"
            + "\n".join(lines) + "\n")


def render_reuse(results: dict) -> str:
    """The markdown between the `medc:reuse` markers."""
    seeds = (SEED,)
    a, b = "medc_noreuse", "medc_reuse"
    if (a, SEED) not in results or (b, SEED) not in results:
        return "Not measured yet: `python benchmarks/medc.py reuse`.\n"
    lines = ["| measure | medc | medc --draft-reuse | reuse - none |", "|---|---|---|---|"]
    for label, stat in (("in-loop tau, T = 0", "tau_t0"), ("speedup, T = 0", "speedup_t0"),
                        ("in-loop tau, T = 1 block", "tau_t1_block"),
                        ("speedup, T = 1 block", "speedup_t1_block")):
        lines.append(f"| {label} | {protocol.ci(protocol.interval(results, a, stat, seeds))} "
                     f"| {protocol.ci(protocol.interval(results, b, stat, seeds))} "
                     f"| {protocol.ci(protocol.paired(results, b, a, stat, seeds), '+.2f')} |")
    for setting, tag in (("t0", "T = 0"), ("t1_block", "T = 1 block")):
        d = results[b, SEED]["decode"].get(setting)
        if not d:
            continue
        tot = [sum(r[k] for r in d["reused"] if r) for k in range(4)]
        ms = [1e3 * sum(results[n, SEED]["decode"][setting]["wall_s"])
              / max(sum(results[n, SEED]["decode"][setting]["steps"]), 1) for n in (a, b)]
        lines.append(f"| ms per step in the loop, {tag} | {ms[0]:.2f} | {ms[1]:.2f} | |")
        lines.append(f"| drafted hidden states reused, {tag} | 0 | "
                     f"{tot[0]:,} of {tot[1]:,} ({tot[0] / max(tot[1], 1):.1%}) | |")
    same = [all(results[n, SEED]["decode"]["t0"]["identical"]) for n in (a, b)]
    lines.append(f"| T = 0 output identical to autoregressive | {same[0]} | {same[1]} | |")
    meta = results[b, SEED]
    return (f"Measured on {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
            f"{meta['machine']['backend']}), code {meta['code']['rev']}, weights "
            f"runs/medc/medc-s0 (not shipped); {len(meta['prompt_ids'])} held-out prompts x "
            f"{meta['sizes']['new_tokens']} new tokens, batch 1, G = "
            f"{meta['decode']['t0']['gamma']}. Per prompt: medc, medc with reuse, then one "
            "autoregressive run that both speedups divide by. 95% intervals: paired "
            "bootstrap over prompts.\n\n" + "\n".join(lines) + "\n")


def render(results: dict) -> str:
    """The markdown between the `medc:results` markers."""
    seeds = (SEED,)
    rows = [("simulated tau (held-out sequences)", "tau_sim"),
            ("in-loop tau, T = 0", "tau_t0"), ("in-loop tau, T = 1 block", "tau_t1_block"),
            ("speedup, T = 0", "speedup_t0"), ("speedup, T = 1 block", "speedup_t1_block")]
    lines = ["| measure | eagle3 | medc | medc - eagle3 |", "|---|---|---|---|"]
    for label, stat in rows:
        a = protocol.interval(results, "eagle3", stat, seeds)
        b = protocol.interval(results, "medc", stat, seeds)
        d = protocol.paired(results, "medc", "eagle3", stat, seeds)
        lines.append(f"| {label} | {protocol.ci(a)} | {protocol.ci(b)} "
                     f"| {protocol.ci(d, '+.2f')} |")
    for key, label in (("draft_ms", "draft ms per step (G = 7, T = 0, B = 1; median of "
                                    "alternating calls)"),
                       ("verify_ms", "verify ms per step")):
        cells = [fmt((results.get((n, SEED)) or {}).get("step_timing", {}).get(key))
                 for n in ("eagle3", "medc")]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | |")
    per = []
    for n in ("eagle3", "medc"):
        r = results.get((n, SEED))
        t = protocol.interval(results, n, "tau_t0", seeds)
        per.append(fmt(r["step_timing"]["draft_ms"] / t["estimate"], ".2f")
                   if r and "step_timing" in r and t else "-")
    lines.append(f"| draft ms per accepted token (draft ms / tau T = 0) | {per[0]} | {per[1]} "
                 "| |")
    params = [fmt((results.get((n, SEED)) or {}).get("train", {}).get("params"), ",")
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
    sub.add_parser("reuse", help="medc with and without --draft-reuse, interleaved")
    t = sub.add_parser("tree", help="medc's trees: one shared chain against per-node forwards")
    t.add_argument("--settings", nargs="+", default=[f"{k}:{n}" for k, n in TREE_SETTINGS],
                   metavar="K:N", help="tree top-K and nodes N (default: %(default)s)")
    t.add_argument("--prompts", type=int, default=TREE_PROMPTS)
    sub.add_parser("report", help="render the docs/medc.md sections")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    if args.cmd == "measure":
        from specjax.compile_cache import enable_compile_cache

        enable_compile_cache(None)
        measure(args.force)
        return 0
    if args.cmd == "reuse":
        from specjax.compile_cache import enable_compile_cache

        enable_compile_cache(None)
        reuse()
        return 0
    if args.cmd == "tree":
        from specjax.compile_cache import enable_compile_cache

        enable_compile_cache(None)
        try:
            settings = tuple(tuple(int(x) for x in kn.split(":")) for kn in args.settings)
            assert all(len(kn) == 2 for kn in settings)
        except (ValueError, AssertionError):
            ap.error(f"--settings {' '.join(args.settings)}: expected K:N pairs, e.g. 4:32")
        write_json(TREE_RESULTS, tree(settings, args.prompts))
        protocol.log(f"wrote {TREE_RESULTS}")
        return 0
    from benchmarks.lib.report import replace_doc_section

    results = protocol.load_results(RESULTS_DIR)
    replace_doc_section(DOC, "medc:results", render(results), "# medc\n\n")
    replace_doc_section(DOC, "medc:reuse", render_reuse(results), "# medc\n\n")
    tree_rec = json.load(open(TREE_RESULTS)) if os.path.isfile(TREE_RESULTS) else None
    replace_doc_section(DOC, "medc:tree", render_tree(tree_rec), "# medc\n\n")
    protocol.log(f"{len(results)} runs with results; wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
