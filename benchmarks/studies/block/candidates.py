"""Issue 52, hypothesis (a) for the block drafter at temperature 1: with DFlash2's path
selector, q_k is zero outside position k's top-K candidates (and, at decode time, outside
the hot draft vocabulary), so the acceptance of position k is at most the target's
probability mass on those candidates. Is that cap what holds T = 1 acceptance down?

Teacher-forced on the regenerated validation stream (the target's own greedy text,
benchmarks/data/study2/val.npy), per draft position k, averaged over anchors:

  hot_mass   sum of p over the hot vocabulary (draft_vocab.json)
  cand_mass  sum of p over the K candidates (top-K of the block's logits over the hot ids)
  overlap    sum_x min(p(x), q(x)): q the selector's distribution over its candidates with
             each predecessor the target's greedy token, p the target's softmax at T = 1:
             the probability that token-level verification accepts position k given the
             drafts before it were accepted (the chain the loop drafts when it goes well)

    python benchmarks/studies/block/candidates.py [--drafter DIR] [--rows 64]

Writes benchmarks/results/studies/block/candidates.json (docs/studies/block.md reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

OUT = os.path.join(ROOT, "benchmarks", "results", "studies", "block", "candidates.json")
VAL = os.path.join(ROOT, "benchmarks", "data", "study2", "val.npy")
DRAFTER = os.path.join(ROOT, "checkpoints", "demo", "drafters", "block")


def measure(drafter_dir: str, n_rows: int, seq_len: int, anchors: int, batch: int,
            seed: int, top_k: int | None = None, full_vocab: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import specjax
    from specjax.drafters import build_network, selector
    from specjax.drafters.io import load_drafter
    from specjax.train.objectives.base import Frozen
    from specjax.train.objectives.block import sample_anchors

    target = specjax.load_target(os.path.join(ROOT, "checkpoints", "demo", "target")).model
    dcfg, params, _ = load_drafter(drafter_dir)
    net = build_network(dcfg, rngs=nnx.Rngs(0))
    nnx.update(net, params)
    if not dcfg.selector_rank:
        raise SystemExit(f"{drafter_dir}: no path selector (selector_rank 0)")
    K, G = top_k or dcfg.selector_top_k, dcfg.gamma
    vocab_file = os.path.join(drafter_dir, "draft_vocab.json")
    V = target.cfg.vocab_size
    hot = np.zeros(V, bool)
    if os.path.isfile(vocab_file) and not full_vocab:
        hot[json.load(open(vocab_file))["ids"]] = True
    else:
        hot[:] = True
    hot = jnp.asarray(hot)
    frozen = Frozen.from_target(target)
    gdef, tparams = nnx.split(target)
    ndef, nparams = nnx.split(net)

    @jax.jit
    def stats(tparams, nparams, rows, key):
        tgt_model, dnet = nnx.merge(gdef, tparams), nnx.merge(ndef, nparams)
        B, T = rows.shape[0], rows.shape[1] - 1
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        tgt = tgt_model(rows[:, :T], pos, None, capture=dcfg.capture,
                        capture_kv=dcfg.kv_layers)
        anc = sample_anchors(key, B, T, G, anchors)
        ctx = dnet.contexts(tgt.hidden, tgt.kv, pos, frozen.inv_freq)
        out = dnet.blocks(ctx, anc, rows[:, :T], frozen.embed, frozen.inv_freq, G,
                          None)[:, :, dnet.layout(G)[1]:]
        logits = dnet.logits(out, frozen.head).astype(jnp.float32)  # [B,A,G,V]
        logits = jnp.where(hot, logits, -jnp.inf)  # decode drafts over the hot ids only
        at = anc[:, :, None] + jnp.arange(G, dtype=jnp.int32)
        tl = jnp.take_along_axis(tgt.logits, at.reshape(B, -1)[:, :, None], axis=1)
        p = jax.nn.softmax(tl.reshape(*at.shape, -1).astype(jnp.float32), -1)
        best = jnp.argmax(p, axis=-1).astype(jnp.int32)
        first = jnp.take_along_axis(rows, anc, axis=1)
        q_c, cand = selector.candidate_probs(*dnet.selector(), K, dnet.final_hidden(out),
                                             logits, first, best)
        p_c = jnp.take_along_axis(p, cand, axis=-1)
        return {"hot_mass": jnp.sum(jnp.where(hot, p, 0.0), -1).sum((0, 1)),
                "cand_mass": p_c.sum(-1).sum((0, 1)),
                "overlap": jnp.minimum(p_c, q_c).sum(-1).sum((0, 1)),
                "count": jnp.asarray(B * anc.shape[1], jnp.float32)}

    val = np.load(VAL).astype(np.int32)
    starts = np.arange(n_rows) * (seq_len + 1)
    starts = starts[starts + seq_len + 1 <= len(val)]
    total = None
    t0 = time.perf_counter()
    for i in range(0, len(starts), batch):
        rows = np.stack([val[s:s + seq_len + 1] for s in starts[i:i + batch]])
        s = jax.device_get(stats(tparams, nparams, jnp.asarray(rows),
                                 jax.random.fold_in(jax.random.PRNGKey(seed), i)))
        total = s if total is None else {k: total[k] + s[k] for k in s}
    n = float(total["count"])
    res = {k: [round(float(x) / n, 4) for x in total[k]]
           for k in ("hot_mass", "cand_mass", "overlap")}
    return {"drafter": os.path.relpath(drafter_dir, ROOT), "rows": len(starts),
            "seq_len": seq_len, "anchors_per_row": anchors, "chains": int(n),
            "top_k": K, "hot_vocab": int(np.asarray(hot).sum()), **res,
            "seconds": round(time.perf_counter() - t0, 1),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=DRAFTER)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=None,
                    help="the selector's candidates per position (default: the drafter's)")
    ap.add_argument("--full-vocab", action="store_true",
                    help="draft over every id, not the hot vocabulary (--draft-vocab full)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    res = measure(a.drafter, a.rows, a.seq_len, a.anchors, a.batch, a.seed, a.top_k,
                  a.full_vocab)
    from benchmarks.lib.report import write_json

    write_json(a.out, res)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
