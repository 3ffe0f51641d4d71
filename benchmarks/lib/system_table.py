"""Systems measured against autoregressive decoding, the machinery of benchmarks/trees.py
that benchmarks/block_drafting.py reuses: a `System` (a drafter as one chain, K drafts or a
dynamic tree) is a decoding session of decode.py's flags (`system_config`); `measure` runs
every (setting, batch, prompt set, system), one autoregressive engine interleaved with the
systems per (setting, batch, prompt set), and returns the results record; `merge` puts the
rows of a new record into an old one; `render` is a record's markdown table. trees.py's
system sets (`SYSTEMS`, `SWEEP`) live here too: `measure` and the row order refer to them.

Projection (labelled as such everywhere it is quoted): this CPU pays for every verified
node (DESIGN 9), an accelerator does not below its compute ridge. `project` turns a
measured tau and the nodes verified per step into a speedup for a Qwen3-8B-shaped target
(bf16 weights, an EAGLE-3 head of one decoder layer + fc + a 32K hot-vocabulary head) on
an H100 and a TPU v5e: each forward costs max(bytes read / bandwidth, FLOPs / peak) with
`benchmarks.lib.roofline`'s vendor figures; one step = the target's verify forward over N
nodes + the drafter's sequential forwards. It assumes the same efficiency for every forward
and ignores launch overheads and the verification rule itself.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from benchmarks.lib import sessions
from benchmarks.lib.prompts import VAL_NPY as VAL
from benchmarks.lib.prompts import held_out_prompts
from benchmarks.lib.provenance import ROOT, git_rev
from benchmarks.lib.roofline import BANDWIDTH, PEAK_FLOPS, QWEN3_8B

EAGLE3 = os.path.join(ROOT, "checkpoints", "demo", "drafters", "eagle3")
BLOCK = os.path.join(ROOT, "checkpoints", "demo", "drafters", "block")
TARGET = os.path.join(ROOT, "checkpoints", "demo", "target")

# Qwen3-8B-shaped target and an EAGLE-3 head for it (bf16 parameter counts).
TARGET_PARAMS = 8.2e9
DRAFT_PARAMS = (4096 * (4096 + 2 * 1024) + 4096 * 4096  # one layer's attention
                + 3 * 4096 * 12288  # its MLP
                + 3 * 4096 * 4096  # fc over the three captured hidden states
                + 32_000 * 4096)  # the hot-vocabulary head
# a block drafter of two decoder layers at that width reading the target's full LM head
BLOCK_PARAMS = 2 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288) \
    + QWEN3_8B["V"] * 4096
KV_BYTES_PER_TOKEN = 2 * QWEN3_8B["L"] * QWEN3_8B["K"] * QWEN3_8B["H"] * 2


@dataclasses.dataclass(frozen=True)
class System:
    """name; drafter: "eagle3" / "block" (the shipped heads), "ngram" / "logitspec", or a
    drafter directory; num_drafts K; tree: (topk, nodes) for a dynamic tree or None; rules
    it can verify at T > 0; gamma: the draft length G (None: the drafter's own); greedy:
    whether it runs at T = 0; kind: the drafter's kind for the projection's draft cost
    (None: `drafter`)."""

    name: str
    drafter: str
    num_drafts: int = 1
    tree: tuple[int, int] | None = None
    rules: tuple[str, ...] = ("token", "block")
    gamma: int | None = None
    greedy: bool = True
    kind: str | None = None


SYSTEMS = (
    System("eagle3 chain", "eagle3"),
    System("eagle3 K=2", "eagle3", num_drafts=2),
    System("eagle3 K=4", "eagle3", num_drafts=4),
    System("eagle3 tree 2x12", "eagle3", tree=(2, 12), rules=("token",)),
        System("eagle3 tree 4x32", "eagle3", tree=(4, 32), rules=("token",)),
    System("block chain", "block"),
    System("block tree 4x16", "block", tree=(4, 16), rules=("token",)),
    System("logitspec", "logitspec", rules=("token",)),
    System("ngram chain", "ngram"),
    System("ngram K=3", "ngram", num_drafts=3),
)

# `--sweep`: the shipped eagle3 head over EAGLE-2 tree shapes (top-k x node budget N) at
# T = 0, and over K independent drafts x draft length G with block verification at T = 1,
# each beside the chain (K = 1 at the head's G = 7).
TREE_SHAPES = ((2, 8), (2, 12), (2, 16), (2, 24), (4, 16), (4, 24), (4, 32), (4, 48),
               (4, 64), (8, 32), (8, 64))
DRAFT_SHAPES = tuple((k, g) for k in (1, 2, 3, 4) for g in (3, 5, 7))
SWEEP = (System("eagle3 chain", "eagle3", rules=("block",)),
         *(System(f"eagle3 tree {k}x{n}", "eagle3", tree=(k, n), rules=())
           for k, n in TREE_SHAPES),
         *(System(f"eagle3 K={k} G={g}", "eagle3", num_drafts=k, gamma=g, greedy=False,
                  rules=("block",)) for k, g in DRAFT_SHAPES if (k, g) != (1, 7)))


def step_seconds(params: float, rows: int, device: str, extra_bytes: float = 0.0) -> float:
    """One forward of a `params`-parameter bf16 model over `rows` tokens (all rows of the
    batch together): max(bytes / bandwidth, 2 * params * rows / peak) on `device`."""
    return max((2 * params + extra_bytes) / BANDWIDTH[device],
               2 * params * rows / PEAK_FLOPS[device])


def project(tau: float, nodes: int, draft_forwards: int, draft_rows: int, device: str,
            batch: int = 1, context: int = 1024, draft_params: float = DRAFT_PARAMS
            ) -> float:
    """Projected speedup over autoregressive decoding (a model, not a measurement).

    tau: tokens per step (measured); nodes: N tokens per row in the verify forward;
    draft_forwards: the drafter's sequential forwards per step (0: retrieval drafters);
    draft_rows: tokens per row in each of them (K for K drafts or a tree frontier of K);
    draft_params: the drafter's parameters (bf16) read by each of its forwards;
    batch: B rows; context: tokens of KV cache read per row by every target forward."""
    kv = KV_BYTES_PER_TOKEN * context * batch
    ar = step_seconds(TARGET_PARAMS, batch, device, kv)
    spec = step_seconds(TARGET_PARAMS, batch * nodes, device, kv)
    spec += draft_forwards * step_seconds(draft_params, batch * draft_rows, device)
    return tau * ar / spec


def _draft_cost(system: System, gamma: int) -> tuple[int, int, float]:
    """(the drafter's sequential forwards per step, tokens per row in each, its parameter
    count at Qwen3-8B width): G forwards of K rows for eagle3 (K drafts or a tree frontier
    of K), one forward of G + 1 rows for the block drafter (its tree comes from the same
    forward), none for the retrieval drafters."""
    kind = system.kind or system.drafter
    if kind in ("ngram", "logitspec"):
        return 0, 0, 0.0
    if kind == "block":
        return 1, gamma + 1, BLOCK_PARAMS
    return gamma, system.tree[0] if system.tree is not None else system.num_drafts, \
        DRAFT_PARAMS


def system_config(system: System, temperature: float, rule: str, batch: int,
                  new_tokens: int, dtype: str):
    """decode.py's options for a system (`--drafter`, `--gamma` or the drafter's own,
    `--num-drafts`, `--tree-topk/--tree-nodes`) at one setting."""
    spec = {"eagle3": EAGLE3, "block": BLOCK}.get(system.drafter, system.drafter)
    topk, nodes = system.tree or (None, None)
    return sessions.config(target=TARGET, drafter=spec, gamma=system.gamma or "fixed",
                           num_drafts=system.num_drafts, tree_topk=topk, tree_nodes=nodes,
                           temperature=temperature, verify="block" if rule == "greedy"
                           else rule, batch_size=batch, max_new_tokens=new_tokens,
                           dtype=dtype)


def _prompt_sets(n: int, session):
    bundled = session.read_prompts()[0][:n]
    return {"bundled": bundled, "held-out": held_out_prompts(VAL, n, 96)}


def measure(n_prompts: int, new_tokens: int, temps, batches, only=None,
            timing: bool = True, warmup: int = 2, dtype: str = "auto",
            systems=SYSTEMS) -> dict:
    """Runs every (setting, batch, prompt set, system); returns the results record.
    warmup: untimed passes of every engine over the first batch before any timed run (the
    first calls of a compiled loop are several times slower on this CPU); dtype: the
    target's (`load_target`: "auto" is float32 on CPU, bfloat16 on a GPU or TPU);
    systems: SYSTEMS or SWEEP (then the record says "sweep": True)."""
    import jax
    import numpy as np

    rev = git_rev(ROOT)  # the code measured
    ar0 = sessions.session(sessions.config(target=TARGET, drafter="none", dtype=dtype))
    sets = _prompt_sets(n_prompts, ar0)
    sweep = systems is SWEEP
    systems = [s for s in systems if not only or s.name in only]
    runs = []
    settings = [(0.0, "greedy")] * (0 in temps) + [(t, r) for t in temps if t > 0
                                                    for r in ("token", "block")]
    # one prompt width for both sets: one compiled program per (setting, batch, system)
    everything = [p for prompts in sets.values() for p in prompts]
    for temp, rule in settings:
        for B in batches:
            ar_cfg = sessions.ar_config(system_config(SYSTEMS[0], temp, rule, B, new_tokens,
                                                      dtype))
            ar = sessions.engine(ar_cfg, everything)
            ar.compile()
            chosen = [s for s in systems if (s.greedy if rule == "greedy" else rule in s.rules)]
            if not chosen:
                continue
            engines = {}
            for s in chosen:
                eng = sessions.engine(system_config(s, temp, rule, B, new_tokens, dtype),
                                      everything)
                t0 = time.perf_counter()
                eng.compile()
                engines[s.name] = (s, eng, eng.gamma, time.perf_counter() - t0)
            first = [ids for _, ids in next(iter(sets.values()))[:B]]
            systems_now = {"AR": ar, **{n: e[1] for n, e in engines.items()}}
            sessions.warm_up(systems_now, first, new_tokens, passes=warmup, key=1000)
            for set_name, prompts in sets.items():
                base = jax.random.key(0)
                starts = range(0, len(prompts), B)
                stats, outs = sessions.run_interleaved(
                    systems_now, [[ids for _, ids in prompts[i:i + B]] for i in starts],
                    new_tokens, [jax.random.fold_in(base, i) for i in starts])
                ar_tps = stats["AR"].tokens_per_s
                for name, (s, eng, G, compile_s) in engines.items():
                    st = stats[name]
                    nodes = eng.cfg.tree_nodes(G, eng.drafter)
                    forwards, rows, dp = _draft_cost(s, G)
                    rec = {"system": name, "temperature": temp, "verify": rule, "batch": B,
                           "prompts": set_name, "tau": st.tau, "alpha": st.alpha,
                           "tokens_per_s": st.tokens_per_s, "ar_tokens_per_s": ar_tps,
                           "speedup": st.tokens_per_s / ar_tps, "nodes": nodes,
                           "gamma": G, "num_drafts": s.num_drafts, "compile_s": compile_s,
                           "identical": outs[name] == outs["AR"] if temp == 0 else None,
                           "identical_prompts": sum(a == b for a, b in zip(
                               outs[name], outs["AR"], strict=True)) if temp == 0 else None,
                           "projected": {dev: project(st.tau, nodes, forwards, rows, dev, B,
                                                      draft_params=dp)
                                         for dev in ("H100", "TPU v5e")}}
                    if temp == 0 and B == 1 and set_name == "bundled" and timing:
                        rec.update(eng.step_timing([prompts[0][1]],
                                                   new_tokens, jax.random.key(0)))
                    runs.append(rec)
                    print(f"[trees] T={temp} {rule} B={B} {set_name} {name}: tau "
                          f"{st.tau:.3f} N={nodes} {st.tokens_per_s:.1f} tok/s "
                          f"{rec['speedup']:.2f}x (AR {ar_tps:.1f}) identical "
                          f"{rec['identical']}", file=sys.stderr, flush=True)
            del engines, systems_now
    import platform

    return {"runs": runs, "prompts": n_prompts, "new_tokens": new_tokens, "warmup": warmup,
            "git": rev, "date": time.strftime("%Y-%m-%d"), "machine": platform.processor()
            or platform.machine(), "cores": os.cpu_count(), "numpy": np.__version__,
            "jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "dtype": str(np.dtype(ar0.dtype)),
            "weights": sorted({os.path.relpath({"eagle3": EAGLE3, "block": BLOCK}.get(
                s.drafter, s.drafter), ROOT) for s in systems
                if s.drafter not in ("ngram", "logitspec")}), "sweep": sweep}


def _row_key(r: dict) -> tuple:
    return (r["temperature"], r["verify"], r["batch"], r["prompts"], r["system"])


def _row_order(r: dict) -> tuple:
    """T = 0 first, then token before block verification, batch sizes ascending, the
    bundled prompts before the held-out ones, systems in SYSTEMS' order."""
    names = list(dict.fromkeys(s.name for s in SYSTEMS + SWEEP))
    return (r["temperature"], r["verify"] != "token", r["batch"], r["prompts"] != "bundled",
            names.index(r["system"]) if r["system"] in names else len(names))


