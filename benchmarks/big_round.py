"""The 8B-size accelerator round (issue 54): a Qwen3-8B-shaped target with random bf16
weights made on the device (no download), measured the way decode.py runs it.

    python benchmarks/big_round.py --out DIR --budget SECONDS [--only STEPS]  # GPU / TPU
    python benchmarks/big_round.py --out DIR --dry-run                        # CPU, tiny

scripts/big_round.sh wraps it (what a device session runs: `--part 1`, `--part 2`, `--part
3`, one call each, as many as the session's device time allows). Each step writes DIR/big_round.json
as it ends (the long steps after every row) and is skipped when less of the budget is
left than its estimate (EST). The steps, in the order they run:

  ar       autoregressive decoding, greedy, 128-token prompts, 128 new tokens: tokens/s and
           ms per step at B = 1, 8, 32 with the attention kernel and at B = 1, 8 with the
           jnp attention it replaces (`--kernels off`), per layer loop, against the
           bandwidth roofline (weights + KV read once per step); the completions are the
           recording the oracle drafter proposes from (`spec`, `tree`).
  profile  a profiler trace of the B = 1 AR run, summarised on the device (the device's
           busy time against the wall span, and the 25 ops that took most time):
           DIR/profile_summary.json; the raw trace is not kept.
  spec     the compiled speculative loop with the test-only oracle drafter
           (specjax/testing/oracle.py: the recorded greedy continuation, each token kept
           with a chosen probability; drafting costs a gather) at G = 7 and tau 1, 2, 4, 6,
           B = 1 and 8: ms per step, tokens/s, speedup over AR, identical to AR. After
           the round, `projection` gives the speedup projected for published tau
           (EAGLE-3 6.23 on Llama-3.1-8B; DFlash 6.49 on Qwen3-8B), labelled as
           projections, with each head's cost from `heads` added.
  heads    random-weight drafter heads at Qwen3-8B width in the loop at G = 7: eagle3
           (one layer, a 32k draft vocabulary as SpecForge's) and a DFlash-sized block
           head (5 layers): ms per step minus the oracle's at tau 1 (the same verify
           forward; from `spec` when it ran) = the drafter's cost per step (propose +
           update) as the loop runs it.
  train    drafter training at 8B size on one device, eagle3 (TTT) and block objectives,
           bf16 target: tokens/s, peak device memory (over the process) against
           `specjax.plan.train_plan`'s prediction, and MFU = model FLOPs / (time x peak
           dense bf16 FLOP/s), model FLOPs = 2 x target matmul params x tokens (frozen
           forward) + 6 x drafter matmul params x drafted positions (attention left out).
  tree     the oracle's chain inside a draft tree of 16 and 64 nodes (B = 1) and 32
           (B = 8) at tau 4: the loop's ms per step by node count (what verifying N nodes
           costs in the loop).
  exact    the exact mode (--exact) at B = 1: AR and the oracle loop at tau 6 with and
           without it: its cost per step and bf16 identity with AR.
  update   `heads` at B = 1 with each head also run without its update: the drafter's
           cost per step split into propose and update.
  cmdbuf   the first AR row in fresh processes with XLA's GPU command buffers off
           (`--xla_gpu_enable_command_buffer=`) and extended to while loops and
           conditionals (the decode loop's body is one): launch overhead on and off.

Everything runs at `--kernels` "attention" (the attention kernels, unfused verification:
`--kernels auto` on GPU) unless a plan row says otherwise; plans are flags (--ar-plan ...).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

from benchmarks.lib import roofline  # noqa: E402
from benchmarks.lib.device import (  # noqa: E402
    Round,
    bandwidth,
    big_config,
    device_name,
    log,
    step_bandwidth,
    step_environment,
)
from specjax import cli  # noqa: E402

GAMMA = 7
TAUS = (1.0, 2.0, 4.0, 6.0)
# published tau (docs/design.md's reference numbers; for the projection only)
PUBLISHED = {"EAGLE-3, Llama-3.1-8B, T=0 (paper)": 6.23,
             "DFlash, Qwen3-8B, block 16 (paper)": 6.49}
# the attention kernel against the jnp path it replaces ("off"), in the loop, at B 1 and 8
AR_PLAN = "1:attention:auto,8:attention:auto,32:attention:auto,1:off:auto,8:off:auto"
DRY_AR_PLAN = "1:attention:auto,2:off:auto"
CMDBUF = {"none": "--xla_gpu_enable_command_buffer=",
          "with_while": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
                        "CUDNN,WHILE,CONDITIONAL"}
# rough seconds on an H100/H200 (compiles of the unrolled 36-layer loop included: about
# 40 s each); a step starts only when this much of the budget is left
EST = {"environment": 5, "bandwidth": 10, "ar": 230, "profile": 20, "spec": 110,
       "heads": 180, "train": 220, "tree": 140, "exact": 180, "cmdbuf": 150, "update": 200}
STEPS = tuple(EST)
# one call each (under the 10-minute per-call limit), in this order: a lent session (15
# device minutes, the machine's start included) runs part 1 and what is left of the next
PARTS = {"1": "environment,ar,profile,spec,heads", "2": "environment,train,exact,tree",
         "3": "environment,bandwidth,cmdbuf,update"}


class Ctx:
    """What the steps share: the random target (made once), the prompts, the AR
    recordings per batch size and the AR ms per step."""

    def __init__(self, dry_run: bool, rnd: Round, args):
        self.dry_run, self.rnd, self.args = dry_run, rnd, args
        self._target = None
        # the B = 1 AR engine `ar` compiled, kept for `profile` (only that one: every
        # unrolled Engine holds its own per-layer copy of the weights, 16 GB at 8B size)
        self.profile_engine = None
        self.tau1_ms: dict[int, float] = {}  # B -> the oracle's ms per step at tau 1
        self.record: dict[int, list] = {}
        self.ar_ms: dict[int, float] = {}  # B -> AR ms per step, tokens/s
        self.ar_tps: dict[int, float] = {}
        self.prompt, self.new = (16, 16) if dry_run else (128, 128)
        self.kernels = "off" if dry_run else "attention"  # dry run: no interpret mode
        self.repeats = 1 if dry_run else 3

    @property
    def target(self):
        if self._target is None:
            import jax
            import jax.numpy as jnp
            from flax import nnx

            from specjax.models.model import Transformer

            cfg = big_config(self.dry_run)
            t = time.time()
            self._target = Transformer(cfg, dtype=jnp.float32 if self.dry_run
                                       else jnp.bfloat16, rngs=nnx.Rngs(0))
            jax.block_until_ready(nnx.state(self._target))
            self.rnd.results["target"] = {
                "init_s": round(time.time() - t, 1), "layers": cfg.num_layers,
                "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                "param_bytes": self.param_bytes(self._target)}
        return self._target

    @staticmethod
    def param_bytes(model) -> int:
        import jax
        from flax import nnx

        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model))))

    def prompts(self, B: int) -> list[list[int]]:
        import numpy as np

        rng = np.random.default_rng(B)
        return [rng.integers(1, self.target.cfg.vocab_size, self.prompt).tolist()
                for _ in range(B)]

    def engine(self, B: int, kernels: str | None = None, layer_loop: str = "auto",
               drafter=None, params=None, exact: bool = False):
        """A greedy Engine over the target (exact: --exact's batch-invariant forwards)."""
        from specjax.core.sampling import SamplingParams
        from specjax.decoding.engine import Engine

        # Engines built by hand: random weights (no checkpoint directory to load) and a
        # layer-loop A/B (not a session option)
        return Engine(self.target, drafter=drafter, drafter_params=params,
                      sampling=SamplingParams(temperature=0.0),
                      max_length=self.prompt + self.new, prompt_width=self.prompt,
                      batch_size=B, kernels=kernels or self.kernels, layer_loop=layer_loop,
                      exact=exact)

    def timed(self, eng, B: int, row: dict, prefix: str = "") -> list:
        """Compiles, warms up, runs `repeats` times; fills row[prefix + ...] with the
        median's wall, steps, tokens/s, ms per step, tau; returns the outputs."""
        import jax
        import numpy as np

        row[prefix + "compile_s"] = round(eng.compile(), 1)
        prompts = self.prompts(B)
        eng.run(prompts, self.new, jax.random.key(0))  # warm
        runs = []
        for r in range(self.repeats):
            out = eng.run(prompts, self.new, jax.random.key(r + 1))
            runs.append((out.wall_s, out))
        wall, out = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
        steps = int(np.asarray(out.steps).max())
        acc = np.asarray(out.accepted)
        row[prefix + "wall_s"] = wall
        row[prefix + "steps"] = steps
        row[prefix + "tokens_per_s"] = B * self.new / wall
        row[prefix + "ms_per_step"] = 1e3 * wall / max(steps, 1)
        row[prefix + "tau"] = float(1 + acc.sum() / max(int(np.asarray(out.steps).sum()), 1))
        return out.outputs

    def recording(self, B: int) -> list:
        """AR greedy completions of prompts(B) (from `ar`, or made here)."""
        if B not in self.record:
            self.record[B] = self.timed(self.engine(B), B, row := {})
            self.ar_ms[B], self.ar_tps[B] = row["ms_per_step"], row["tokens_per_s"]
        return self.record[B]

    def save_rows(self, rec: dict, rows: list) -> None:
        rec["rows"] = rows
        self.rnd.save_partial(rec)


def _plan(text: str) -> list[list[str]]:
    return [p.split(":") for p in text.split(",") if p]


def _error(row: dict, e: Exception, what: str) -> None:
    row["error"] = f"{type(e).__name__}: {e}"[:1500]
    log(f"{what} FAILED: {row['error'][:300]}")


# ------------------------------------------------------------------------------ steps

def step_ar(rec: dict, ctx: Ctx) -> None:
    cfg = ctx.target.cfg
    nbytes = ctx.param_bytes(ctx.target)
    bw = bandwidth()
    rows = []
    for B, kernels, layer_loop in _plan(ctx.args.ar_plan):
        B = int(B)
        row = {"B": B, "kernels": kernels, "layer_loop": layer_loop}
        rows.append(row)
        try:
            eng = ctx.engine(B, kernels, layer_loop)
            out = ctx.timed(eng, B, row)
            if (B, kernels, layer_loop) == (1, ctx.kernels, "auto"):
                ctx.profile_engine = eng
            del eng
            if kernels == ctx.kernels and layer_loop == "auto" and B not in ctx.record:
                ctx.record[B] = out
                ctx.ar_ms[B], ctx.ar_tps[B] = row["ms_per_step"], row["tokens_per_s"]
            kv = 2 * cfg.num_layers * B * cfg.num_kv_heads * (ctx.prompt + ctx.new // 2) \
                * cfg.head_dim * (4 if ctx.dry_run else 2)
            if bw:
                row["roofline_ms_per_step"] = (nbytes + kv) / bw * 1e3
                row["roofline_fraction"] = row["roofline_ms_per_step"] / row["ms_per_step"]
        except Exception as e:  # one failing row does not lose the others
            _error(row, e, f"ar {row}")
        ctx.save_rows(rec, rows)
    rec["passed"] = not any("error" in r for r in rows)


def step_cmdbuf(rec: dict, ctx: Ctx) -> None:
    """The first AR row in a fresh process per XLA_FLAGS setting (flags are read once per
    process); on CPU (dry run) the processes run without the GPU flags."""
    import jax

    B, kernels, layer_loop = _plan(ctx.args.ar_plan)[0]
    rows = []
    for name, flag in CMDBUF.items():
        row = {"setting": name, "xla_flags": flag, "B": int(B), "kernels": kernels}
        rows.append(row)
        out = tempfile.mkdtemp()
        env = dict(os.environ)
        if jax.default_backend() == "gpu":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
        cmd = [sys.executable, os.path.abspath(__file__), "--out", out, "--only", "ar",
               "--ar-plan", f"{B}:{kernels}:{layer_loop}",
               "--budget", str(max(int(ctx.rnd.left() - 10), 1))]
        if ctx.dry_run:
            cmd.append("--dry-run")
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=max(ctx.rnd.left() - 5, 1))
            with open(os.path.join(out, "big_round.json")) as f:
                got = json.load(f)["steps"].get("ar", {})
            sub = (got.get("rows") or [{}])[0]
            row.update({k: v for k, v in sub.items() if k not in row})
            if p.returncode != 0 and "error" not in row:
                row["error"] = p.stderr[-1500:]
        except Exception as e:
            _error(row, e, f"cmdbuf {name}")
        finally:
            shutil.rmtree(out, ignore_errors=True)
        ctx.save_rows(rec, rows)
    rec["passed"] = not any("error" in r for r in rows)


def summarize_trace(trace_dir: str, top: int = 25) -> dict:
    """Per device plane of the profile under trace_dir: the wall span of its events, the
    time its streams were busy (union of event intervals), and the `top` event names by
    total time (count, ms). Uses jax.profiler.ProfileData (no TensorBoard)."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise RuntimeError(f"no .xplane.pb under {trace_dir}")
    pd = ProfileData.from_file(files[0])
    out = {}
    for plane in pd.planes:
        if not (plane.name.startswith("/device:") or plane.name == "/host:CPU"):
            continue
        spans, totals = [], {}
        for line in plane.lines:
            for e in line.events:
                if e.duration_ns <= 0:
                    continue
                spans.append((e.start_ns, e.start_ns + e.duration_ns))
                t = totals.setdefault(e.name, [0, 0.0])
                t[0] += 1
                t[1] += e.duration_ns / 1e6
        if not spans:
            continue
        spans.sort()
        busy, (cur_s, cur_e) = 0.0, spans[0]
        for s, e in spans[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        span = spans[-1][1] - spans[0][0]
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
        out[plane.name] = {"span_ms": span / 1e6, "busy_ms": busy / 1e6,
                           "busy_fraction": busy / span if span else None,
                           "events": len(spans),
                           "top": [{"name": n[:160], "count": c, "ms": round(ms, 3)}
                                   for n, (c, ms) in ranked]}
    return out


def step_profile(rec: dict, ctx: Ctx) -> None:
    import jax

    B = 1
    eng = ctx.profile_engine or ctx.engine(B)
    eng.compile()
    prompts = ctx.prompts(B)
    eng.run(prompts, ctx.new, jax.random.key(0))
    tmp = tempfile.mkdtemp()
    try:
        jax.profiler.start_trace(tmp)
        out = eng.run(prompts, ctx.new, jax.random.key(1))
        jax.profiler.stop_trace()
        rec["wall_s"] = out.wall_s
        rec["steps"] = int(max(out.steps))
        summary = summarize_trace(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    path = os.path.join(ctx.rnd.out, "profile_summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    rec["planes"] = {k: {kk: v[kk] for kk in ("span_ms", "busy_ms", "busy_fraction",
                                               "events")} for k, v in summary.items()}
    rec["passed"] = bool(summary)


def step_spec(rec: dict, ctx: Ctx) -> None:

    from specjax.testing.oracle import (
        OracleDrafter,
        acceptance_for_tau,
        expected_tau,
        with_acceptance,
    )

    V = ctx.target.cfg.vocab_size
    rows = []
    for B in [int(b) for b in ctx.args.spec_batches.split(",")]:
        try:
            ar = ctx.recording(B)
            d, p = OracleDrafter.create(ctx.prompts(B), ar, gamma=GAMMA, acceptance=0.0,
                                        vocab_size=V)
            eng = ctx.engine(B, drafter=d, params=p)
            for tau in TAUS:
                a = acceptance_for_tau(tau, GAMMA)
                row = {"B": B, "target_tau": tau, "acceptance": a,
                       "expected_tau": expected_tau(a, GAMMA), "ar_ms_per_step": ctx.ar_ms[B]}
                rows.append(row)
                eng.drafter_params = with_acceptance(p, a)
                out = ctx.timed(eng, B, row)
                row["identical_to_ar"] = out == ar
                row["speedup"] = row["tokens_per_s"] / ctx.ar_tps[B]
                row["step_over_ar"] = row["ms_per_step"] / ctx.ar_ms[B]
                if tau == 1.0:
                    ctx.tau1_ms[B] = row["ms_per_step"]
                ctx.save_rows(rec, rows)
        except Exception as e:
            rows.append(row := {"B": B})
            _error(row, e, f"spec B={B}")
            ctx.save_rows(rec, rows)
    rec["gamma"] = GAMMA
    rec["passed"] = not any("error" in r for r in rows)


def projection(results: dict) -> list[dict]:
    """Speedups projected for the published tau (PUBLISHED), per batch size: the spec
    step's ms per step as a straight line in the measured tau (the oracle drafts for
    free), plus each drafter head's measured cost per step (`heads`, same B) where there
    is one. Projections, not measurements: they assume the head reaches that tau and the
    ms per step stays linear in tau."""
    import numpy as np

    steps = results["steps"]
    spec = [r for r in (steps.get("spec") or {}).get("rows", []) if "ms_per_step" in r]
    heads = {(r["B"], r["kind"]): r["drafter_ms_per_step"]
             for r in (steps.get("heads") or {}).get("rows", []) if "drafter_ms_per_step" in r}
    out = []
    for B in sorted({r["B"] for r in spec}):
        pts = [(r["tau"], r["ms_per_step"]) for r in spec if r["B"] == B]
        ar = [r["ar_ms_per_step"] for r in spec if r["B"] == B][0]
        if len({t for t, _ in pts}) < 2:
            continue
        slope, icept = np.polyfit(*zip(*pts, strict=True), 1)
        for label, tau in PUBLISHED.items():
            step = icept + slope * tau
            row = {"B": B, "published": label, "tau": tau, "step_ms": step,
                   "speedup_free_drafter": tau * ar / step}
            for (b, kind), ms in heads.items():
                if b == B:
                    row[f"speedup_with_{kind}_head"] = tau * ar / (step + ms)
            out.append(row)
    return out


def step_exact(rec: dict, ctx: Ctx) -> None:
    """The exact mode (--exact) at 8B size, B = 1: AR and the oracle loop at tau 6, each
    with and without it (jnp attention, "off" kernels, so the two differ only in the
    mode): ms per step, the mode's cost, and whether greedy speculative output equals
    AR output in bf16 with it (it must) and without it."""
    from specjax.testing.oracle import OracleDrafter, acceptance_for_tau

    V, B = ctx.target.cfg.vocab_size, 1
    rows = []
    for exact in (False, True):
        row = {"B": B, "exact": exact, "kernels": "off"}
        rows.append(row)
        try:
            ar = ctx.timed(ctx.engine(B, "off", exact=exact), B, row, prefix="ar_")
            d, p = OracleDrafter.create(ctx.prompts(B), ar, gamma=GAMMA,
                                        acceptance=acceptance_for_tau(6.0, GAMMA),
                                        vocab_size=V)
            out = ctx.timed(ctx.engine(B, "off", drafter=d, params=p, exact=exact), B, row,
                            prefix="spec_")
            row["identical_to_ar"] = out == ar
            row["speedup"] = row["spec_tokens_per_s"] / row["ar_tokens_per_s"]
        except Exception as e:
            _error(row, e, f"exact {row}")
        ctx.save_rows(rec, rows)
    if all("ar_ms_per_step" in r for r in rows):
        rec["exact_ar_cost"] = rows[1]["ar_ms_per_step"] / rows[0]["ar_ms_per_step"]
        rec["exact_spec_cost"] = rows[1]["spec_ms_per_step"] / rows[0]["spec_ms_per_step"]
    rec["passed"] = (not any("error" in r for r in rows)
                     and rows[-1].get("identical_to_ar") is True)


def step_tree(rec: dict, ctx: Ctx) -> None:
    from specjax.testing.oracle import OracleTreeDrafter, acceptance_for_tau

    V = ctx.target.cfg.vocab_size
    a = acceptance_for_tau(4.0, GAMMA)
    rows = []
    for B, nodes in _plan(ctx.args.tree_plan):
        B, nodes = int(B), int(nodes)
        row = {"B": B, "nodes": nodes, "acceptance": a}
        rows.append(row)
        try:
            ar = ctx.recording(B)
            d, p = OracleTreeDrafter.create(ctx.prompts(B), ar, gamma=GAMMA, acceptance=a,
                                            vocab_size=V, tree_nodes=nodes)
            out = ctx.timed(ctx.engine(B, drafter=d, params=p), B, row)
            row["identical_to_ar"] = out == ar
            row["ar_ms_per_step"] = ctx.ar_ms[B]
            row["step_over_ar"] = row["ms_per_step"] / ctx.ar_ms[B]
            row["speedup"] = row["tokens_per_s"] / ctx.ar_tps[B]
        except Exception as e:
            _error(row, e, f"tree {row}")
        ctx.save_rows(rec, rows)
    rec["passed"] = not any("error" in r for r in rows)


def _head(kind: str, ctx: Ctx):
    """(drafter, params, description): a random-weight head at the target's width."""
    import jax.numpy as jnp
    from flax import nnx

    from specjax.core.sampling import SamplingParams
    from specjax.drafters import DrafterConfig, build_network, make_drafter

    cfg = ctx.target.cfg
    dt = jnp.float32 if ctx.dry_run else jnp.bfloat16
    greedy = SamplingParams(temperature=0.0)
    if kind == "eagle3":
        dcfg = DrafterConfig.for_target(cfg, "eagle3", gamma=GAMMA)
        vocab = tuple(range(min(32000, cfg.vocab_size // 2)))  # SpecForge's 32k draft vocab
    else:
        dcfg = DrafterConfig.for_target(cfg, "block", gamma=GAMMA,
                                        num_layers=1 if ctx.dry_run else 5,
                                        mask_token_id=cfg.vocab_size - 1)
        vocab = None
    net = build_network(dcfg, dtype=dt, rngs=nnx.Rngs(1))
    d, p = make_drafter(dcfg, net, ctx.target, gamma=GAMMA, sampling=greedy,
                        draft_vocab=vocab)
    desc = {"kind": kind, "layers": dcfg.num_layers, "draft_vocab": len(vocab) if vocab
            else cfg.vocab_size, "param_bytes": ctx.param_bytes(net)}
    return d, p, desc


def without_update(drafter):
    """The drafter with its `update` replaced by one that keeps the state as it is (a
    subclass with the same fields, so the loop's kernel choice still reaches it): the
    loop's ms per step with it, against the drafter's own, is what the update costs.
    For timing only: its drafts then come from a state that never learns the verdicts."""
    import dataclasses

    cls = type(drafter)
    sub = dataclasses.dataclass(frozen=True)(
        type(f"NoUpdate{cls.__name__}", (cls,),
             {"update": lambda self, params, state, view, num_accepted: state}))
    return sub(**{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)
                  if f.init})


def step_heads(rec: dict, ctx: Ctx, plan: str | None = None) -> None:
    from specjax.testing.oracle import OracleDrafter

    V = ctx.target.cfg.vocab_size
    rows = []
    base = ctx.tau1_ms  # from `spec` when it ran
    for B, kind in _plan(plan or ctx.args.heads_plan):
        B = int(B)
        row = {"B": B, "kind": kind}
        rows.append(row)
        try:
            ar = ctx.recording(B)
            if B not in base:  # the oracle at tau 1: the same verify forward, no drafting
                d, p = OracleDrafter.create(ctx.prompts(B), ar, gamma=GAMMA, acceptance=0.0,
                                            vocab_size=V)
                ctx.timed(ctx.engine(B, drafter=d, params=p), B, b := {})
                base[B] = b["ms_per_step"]
            d, p, desc = _head(kind.removesuffix("-noupdate"), ctx)
            if kind.endswith("-noupdate"):
                d = without_update(d)
            row.update(desc, kind=kind)
            out = ctx.timed(ctx.engine(B, drafter=d, params=p), B, row)
            row["identical_to_ar"] = out == ar
            row["oracle_tau1_ms_per_step"] = base[B]
            row["drafter_ms_per_step"] = row["ms_per_step"] - base[B]
            row["drafter_over_ar_step"] = row["drafter_ms_per_step"] / ctx.ar_ms[B]
        except Exception as e:
            _error(row, e, f"heads {row}")
        ctx.save_rows(rec, rows)
    rec["passed"] = not any("error" in r for r in rows)


def step_update(rec: dict, ctx: Ctx) -> None:
    """`heads` at B = 1 with each head also run without its update (`without_update`):
    the drafter's ms per step split into propose and update, as the loop runs them."""
    step_heads(rec, ctx, ctx.args.update_plan)
    rows = {r["kind"]: r for r in rec.get("rows", []) if "drafter_ms_per_step" in r}
    for kind in ("eagle3", "block"):
        if kind in rows and f"{kind}-noupdate" in rows:
            full, no = rows[kind], rows[f"{kind}-noupdate"]
            full["update_ms_per_step"] = full["ms_per_step"] - no["ms_per_step"]
            full["propose_ms_per_step"] = no["drafter_ms_per_step"]


def _train_one(objective: str, ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import plan as plan_lib
    from specjax.mesh import make_mesh
    from specjax.train.config import load_config
    from specjax.train.drafter_step import DrafterTrainer
    from specjax.train.optim import make_optimizer

    dry = ctx.dry_run
    B, T = (2, 64) if dry else (4, 1024)
    name = "eagle3_gpu" if objective == "ttt" else "block_gpu"
    sets = [f"train.batch_size={B}", f"data.seq_len={T}", "train.grad_accum=1",
            f"train.dtype={'float32' if dry else 'bfloat16'}",
            f"train.kernels={'reference' if dry else 'pallas'}", "train.init_from=null"]
    if objective == "ttt":
        sets.append(f"drafter.ttt_positions={16 if dry else 256}")
    else:
        sets += [f"drafter.num_layers={1 if dry else 5}", "drafter.capture=null"]
    cfg = load_config(os.path.join(ROOT, "configs", "drafters", name + ".yaml"), sets)
    target = ctx.target
    dtype = jnp.float32 if dry else jnp.bfloat16
    mesh = make_mesh(cfg.mesh)
    tx, schedule = make_optimizer(cfg.optim, 100)
    dcfg = cfg.drafter.for_target(target.cfg)
    loop = cfg.train
    trainer = DrafterTrainer(dcfg, target, cfg.objective, cfg.drafter, dtype, tx, schedule,
                             mesh, seed=0, grad_accum=1, micro_batch=loop.micro_batch,
                             eval_batch=B, seq_len=T, kernels=loop.kernels)
    row = {"objective": objective, "batch": B, "seq_len": T, "drafter_layers":
           dcfg.num_layers, "drafter_params": trainer.num_params, "kernels": loop.kernels}
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(1, target.cfg.vocab_size, (1, B, T + 1)), jnp.int32)
    t = time.time()
    state, m = trainer.train_step(state, batch)
    jax.block_until_ready(m)
    row["compile_s"] = round(time.time() - t, 1)
    times = []
    for _ in range(2 if dry else 5):
        t = time.perf_counter()
        state, m = trainer.train_step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    sec = sorted(times)[len(times) // 2]
    row["s_per_step"] = sec
    row["tokens_per_s"] = B * T / sec
    row["loss"] = float(m.loss)
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_bytes"] = stats.get("peak_bytes_in_use")
    pl = plan_lib.train_plan(target.cfg, mesh, B, T, dcfg=dcfg, objective=objective,
                             ttt_positions=cfg.drafter.ttt_positions,
                             num_anchors=cfg.drafter.num_anchors, dtype=np.dtype(dtype))
    row["plan_bytes"] = int(sum(pl.values()))
    row["plan"] = {k: int(v) for k, v in pl.items()}
    # model FLOPs: the frozen target's forward over every token, the drafter's forward
    # and backward over its drafted positions (matmul parameters; attention left out)
    tc = target.cfg
    # the embedding lookup is no matmul (a tied embedding is the LM head's matmul)
    target_mm = tc.num_params - (0 if tc.tie_word_embeddings else tc.vocab_size * tc.hidden_size)
    drafter_mm = trainer.num_params + tc.vocab_size * tc.hidden_size  # + the LM head
    if objective == "ttt":
        positions = B * min(cfg.drafter.ttt_positions or T, T) * dcfg.gamma
    else:
        positions = B * cfg.drafter.num_anchors * (dcfg.gamma + 1)
    flops = 2 * target_mm * B * T + 6 * drafter_mm * positions
    row["model_flops_per_step"] = float(flops)
    peak = roofline.PEAK_FLOPS.get(device_name())
    if peak:
        row["mfu"] = flops / sec / peak
    del state, trainer
    return row


def step_train(rec: dict, ctx: Ctx) -> None:
    rows = []
    for objective in ctx.args.train_objectives.split(","):
        try:
            rows.append(_train_one(objective, ctx))
        except Exception as e:
            rows.append(row := {"objective": objective})
            _error(row, e, f"train {objective}")
        ctx.save_rows(rec, rows)
    rec["passed"] = not any("error" in r for r in rows)


# ------------------------------------------------------------------------------- main

def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results folder (big_round.json)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the round")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: tiny shapes, the jnp paths (what CI runs)")
    ap.add_argument("--only", default="", help="comma-separated step names (default: all)")
    ap.add_argument("--part", choices=sorted(PARTS), default=None,
                    help="a preset --only: " + "; ".join(f"{k}: {v}" for k, v in PARTS.items()))
    ap.add_argument("--ar-plan", default=None,
                    help=f"ar rows B:kernels:layer_loop, comma-separated (default {AR_PLAN})")
    ap.add_argument("--spec-batches", default=None, help="spec: batch sizes (default 1,8)")
    ap.add_argument("--tree-plan", default=None,
                    help="tree rows B:nodes (default 1:16,1:64,8:32)")
    ap.add_argument("--heads-plan", default=None,
                    help="heads rows B:kind, kind eagle3 or block, KIND-noupdate without its "
                         "update (default 1:eagle3,1:block,8:eagle3,8:block)")
    ap.add_argument("--train-objectives", default="ttt,block", help="train: objectives")
    ap.add_argument("--update-plan", default="1:eagle3,1:eagle3-noupdate,1:block,"
                    "1:block-noupdate", help="update: heads rows (see --heads-plan)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.only and args.part:
        ap.error("--only and --part: give one")
    only = [s for s in (PARTS[args.part] if args.part else args.only).split(",") if s]
    for s in only:
        if s not in STEPS:
            ap.error(f"--only: unknown step {s!r}; steps: {', '.join(STEPS)}")
    if args.budget <= 0:
        ap.error(f"--budget={args.budget} must be > 0")
    d = args.dry_run
    args.ar_plan = args.ar_plan or (DRY_AR_PLAN if d else AR_PLAN)
    args.spec_batches = args.spec_batches or ("1" if d else "1,8")
    args.tree_plan = args.tree_plan or ("1:12" if d else "1:16,1:64,8:32")
    args.heads_plan = args.heads_plan or ("1:eagle3,1:block" if d else
                                          "1:eagle3,1:block,8:eagle3,8:block")
    heads = ("eagle3", "block", "eagle3-noupdate", "block-noupdate")
    for flag, text, n in (("--ar-plan", args.ar_plan, 3), ("--tree-plan", args.tree_plan, 2),
                          ("--heads-plan", args.heads_plan, 2),
                          ("--update-plan", args.update_plan, 2)):
        for row in _plan(text):
            if (len(row) != n or not row[0].isdigit()
                    or (flag in ("--heads-plan", "--update-plan") and row[1] not in heads)):
                ap.error(f"{flag}: bad row {':'.join(row)!r}")
    rnd = Round(args.out, args.budget, d, name="big_round")
    ctx = Ctx(d, rnd, args)
    fns = {"environment": step_environment, "bandwidth": lambda r: step_bandwidth(r, d),
           **{name: functools.partial(globals()[f"step_{name}"], ctx=ctx)
              for name in STEPS if name not in ("environment", "bandwidth")}}
    rnd.run({name: fns[name] for name in STEPS}, EST, only)
    rnd.results["projection"] = projection(rnd.results)
    return rnd.finish()


if __name__ == "__main__":
    sys.exit(main())
