"""One device round: every Pallas kernel compiled for this device and checked against its
jnp reference, timed against the jnp path with bytes moved and roofline fraction, then
decode.py with and without the kernels on the demo, then a Qwen3-8B-shaped target with
random bf16 weights (autoregressive tokens/s against the bandwidth roofline, and the
speculative loop's cost per step beyond its forwards, the target drafting for itself).

    python benchmarks/device_round.py --out DIR --budget SECONDS   # on a GPU / TPU
    python benchmarks/device_round.py --out DIR --dry-run          # CPU: interpret mode,
                                                                   # tiny shapes (CI runs it)

scripts/device_round.sh wraps it (and is what a device session runs). Every step writes
its records into DIR/device_round.json as soon as it ends (a step that raises is recorded
with its error and the round goes on; a step that would not fit the budget is recorded as
skipped), so a round cut off by its time limit still returns what it measured.

Checks. Verification (greedy, token, block; probabilities and one-hot drafts): the Pallas
verdict equals the jnp reference's for the same key (same tile functions, same order).
Attention (decode_attention causal, block and tree (a binary draft tree's ancestor mask),
one pass and split-S, a layer-major cache; packed_attention forward and backward): the
largest error relative to the largest magnitude of the reference run at matmul precision
"highest", at most 5e-3 for float32 (TF32 dots on GPU tensor cores carry 10 mantissa
bits) and 3e-2 for bfloat16.
Timings: median of --repeats calls after one compile call, wall clock with
block_until_ready; roofline fraction = (bytes the call must move / the device's vendor
bandwidth) / measured time (benchmarks/lib/roofline.py counts the bytes).
"""

from __future__ import annotations

import argparse
import json
import os
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
    bench,
    big_config,
    device_name,
    log,
    rel_err,
    roofline_fraction,
    step_bandwidth,
    step_environment,
)
from specjax import cli  # noqa: E402

TOL = {"float32": 5e-3, "bfloat16": 3e-2}
DEMO_TARGET = os.path.join(ROOT, "checkpoints", "demo", "target")


# ---------------------------------------------------------------------------- helpers

def gpu_backend() -> str:
    import jax

    return "triton" if jax.default_backend() == "gpu" else "tpu"


def shapes(dry_run: bool) -> dict:
    """name -> (V, N, K, H): the demo target's and Qwen3-8B's (dry run: demo only, and a
    reduced "qwen3-8b-heads" with V cut to 4096)."""
    from specjax.models.config import ModelConfig

    c = ModelConfig.from_dir(DEMO_TARGET)
    demo = (c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim)
    q = roofline.QWEN3_8B
    if dry_run:
        return {"demo": demo, "qwen3-8b-heads": (4096, q["N"], q["K"], q["H"])}
    return {"demo": demo, "qwen3-8b": (q["V"], q["N"], q["K"], q["H"])}


# ------------------------------------------------------------------------------ steps

