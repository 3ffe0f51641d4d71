"""Probes of KVShot's two bottlenecks for KV-reusing drafters (docs/kvshot.md).

1. Queries: does a KV-only drafter ask the target's memory what the target itself asks?
   For drafter layer i, whose merged memory starts as target layer j = kv_layers[
   merge_sources()[i]], the cosine between the drafter's query at TTT step 0 (token t+1
   at position t+1, after q_norm and RoPE) and the target's own query at layer j for the
   same position, per head, averaged over held-out positions and heads. RoPE rotates both
   by the same angle, so the cosine compares what the queries look for. Calibration: the
   same cosine for the drafter at its random init, and between the target's own queries
   at two of the reused layers.
2. Gradients: the norm of the loss gradient reaching the drafter's own K/V projections
   (k_proj, v_proj) and its merge maps (merge_k, merge_v), as a fraction of the whole
   gradient's norm, for the same KV drafter trained with ttt (kv2) and block-wise
   (block_kv), at the random init and at the trained weights. Fractions, because the two
   objectives' losses have different scales.

Both run eagerly on CPU on `rows` held-out sequences of the study's validation split.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def load_run(name: str):
    """(cfg, DrafterRun) of study run `name` (target and data loaded, no state)."""
    from specjax.train import load_config

    return run_of_config(load_config(os.path.join(ROOT, "configs", "study", f"{name}.yaml")))


def run_of_config(cfg):
    """(cfg, DrafterRun) of any drafter run's validated TrainConfig `cfg` (target and data
    loaded, f32, no state): what `load_run` does for a configs/study/ run, for a config
    loaded elsewhere (the redone study's runs/study2/NAME-sSEED, a test's tiny run)."""
    from specjax.train import mesh as mesh_lib
    from specjax.train.drafter_run import DrafterRun
    from specjax.train.optim import make_optimizer

    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    return cfg, DrafterRun(cfg, mesh, tx, schedule, jnp.float32)


def params_of(cfg, run, trained: bool):
    """The run's exported (trained) drafter weights, or its random init."""
    if trained:
        return run.trainer.load_init_params(cfg.export_dir, cfg.target_dir)[0]
    return run.trainer.init_state().params


def held_out_rows(run, rows: int) -> np.ndarray:
    """i32[rows, T+1] from the start of the validation split (the first eval batch)."""
    out, _ = run.data.val.batch(0, rows)
    return np.asarray(out, np.int32)


def _target(run):
    tr = run.trainer
    return nnx.merge(tr.target_graphdef, tr.target_params, tr.target_rest)


def target_queries(target, tokens, layers) -> dict[int, jax.Array]:
    """The target's own queries [B,T,N,H] (q_norm and RoPE applied) at `layers`, from a
    cache-free forward capturing those layers' inputs (the same arithmetic as
    specjax.models.model's attention)."""
    from specjax.models.layers import apply_rope, rms_norm, rope_cos_sin
    from specjax.models.matmul import linear

    c = target.cfg
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = target(tokens, positions, None, capture=tuple(layers))
    w = target.layer_weights()
    cos, sin = rope_cos_sin(target.inv_freq[...], positions, jnp.float32)
    qs = {}
    for i, j in enumerate(layers):
        h = rms_norm(out.hidden[i], w["input_norm"][j], c.rms_norm_eps)
        q = linear(h, w["q_proj"][j]).reshape(B, T, c.num_heads, c.head_dim)
        if c.family == "qwen3":
            q = rms_norm(q, w["q_norm"][j], c.rms_norm_eps)
        qs[j] = apply_rope(q, cos, sin)
    return qs


def drafter_queries(run, params, rows) -> list[jax.Array]:
    """Queries [B,T,N,H] of each KV-only drafter layer at TTT step 0 (anchor t: token t+1
    at position t+1), recorded from the training objective's own forward."""
    from specjax.drafters import kv as kv_lib
    from specjax.train.objectives import Frozen
    from specjax.train.objectives.ttt import draft_outputs

    tr = run.trainer
    target = _target(run)
    tokens = jnp.asarray(rows[:, :-1])
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    tgt = target(tokens, positions, None, capture=tr.dcfg.capture,
                 capture_kv=tr.dcfg.kv_layers)
    seen = []
    attend = kv_lib.attend  # the name KVOnly.ttt calls

    def recording(q, *a, **k):
        seen.append(q)
        return attend(q, *a, **k)

    kv_lib.attend = recording
    try:
        draft_outputs(tr.network(params), tgt, jnp.asarray(rows), Frozen.from_target(target),
                      steps=1)
    finally:
        kv_lib.attend = attend
    return seen[: tr.dcfg.num_layers]