def merge(old: dict, new: dict) -> dict:
    """`old` with the rows of `new` put in (replacing rows of the same setting, batch,
    prompt set and system). The new rows carry their own git, date and warm-up; the
    record's header fields stay old's. Raises ValueError when the prompt counts differ."""
    if (old["prompts"], old["new_tokens"]) != (new["prompts"], new["new_tokens"]):
        raise ValueError(f"--merge: {new['prompts']} prompts x {new['new_tokens']} tokens "
                         f"against {old['prompts']} x {old['new_tokens']} in the file")
    fresh = {_row_key(r): dict(r, git=new["git"], date=new["date"],
                               warmup=new.get("warmup", 0)) for r in new["runs"]}
    runs = [fresh.pop(_row_key(r), r) for r in old["runs"]] + list(fresh.values())
    runs.sort(key=_row_order)
    return dict(old, runs=runs)


def measured_on_cpu(res: dict) -> bool:
    """Whether a results record was measured on the CPU (records before the device field
    were)."""
    return res.get("device", "cpu") == "cpu"


def render(res: dict) -> str:
    """The markdown table of a results record."""
    on_cpu = measured_on_cpu(res)
    where = f"this CPU ({res['cores']} cores" if on_cpu else \
        f"an {res['device']} (jax {res['jax']}, target {res.get('dtype', '?')}"
    head = ("| setting | B | prompts | system | N | tau | tok/s | speedup "
            f"({'CPU' if on_cpu else 'measured'}) | identical | draft / verify ms | "
            "projected H100 | projected v5e |")
    lines = [f"Measured on {where}, git {res['git']}, "
             f"{res['date']}; weights {', '.join(res['weights'])}; {res['prompts']} prompts "
             f"per set x "
             f"{res['new_tokens']} new tokens, EOS on"
             + (f", {res['warmup']} untimed warm-up passes of every engine over the first "
                "batch before timing" if res.get("warmup") else "")
             + "). The two right columns are a "
             "PROJECTION for a Qwen3-8B-shaped target (`benchmarks/lib/system_table.py`'s `project`), "
             "not a measurement. Draft / verify ms: one step's parts timed outside the loop "
             "(`decode.py --step-timing`), T=0, B=1, first bundled prompt."]
    later = sorted({(r["temperature"], r["verify"], r["batch"], r["git"], r["date"],
                     r.get("warmup", 0)) for r in res["runs"] if "git" in r
                    and (r["git"], r["date"], r.get("warmup", 0))
                    != (res["git"], res["date"], res.get("warmup", 0))})
    for t, v, b, git, date, w in later:
        lines.append(f"Rows T={t:g} {v} B={b}: measured later (`--merge`), git {git}, {date}, "
                     f"{w} warm-up passes.")
    lines += ["", head, "|" + "---|" * 12]
    for r in res["runs"]:
        setting = "T=0" if r["temperature"] == 0 else f"T={r['temperature']:g} {r['verify']}"
        ident = {True: "yes", False: "NO", None: "-"}[r["identical"]]
        if r["identical"] is False and r.get("identical_prompts") is not None:
            ident = f"NO ({r['identical_prompts']}/{res['prompts']})"
        ms = f"{r['draft_ms']:.1f} / {r['verify_ms']:.1f}" if "draft_ms" in r else "-"
        lines.append(f"| {setting} | {r['batch']} | {r['prompts']} | {r['system']} | "
                     f"{r['nodes']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {ident} | {ms} | {r['projected']['H100']:.2f}x | "
                     f"{r['projected']['TPU v5e']:.2f}x |")
    return "\n".join(lines) + "\n"