def step_verify_check(rec: dict, dry_run: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.verify import verify_logits

    cases = []
    B, G = (2, 4) if dry_run else (8, 8)
    for sname, (V, *_rest) in shapes(dry_run).items():
        for dt in ("float32", "bfloat16"):
            k1, k2, k3, k4 = jax.random.split(jax.random.key(len(cases)), 4)
            tl = (jax.random.normal(k1, (B, G + 1, V), jnp.float32) * 3).astype(dt)
            q = jax.nn.softmax(jax.random.normal(k2, (B, G, V), jnp.float32) * 3, axis=-1)
            # drafts from the target's own argmax for half the positions: some acceptance
            x = jnp.where(jax.random.bernoulli(k3, 0.5, (B, G)),
                          jnp.argmax(tl[:, :G].astype(jnp.float32), -1),
                          jax.random.randint(k4, (B, G), 0, V))
            for rule in ("greedy", "token", "block"):
                for draft in (("onehot",) if rule == "greedy" else ("probs", "onehot")):
                    kw = dict(rule=rule, temperature=0.0 if rule == "greedy" else 1.0,
                              draft_probs=q if draft == "probs" else None, backend=gpu_backend())
                    got = {}
                    for impl in ("pallas", "reference"):
                        f = jax.jit(lambda tl, x, key, impl=impl, kw=kw: verify_logits(
                            tl, x, key, impl=impl, **kw))
                        outs = [f(tl, x, jax.random.key(s)) for s in range(4)]
                        got[impl] = [np.asarray(o.num_accepted).tolist() + np.asarray(
                            o.next_token).tolist() for o in outs]
                    ok = got["pallas"] == got["reference"]
                    cases.append({"shape": sname, "V": V, "B": B, "G": G, "dtype": dt,
                                  "rule": rule, "draft": draft, "identical": ok})
                    if not ok:
                        cases[-1]["pallas"], cases[-1]["reference"] = got["pallas"], got["reference"]
    rec["cases"] = cases
    rec["passed"] = all(c["identical"] for c in cases)


def _attention_inputs(B, T, N, K, H, S, dt, seed=0, layers=None):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(seed), 5)
    cshape = (B, K, S, H) if layers is None else (layers, B, K, S, H)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dt)
    kc = jax.random.normal(ks[1], cshape, jnp.float32).astype(dt)
    vc = jax.random.normal(ks[2], cshape, jnp.float32).astype(dt)
    kn = jax.random.normal(ks[3], (B, T, K, H), jnp.float32).astype(dt)
    vn = jax.random.normal(ks[4], (B, T, K, H), jnp.float32).astype(dt)
    return q, kc, vc, kn, vn