def _cos(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30
    return float((num / den).mean())


def query_cosines(name: str, rows: int = 4) -> dict:
    """{"layers": [{"layer", "target_layer", "trained", "init"}], "target_between":
    cosine of the target's own queries at two reused layers} for KV run `name`."""
    return {"run": name, **query_cosines_of(*load_run(name), rows)}


def query_cosines_of(cfg, run, rows: int = 4) -> dict:
    """`query_cosines` of a loaded KV-only (TTT) run (`run_of_config`), without "run"."""
    dcfg = run.trainer.dcfg
    data = held_out_rows(run, rows)
    tokens = jnp.asarray(data[:, :-1])
    layers = list(dcfg.kv_layers)
    tq = target_queries(_target(run), tokens, layers)
    got = {}
    for trained in (True, False):
        qs = drafter_queries(run, params_of(cfg, run, trained), data)
        got[trained] = qs
    out = []
    for i, src in enumerate(dcfg.merge_sources()):
        j = layers[src]
        ref = tq[j][:, 1:]  # the target's query at position t+1
        per_layer = {jj: _cos(got[True][i][:, :-1], tq[jj][:, 1:]) for jj in layers}
        best = max(per_layer, key=per_layer.get)
        out.append({"layer": i, "target_layer": j,
                    "trained": _cos(got[True][i][:, :-1], ref),
                    "init": _cos(got[False][i][:, :-1], ref),
                    "best_target_layer": best, "best": per_layer[best]})
    between = _cos(tq[layers[0]], tq[layers[-1]])
    return {"layers": out, "target_between": between,
            "target_between_layers": [layers[0], layers[-1]]}


KV_PARTS = ("k_proj", "v_proj", "merge_k", "merge_v")


def grad_fractions(name: str, rows: int = 8) -> dict:
    """{"init": {...}, "trained": {...}}: per KV_PARTS and q_proj, the gradient norm and
    its fraction of the whole gradient's norm, on `rows` held-out sequences."""
    return {"run": name, **grad_fractions_of(*load_run(name), rows)}


def grad_fractions_of(cfg, run, rows: int = 8, trained_params=None) -> dict:
    """`grad_fractions` of a loaded run (`run_of_config`), without "run"; trained_params:
    the trained weights (default: the run's export, `params_of`)."""
    tr = run.trainer
    batch = jnp.asarray(held_out_rows(run, rows))
    key = jax.random.PRNGKey(0)
    grad = jax.jit(jax.grad(tr.loss))
    out = {}
    for trained in (False, True):
        params = params_of(cfg, run, trained) if trained_params is None or not trained \
            else trained_params
        g = grad(params, batch, tr.target_params, key)
        flat = {".".join(map(str, p)): np.asarray(v.get_value(), np.float64)
                for p, v in nnx.to_flat_state(g)}
        total = float(np.sqrt(sum((x ** 2).sum() for x in flat.values())))
        parts = {}
        for part in (*KV_PARTS, "q_proj"):
            norm = float(np.sqrt((flat[part] ** 2).sum())) if part in flat else float("nan")
            parts[part] = {"norm": norm, "fraction": norm / total if total else float("nan")}
        out["trained" if trained else "init"] = {"total": total, "parts": parts}
    return {"objective": cfg.objective, **out}


def evaluate_export(name: str) -> dict:
    """The validation record of run `name`'s exported drafter, recomputed with today's
    code: {"val_loss", "alpha", "acc", "tau", "gate"?} over the run's fixed held-out
    batches (the same ones training validated on)."""
    cfg, run = load_run(name)
    state = run.trainer.init_state(params_of(cfg, run, trained=True))
    return run.validate(state)


def evaluate_init(name: str) -> dict:
    """The validation record of run `name` at step 0: its random init, or for a run with
    train.init_from, those weights with the rest random (as the run started)."""
    cfg, run = load_run(name)
    tr = run.trainer
    if cfg.train.init_from:
        params = tr.load_init_params(cfg.train.init_from, cfg.target_dir)[0]
        state = tr.init_state(params)
    else:
        state = tr.init_state()
    return run.validate(state)


def block_queries(run, params, rows, gamma: int | None = None) -> list[jax.Array]:
    """Queries [B,A,G+1,N,H] of each layer of a block drafter (context kv), one block
    anchored at every position a = 1 .. T-G-1 (A = T-G-1 anchors: block positions up to
    T-1, where the target has queries too), recorded from the block
    objective's own forward (`BlockNet.contexts` and `BlockNet.blocks`, as `block_loss`
    runs them). Block position j holds position a+j (j = 0: the anchor's own token,
    j >= 1: mask tokens), so its query compares with the target's query at a+j."""
    from specjax.drafters import block as block_lib
    from specjax.train.objectives import Frozen

    tr = run.trainer
    target = _target(run)
    net = tr.network(params)
    G = gamma or tr.dcfg.gamma
    tokens = jnp.asarray(rows[:, :-1])
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    tgt = target(tokens, positions, None, capture=tr.dcfg.capture,
                 capture_kv=tr.dcfg.kv_layers)
    frozen = Frozen.from_target(target)
    anchors = jnp.broadcast_to(jnp.arange(1, T - G, dtype=jnp.int32), (B, T - G - 1))
    seen = []
    attend = block_lib.attend  # the name BlockNet.run_block calls

    def recording(q, *a, **k):
        seen.append(q)
        return attend(q, *a, **k)

    block_lib.attend = recording
    try:
        contexts = net.contexts(tgt.hidden, tgt.kv, positions, frozen.inv_freq)
        net.blocks(contexts, anchors, tokens, frozen.embed, frozen.inv_freq, G)
    finally:
        block_lib.attend = attend
    A = anchors.shape[1]
    return [q.reshape(B, A, G + 1, *q.shape[2:]) for q in seen[: tr.dcfg.num_layers]]


def block_query_cosines_of(cfg, run, rows: int = 2) -> dict:
    """The query probe for a block drafter with KV context (the block-wise KV-only
    drafter): per drafter layer i, whose merged memory starts as target layer j, the
    cosine between its queries and the target's own queries at layer j, same positions
    and heads: "trained" / "init" at block position 0 (the anchor token, the analogue of
    TTT step 0 in `query_cosines`), "trained_mask" / "init_mask" averaged over the mask
    positions 1..G; "best_target_layer" by the block-position-0 cosine. `rows` held-out
    sequences. Same keys as `query_cosines_of` plus the mask columns."""
    dcfg = run.trainer.dcfg
    if not dcfg.uses_kv:
        raise ValueError(f"block_query_cosines_of needs a KV context, not {dcfg.context!r}")
    data = held_out_rows(run, rows)
    tokens = jnp.asarray(data[:, :-1])
    T = tokens.shape[1]
    G = dcfg.gamma
    layers = list(dcfg.kv_layers)
    tq = target_queries(_target(run), tokens, layers)
    at = np.arange(1, T - G)[:, None] + np.arange(G + 1)[None, :]  # [A, G+1] positions
    got = {t: block_queries(run, params_of(cfg, run, t), data) for t in (True, False)}
    out = []
    for i, src in enumerate(dcfg.merge_sources()[: len(got[True])]):
        j = layers[src]
        ref = {jj: np.asarray(tq[jj])[:, at] for jj in layers}  # [B,A,G+1,N,H]
        per_layer = {jj: _cos(got[True][i][:, :, 0], ref[jj][:, :, 0]) for jj in layers}
        best = max(per_layer, key=per_layer.get)
        out.append({"layer": i, "target_layer": j,
                    "trained": _cos(got[True][i][:, :, 0], ref[j][:, :, 0]),
                    "init": _cos(got[False][i][:, :, 0], ref[j][:, :, 0]),
                    "trained_mask": _cos(got[True][i][:, :, 1:], ref[j][:, :, 1:]),
                    "init_mask": _cos(got[False][i][:, :, 1:], ref[j][:, :, 1:]),
                    "best_target_layer": best, "best": per_layer[best]})
    between = _cos(tq[layers[0]], tq[layers[-1]])
    return {"layers": out, "target_between": between,
            "target_between_layers": [layers[0], layers[-1]]}