def _binary_tree_mask(B, T):
    """bool[B, T, T]: the ancestor mask (diagonal included) of the draft tree where node
    i > 0 has parent (i - 1) // 2, for decode_attention(mode="tree")."""
    import numpy as np

    mask = np.eye(T, dtype=bool)
    for i in range(1, T):
        mask[i] |= mask[(i - 1) // 2]
    return np.broadcast_to(mask, (B, T, T))


def step_attention_check(rec: dict, dry_run: bool) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import decode_attention

    cases = []
    B, T, S = (2, 4, 256) if dry_run else (4, 8, 4096)
    for sname, (_V, N, K, H) in shapes(dry_run).items():
        for dt in ("float32", "bfloat16"):
            for mode in ("causal", "block", "tree"):
                for splits, layered in ((1, False), (4, False), (1, True)):
                    q, kc, vc, kn, vn = _attention_inputs(B, T, N, K, H, S, dt,
                                                          layers=3 if layered else None)
                    lengths = jnp.asarray([S // 3 + 5 * b for b in range(B)], jnp.int32)
                    lengths = lengths.at[0].set(0)  # an empty row
                    layer = 1 if layered else None
                    kw = dict(mode=mode, layer=layer, num_splits=splits)
                    if mode == "tree":
                        kw["tree_mask"] = jnp.asarray(_binary_tree_mask(B, T))
                    got = jax.jit(lambda *a, kw=kw: decode_attention(
                        *a, impl="pallas", backend=gpu_backend(), **kw))(q, kc, vc, lengths, kn, vn)
                    with jax.default_matmul_precision("highest"):
                        ref = jax.jit(lambda *a, kw=kw: decode_attention(
                            *a, impl="reference", **kw))(q, kc, vc, lengths, kn, vn)
                    err = rel_err(got, ref)
                    cases.append({"shape": sname, "N": N, "K": K, "H": H, "B": B, "T": T,
                                  "S": S, "dtype": dt, "mode": mode, "num_splits": splits,
                                  "layer_major": layered, "rel_err": err,
                                  "passed": err <= TOL[dt]})
    rec["cases"] = cases
    rec["tolerance"] = TOL
    rec["passed"] = all(c["passed"] for c in cases)


def step_packed_check(rec: dict, dry_run: bool) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import packed_attention

    cases = []
    B, T = (1, 256) if dry_run else (2, 1024)
    for sname, (_V, N, K, H) in shapes(dry_run).items():
        for dt in ("float32", "bfloat16"):
            ks = jax.random.split(jax.random.key(1), 5)
            q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dt)
            k = jax.random.normal(ks[1], (B, K, T, H), jnp.float32).astype(dt)
            v = jax.random.normal(ks[2], (B, K, T, H), jnp.float32).astype(dt)
            go = jax.random.normal(ks[3], (B, T, N, H), jnp.float32).astype(dt)
            causal = jnp.arange(1, T + 1, dtype=jnp.int32)
            # row 0 causal, row 1 (if any) causal inside two packed documents
            limit = jnp.stack([causal, jnp.where(causal > T // 2, causal, jnp.minimum(
                causal, T // 2))][:B])

            def fwd_bwd(q, k, v, impl, limit=limit, go=go):
                def f(q, k, v):
                    o, lse = packed_attention(q, k, v, limit, impl=impl, backend=gpu_backend())
                    return o, lse
                (o, lse), vjp = jax.vjp(f, q, k, v)
                return (o, lse, *vjp((go, jnp.zeros_like(lse))))

            got = jax.jit(lambda q, k, v: fwd_bwd(q, k, v, "pallas"))(q, k, v)
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(lambda q, k, v: fwd_bwd(q, k, v, "reference"))(q, k, v)
            errs = {n: rel_err(a, b) for n, a, b in zip(("o", "lse", "dq", "dk", "dv"), got,
                                                          ref, strict=True)}
            cases.append({"shape": sname, "N": N, "K": K, "H": H, "B": B, "T": T,
                          "dtype": dt, "rel_err": errs,
                          "passed": all(e <= TOL[dt] for e in errs.values())})
    rec["cases"] = cases
    rec["passed"] = all(c["passed"] for c in cases)


def step_verify_time(rec: dict, dry_run: bool) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.verify import verify_logits
    from specjax.decoding.verify import VERIFIERS

    V = 4096 if dry_run else roofline.QWEN3_8B["V"]
    rows = []
    for B in ((1, 2) if dry_run else (1, 8, 64)):
        G = 4 if dry_run else 8
        k1, k2, k3 = jax.random.split(jax.random.key(B), 3)
        tl = jax.random.normal(k1, (B, G + 1, V), jnp.float32) * 3
        q = jax.nn.softmax(jax.random.normal(k2, (B, G, V), jnp.float32) * 3, axis=-1)
        x = jax.random.randint(k3, (B, G), 0, V)
        for rule in ("greedy", "token", "block"):
            temp = 0.0 if rule == "greedy" else 1.0

            def off(tl, x, q, key, rule=rule, temp=temp):
                p = (jax.nn.one_hot(jnp.argmax(tl, -1), V) if rule == "greedy"
                     else jax.nn.softmax(tl / temp, axis=-1))
                return VERIFIERS[rule](x, q, p, key)

            fns = {"off": jax.jit(off)}
            for impl in ("reference", "pallas"):
                fns[impl] = jax.jit(lambda tl, x, q, key, impl=impl, rule=rule, temp=temp:
                                    verify_logits(tl, x, key, rule=rule, temperature=temp,
                                                  draft_probs=q, impl=impl,
                                                  backend=gpu_backend()))
            row = {"B": B, "G": G, "V": V, "rule": rule}
            for name, f in fns.items():
                row[f"{name}_ms"] = bench(f, tl, x, q, jax.random.key(0),
                                          repeats=2 if dry_run else 20)
            nbytes = roofline.verify_bytes(B, G, V, rule, fused=True)
            row["pallas_bytes"] = nbytes
            row["off_bytes"] = roofline.verify_bytes(B, G, V, rule, fused=False)
            row["speedup_vs_off"] = row["off_ms"] / row["pallas_ms"]
            row["pallas_roofline_fraction"] = roofline_fraction(nbytes, row["pallas_ms"])
            rows.append(row)
    rec["rows"] = rows


def step_attention_time(rec: dict, dry_run: bool) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import decode_attention, pick_block_s, pick_num_splits

    q8 = roofline.QWEN3_8B
    N, K, H = q8["N"], q8["K"], q8["H"]
    S = 1024 if dry_run else 32768
    be = gpu_backend()
    rows = []
    for B in ((1,) if dry_run else (1, 8)):
        for T in ((1, 4) if dry_run else (1, 8, 16)):
            q, kc, vc, kn, vn = _attention_inputs(B, T, N, K, H, S, "bfloat16")
            bs = pick_block_s(S, backend=be)
            # the split counts of the tpu rule (the triton default before 2026-11-26) and
            # of this backend's rule
            splits = sorted({pick_num_splits(B, K, S, bs, "tpu"),
                             pick_num_splits(B, K, S, bs, be)})
            for L in ((256, 1024) if dry_run else (1024, 8192, 32768)):
                lengths = jnp.full((B,), L - T, jnp.int32)
                row = {"B": B, "T": T, "context": L, "S": S, "block_s": bs,
                       "default_num_splits": pick_num_splits(B, K, S, bs, be)}
                f = jax.jit(lambda *a: decode_attention(*a, impl="reference"))
                row["reference_ms"] = bench(f, q, kc, vc, lengths, kn, vn,
                                            repeats=2 if dry_run else 20)
                for P in splits:
                    f = jax.jit(lambda *a, P=P: decode_attention(
                        *a, impl="pallas", backend=be, num_splits=P))
                    row[f"pallas_p{P}_ms"] = bench(f, q, kc, vc, lengths, kn, vn,
                                                   repeats=2 if dry_run else 20)
                row["pallas_ms"] = row[f"pallas_p{row['default_num_splits']}_ms"]
                nbytes = roofline.attention_bytes(B, T, L, S, N, K, H, fused=True)
                row["pallas_bytes"] = nbytes
                row["speedup_vs_reference"] = row["reference_ms"] / row["pallas_ms"]
                row["pallas_roofline_fraction"] = roofline_fraction(nbytes, row["pallas_ms"])
                rows.append(row)
    rec["rows"] = rows


def step_packed_time(rec: dict, dry_run: bool) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import packed_attention
    from specjax.drafters.attend import attend

    q8 = roofline.QWEN3_8B
    N, K, H = q8["N"], q8["K"], q8["H"]
    rows = []
    for T in ((256,) if dry_run else (2048, 4096)):
        B = 1
        ks = jax.random.split(jax.random.key(T), 3)
        q = jax.random.normal(ks[0], (B, T, N, H), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, K, T, H), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, K, T, H), jnp.bfloat16)
        limit = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T))
        mask = jnp.arange(T)[None, None, :] < limit[:, :, None]

        def packed_loss(impl, limit=limit):
            def loss(q_, k_, v_):
                o, _ = packed_attention(q_, k_, v_, limit, impl=impl, backend=gpu_backend())
                return jnp.sum(o.astype(jnp.float32))
            return loss

        losses = {"jnp": lambda q, k, v, mask=mask: jnp.sum(
                      attend(q, [(k, v, mask)]).astype(jnp.float32)),
                  "pallas": packed_loss("pallas")}
        row = {"B": B, "T": T, "N": N, "K": K, "H": H, "dtype": "bfloat16"}
        for name, f in losses.items():
            row[f"{name}_fwd_ms"] = bench(jax.jit(f), q, k, v, repeats=2 if dry_run else 10)
            row[f"{name}_fwd_bwd_ms"] = bench(jax.jit(jax.grad(f, argnums=(0, 1, 2))), q, k, v,
                                              repeats=2 if dry_run else 10)
        lim = roofline.packed_limits("causal", T, T)
        nb = roofline.packed_train_bytes(lim, N, K, T, H)
        fl = roofline.packed_train_flops(lim, N, K, T, H)
        row["pallas_bytes"], row["pallas_flops"] = list(nb), list(fl)
        dev = device_name()
        if dev in roofline.BANDWIDTH:
            row["roofline_ms"] = roofline.roofline_ms(nb, fl, dev)
            row["pallas_roofline_fraction"] = row["roofline_ms"] / row["pallas_fwd_bwd_ms"]
        row["speedup_fwd_bwd_vs_jnp"] = row["jnp_fwd_bwd_ms"] / row["pallas_fwd_bwd_ms"]
        rows.append(row)
    rec["rows"] = rows


def step_decode_demo(rec: dict, dry_run: bool) -> None:
    """decode.py on the demo with --kernels pallas, attention (the GPU's auto: attention
    kernels, verification unfused) and off: same completions, and each one's tokens/s."""
    from specjax.decoding.loading import DEMO_PROMPTS

    n = 4 if dry_run else 16
    tmp = tempfile.mkdtemp()
    pfile = os.path.join(tmp, "prompts.jsonl")
    with open(DEMO_PROMPTS, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()][:n]
    with open(pfile, "w", encoding="utf-8") as f:
        f.writelines(lines)
    runs = {}
    for kernels in ("pallas", "attention", "off"):
        summ, outp = os.path.join(tmp, f"{kernels}.json"), os.path.join(tmp, f"{kernels}.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "decode.py"), "--prompts", pfile,
               "--kernels", kernels, "--summary", summ, "--output", outp, "--show", "0",
               "--max-new-tokens", "32" if dry_run else "128"]
        if kernels != "pallas":
            cmd.append("--no-compare-ar")
        t = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        runs[kernels] = {"rc": p.returncode, "wall_s": round(time.time() - t, 1),
                         "stderr_tail": p.stderr[-1500:]}
        if p.returncode == 0:
            with open(summ) as f:
                runs[kernels]["summary"] = json.load(f)
            with open(outp) as f:
                runs[kernels]["completions"] = [json.loads(line) for line in f]
    rec["runs"] = {k: {kk: vv for kk, vv in v.items() if kk != "completions"}
                   for k, v in runs.items()}
    if all(r["rc"] == 0 for r in runs.values()):
        key = "completion_ids" if "completion_ids" in runs["off"]["completions"][0] else "completion"
        off = [c.get(key) for c in runs["off"]["completions"]]
        rec["identical"] = all([c.get(key) for c in runs[k]["completions"]] == off
                               for k in runs)
        rec["compared_field"] = key


BIG_PLAN = "1:reference:scan,8:reference:scan,1:pallas:scan,8:pallas:scan"


def step_big_target(rec: dict, dry_run: bool, plan_spec: str = BIG_PLAN) -> None:
    """A Qwen3-8B-shaped target with random bf16 weights made on the device: AR tokens/s
    (batch 1 and 8) against the roofline (weights + KV read once per step), and the
    speculative loop with the target drafting for itself (greedy, every draft accepted):
    its ms per step against (G + 1) autoregressive steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.engine import Engine
    from specjax.drafters.draft_lm import DraftLMDrafter
    from specjax.models.model import Transformer

    cfg = big_config(dry_run)
    dt = jnp.float32 if dry_run else jnp.bfloat16
    t = time.time()
    target = Transformer(cfg, dtype=dt, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(target))
    rec["init_s"] = round(time.time() - t, 1)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(target)))
    rec["param_bytes"] = int(nbytes)
    rec["config"] = {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size}
    Tp, new = (16, 16) if dry_run else (128, 128)
    G = 4
    greedy = SamplingParams(temperature=0.0)
    bw = bandwidth()
    rng = np.random.default_rng(0)
    rows = []
    plan = [p.split(":") for p in plan_spec.split(",") if p]
    for B, kernels, layer_loop, *what in plan:
        B = int(B)
        prompts = [rng.integers(1, cfg.vocab_size, Tp).tolist() for _ in range(B)]
        row = {"B": B, "kernels": kernels, "layer_loop": layer_loop, "prompt": Tp,
               "new_tokens": new}
        rows.append(row)
        rec["rows"] = rows
        try:
            modes = (("ar", False),) if what == ["ar"] else (("ar", False), ("self_draft", True))
            completions = {}
            for name, self_draft in modes:
                # Engines built by hand: a kernel and layer-loop A/B on random weights of a
                # Qwen3-8B shape (layer_loop is no session option, and there is no
                # checkpoint directory to load)
                kw = dict(sampling=greedy, max_length=Tp + new, prompt_width=Tp,
                          batch_size=B, kernels=kernels, layer_loop=layer_loop)
                if self_draft:
                    d, p = DraftLMDrafter.create(target, G, greedy, cfg.vocab_size,
                                                 layer_loop=layer_loop)
                    kw.update(drafter=d, drafter_params=p)
                eng = Engine(target, **kw)
                row[f"{name}_compile_s"] = round(eng.compile(), 1)
                eng.run(prompts, new, jax.random.key(0))  # warm
                walls, steps = [], 1
                for r in range(1 if dry_run else 3):
                    out = eng.run(prompts, new, jax.random.key(r))
                    walls.append(out.wall_s)
                    steps = int(np.asarray(out.steps).max())
                    completions[name] = out.outputs
                wall = sorted(walls)[len(walls) // 2]
                row[f"{name}_wall_s"] = wall
                row[f"{name}_steps"] = steps
                row[f"{name}_tokens_per_s"] = B * new / wall
                row[f"{name}_ms_per_step"] = 1e3 * wall / max(steps, 1)
                del eng
            if len(modes) == 2:
                row["self_draft_identical_to_ar"] = (completions["ar"]
                                                     == completions["self_draft"])
                row["self_draft_overhead_ms_per_step"] = (row["self_draft_ms_per_step"]
                                                          - (G + 1) * row["ar_ms_per_step"])
            kv = 2 * cfg.num_layers * B * cfg.num_kv_heads * (Tp + new // 2) * cfg.head_dim * 2
            if bw:
                row["ar_roofline_ms_per_step"] = (nbytes + kv) / bw * 1e3
                row["ar_roofline_fraction"] = (row["ar_roofline_ms_per_step"]
                                               / row["ar_ms_per_step"])
        except Exception as e:  # one failing row does not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
            log(f"big_target B={B} {kernels} FAILED: {row['error'][:300]}")
    rec["gamma"] = G
    rec["passed"] = not any("error" in r for r in rows)


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results folder (device_round.json)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the round")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: Pallas interpret mode, tiny shapes (what CI runs)")
    ap.add_argument("--only", default="", help="comma-separated step names (default: all)")
    ap.add_argument("--big-plan", default=BIG_PLAN,
                    help="big_target rows: comma-separated B:kernels:layer_loop[:ar] "
                         "(ar: no self-drafting run)")
    return ap


STEPS = ("environment", "bandwidth", "verify_check", "attention_check", "packed_check",
         "verify_time", "attention_time", "packed_time", "decode_demo", "big_target")
# rough seconds on an H100 (compiles included): a step starts only when this much is left
EST = {"environment": 5, "bandwidth": 10, "verify_check": 60, "attention_check": 60,
       "packed_check": 40, "verify_time": 60, "attention_time": 60, "packed_time": 40,
       "decode_demo": 90, "big_target": 120}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ap = build_parser()
    only = [s for s in args.only.split(",") if s]
    for s in only:
        if s not in STEPS:
            ap.error(f"--only: unknown step {s!r}; steps: {', '.join(STEPS)}")
    if args.budget <= 0:
        ap.error(f"--budget={args.budget} must be > 0")
    rnd = Round(args.out, args.budget, args.dry_run)
    d = args.dry_run
    fns = {"environment": step_environment,
           "bandwidth": lambda r: step_bandwidth(r, d),
           "verify_check": lambda r: step_verify_check(r, d),
           "attention_check": lambda r: step_attention_check(r, d),
           "packed_check": lambda r: step_packed_check(r, d),
           "verify_time": lambda r: step_verify_time(r, d),
           "attention_time": lambda r: step_attention_time(r, d),
           "packed_time": lambda r: step_packed_time(r, d),
           "decode_demo": lambda r: step_decode_demo(r, d),
           "big_target": lambda r: step_big_target(r, d, args.big_plan)}
    rnd.run({name: fns[name] for name in STEPS}, EST, only)
    return rnd.finish()


if __name__ == "__main__":
    sys.exit(main())
