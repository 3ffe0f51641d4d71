"""Float64 numpy references for the exact-distribution tests (tests/decoding/test_distribution.py).

Nothing here calls `specjax.core.sampling` or `specjax.decoding.verify`: the filters (temperature,
top-k, top-p) and the verification rules' exact outcome probabilities are written
again from their documented semantics (specjax/core/sampling.py docstring, docs/design.md
section 4), so a test compares the code under test against an independent reference.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.model import Transformer

# ----------------------------------------------------------------------------- filters


def np_filtered_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """f64[..., V] probabilities after temperature, then top-k, then top-p (T > 0).

    top-k keeps every logit >= the k-th largest; top-p keeps a token when the mass of
    the strictly more probable tokens is below top_p (so ties at the boundary stay).
    """
    z = np.asarray(logits, np.float64) / temperature
    V = z.shape[-1]
    if 0 < top_k < V:
        kth = np.sort(z, axis=-1)[..., V - top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1:
        more = probs[..., None, :] > probs[..., :, None]  # [..., j, i]: p_i > p_j
        mass_more = np.sum(np.where(more, probs[..., None, :], 0.0), axis=-1)
        probs = np.where(mass_more < top_p, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def filter_margin(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> float:
    """How far (f64) the logits are from a top-k / top-p decision boundary: the smallest
    gap between the k-th and (k+1)-th scaled logit, and between top_p and any token's
    mass of strictly more probable tokens. A test whose margin is ~1e-6 would depend on
    float32 rounding inside the loop, so tests assert a comfortable margin."""
    z = np.asarray(logits, np.float64) / temperature
    V = z.shape[-1]
    margin = np.inf
    if 0 < top_k < V:
        s = np.sort(z, axis=-1)
        kth, below = s[..., V - top_k], s[..., V - top_k - 1]
        # fewer than k finite logits (a constraint's mask): the filter keeps all of them
        gap = np.where(np.isneginf(kth), np.inf, kth - np.where(np.isneginf(below), -np.inf,
                                                                 below))
        margin = min(margin, float(np.min(gap)))
    if top_p < 1:
        probs = np_filtered_probs(logits, temperature, top_k, 1.0)
        more = probs[..., None, :] > probs[..., :, None]
        mass_more = np.sum(np.where(more, probs[..., None, :], 0.0), axis=-1)
        margin = min(margin, float(np.min(np.abs(mass_more - top_p))))
    return margin


# ----------------------------------------------------------------------------- models

V = 6
CFG = ModelConfig(family="qwen3", vocab_size=V, hidden_size=16, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8, intermediate_size=32)


def scaled_model(seed: int, scale: float, cfg: ModelConfig = CFG) -> Transformer:
    """A random tiny Transformer (`cfg`, CFG by default) with every weight matrix (not
    the norms) scaled by `scale` (init std 0.02 -> 0.02 * scale), so that its next-token
    distribution is far from uniform and depends on the context."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state))
    return model


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward_logits(graphdef, params, contexts):
    model = nnx.merge(graphdef, params)
    N, T = contexts.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
    return model(contexts, pos, model.init_cache(N, T)).logits


def context_logits(model: Transformer, contexts) -> np.ndarray:
    """f64[N,T,V] logits of `model` at every position of the i32[N,T] contexts (one
    plain forward from an empty cache, no padding)."""
    graphdef, params = nnx.split(model)
    out = _forward_logits(graphdef, params, jnp.asarray(contexts, jnp.int32))
    return np.asarray(out, np.float64)


def all_tuples(n: int, vocab: int = V) -> np.ndarray:
    """i32[vocab**n, n]: every token tuple, in the order of `seq_index`."""
    if n == 0:
        return np.zeros((1, 0), np.int32)
    return np.array(list(itertools.product(range(vocab), repeat=n)), np.int32)


def seq_index(seqs, vocab: int = V) -> np.ndarray:
    """i64[N]: the base-`vocab` index of each row of i32[N,n] (first token most significant)."""
    seqs = np.asarray(seqs, np.int64)
    idx = np.zeros(seqs.shape[0], np.int64)
    for j in range(seqs.shape[1]):
        idx = idx * vocab + seqs[:, j]
    return idx


def exact_joint(target: Transformer, prompt, n: int, temperature, top_k=0, top_p=1.0,
                next_state=None, start: int = 0):
    """The target's exact distribution over its first n generated tokens after
    `prompt`: f64[V**n] indexed by `seq_index`, and the filter margin over the contexts.

    Enumerates every (n-1)-token continuation, runs one forward over prompt + it, and
    multiplies the filtered conditionals at positions Tp-1 .. Tp+n-2.

    next_state: None, or a token automaton i32[S,V] over token ids (-1: not allowed),
    written by the test (no token classes, no tokenizer), from state `start`: constrained
    autoregressive decoding (docs/structured.md), where at each position the logits of the
    tokens the prefix's state forbids are -inf BEFORE temperature, top-k and top-p.
    """
    prompt = np.asarray(prompt, np.int32)
    Tp = prompt.size
    conts = all_tuples(n - 1)
    M = len(conts)
    ctx = np.concatenate([np.broadcast_to(prompt, (M, Tp)), conts], axis=1)
    logits = context_logits(target, ctx)[:, Tp - 1:]  # [V^(n-1), n, V]
    if next_state is not None:
        next_state = np.asarray(next_state)
        states = np.full((M, n), start, np.int64)
        for j in range(1, n):  # the state before position j: after conts[:, :j]
            prev = states[:, j - 1]
            states[:, j] = np.where(prev < 0, -1,
                                    next_state[np.maximum(prev, 0), conts[:, j - 1]])
        allowed = (next_state[np.maximum(states, 0)] >= 0) | (states < 0)[..., None]
        logits = np.where(allowed, logits, -np.inf)  # a forbidden token: probability 0
    probs = np_filtered_probs(logits, temperature, top_k, top_p)
    joint = np.ones((M, V))
    for j in range(n - 1):
        joint *= probs[np.arange(M), j, conts[:, j]][:, None]
    joint *= probs[:, n - 1]
    margin = filter_margin(logits, temperature, top_k, top_p)
    return joint.reshape(-1), margin


# ----------------------------------------------------------------------------- statistics


def empirical_pmf(seqs, vocab: int = V) -> np.ndarray:
    """f64[vocab**n]: frequencies of the rows of i32[N,n]."""
    n = np.asarray(seqs).shape[1]
    return np.bincount(seq_index(seqs, vocab), minlength=vocab**n) / len(seqs)


def tv(a, b) -> float:
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def tv_null_quantile(pmf, n_samples: int, level: float = 0.999, reps: int = 4000,
                     seed: int = 0) -> float:
    """The `level` quantile of TV(empirical, pmf) for n_samples iid draws from pmf,
    simulated with `reps` multinomial repetitions."""
    rng = np.random.default_rng(seed)
    pmf = np.asarray(pmf, np.float64)
    pmf = pmf / pmf.sum()
    counts = rng.multinomial(n_samples, pmf, size=reps)
    tvs = 0.5 * np.abs(counts / n_samples - pmf[None]).sum(axis=1)
    return float(np.quantile(tvs, level))


def projections(n: int) -> list[tuple[int, ...]]:
    """The views of an n-token sequence that `projection_test` checks: every position
    alone, every adjacent pair, every run of three, and (n > 3) the whole sequence."""
    out = [(j,) for j in range(n)] + [(j, j + 1) for j in range(n - 1)]
    out += [tuple(range(j, j + 3)) for j in range(n - 2)]
    if n > 3:
        out.append(tuple(range(n)))
    return out


def project(x, axes: tuple[int, ...], n: int, vocab: int = V) -> np.ndarray:
    """x f64[..., vocab**n] (a pmf over n-token sequences, `seq_index` order) ->
    f64[..., vocab**len(axes)]: the marginal of the positions `axes` (ascending)."""
    x = np.asarray(x)
    lead = x.shape[:-1]
    other = tuple(len(lead) + j for j in range(n) if j not in axes)
    return x.reshape(*lead, *([vocab] * n)).sum(axis=other).reshape(*lead, -1)


def standardise(tvs, mean, sd):
    """(TV - mean) / sd per view; a view whose null never varies (a position the
    constraint or the filters make deterministic: sd ~ 0) scores -inf while its TV stays
    at that constant and +inf once it moves (a token the law forbids)."""
    tvs = np.asarray(tvs, np.float64)
    flat = sd < 1e-12
    z = (tvs - mean) / np.where(flat, 1.0, sd)
    return np.where(flat, np.where(np.abs(tvs - mean) > 1e-9, np.inf, -np.inf), z)


def projection_null(pmf, n_samples: int, level: float = 0.999, reps: int = 4000,
                    seed: int = 0, chunk: int = 500):
    """Null law of `projection_test`'s statistic for n_samples iid sequences from pmf
    (f64[V**n]): simulated with `reps` multinomial draws of the whole joint, each
    projected like the sample. -> (mean f64[P], sd f64[P], threshold): the TV of
    projection i is standardised as (TV_i - mean_i) / sd_i and the statistic is the
    largest; threshold is its `level` quantile (one level for the whole family)."""
    pmf = np.asarray(pmf, np.float64)
    pmf = pmf / pmf.sum()
    n = round(np.log(pmf.size) / np.log(V))
    axes = projections(n)
    exact = [project(pmf, a, n) for a in axes]
    rng = np.random.default_rng(seed)
    tvs = np.zeros((reps, len(axes)))
    for start in range(0, reps, chunk):
        m = min(chunk, reps - start)
        freq = rng.multinomial(n_samples, pmf, size=m) / n_samples
        for i, a in enumerate(axes):
            tvs[start:start + m, i] = 0.5 * np.abs(project(freq, a, n) - exact[i]).sum(-1)
    mean, sd = tvs.mean(axis=0), tvs.std(axis=0, ddof=1)
    z = standardise(tvs, mean, sd).max(axis=1)
    return mean, sd, float(np.quantile(z, level))


def projection_test(seqs, pmf, null) -> tuple[float, float, str]:
    """Are the rows of i32[N,n] draws from pmf f64[V**n]? Each view of `projections(n)`
    (marginals, adjacent pairs, runs of three, the whole joint) is compared with the
    same view of pmf by TV; the statistic is the largest standardised TV, `null` =
    `projection_null(pmf, N)`. A multi-round loop that is exact on the first round only
    shows in the later positions' views, which have few cells (and so power) where the
    whole joint of V**n cells has little. -> (statistic, threshold, the worst view and
    its TV as text)."""
    seqs = np.asarray(seqs)
    n = seqs.shape[1]
    emp = empirical_pmf(seqs)
    mean, sd, thresh = null
    axes = projections(n)
    tvs = np.array([tv(project(emp, a, n), project(pmf, a, n)) for a in axes])
    z = standardise(tvs, mean, sd)
    i = int(np.argmax(z))
    return float(z[i]), thresh, f"positions {axes[i]} TV={tvs[i]:.4f} (null mean {mean[i]:.4f})"


def ratio_mean_se(num, den):
    """Ratio estimator sum(num)/sum(den) over iid rows and its delta-method standard error."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    r = num.sum() / den.sum()
    n = len(num)
    se = np.sqrt(np.var(num - r * den, ddof=1) / n) / den.mean()
    return float(r), float(se)


# ----------------------------------------------------------------------------- verify rules


def sample_rows(rng, probs) -> np.ndarray:
    """One i32 draw per row of f64[N,V] probabilities (inverse CDF)."""
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(len(probs))[:, None] * cdf[:, -1:]
    return np.minimum((u >= cdf).sum(axis=-1), probs.shape[-1] - 1).astype(np.int32)


def _residual(p, q, w=1.0):
    """norm(max(w p - q, 0)); p where that is all zeros (a probability-0 branch)."""
    r = np.maximum(w * p - q, 0.0)
    m = r.sum()
    return r / m if m > 0 else p


def exact_verdict(rule: str, draft, q, p):
    """f64[G+1, V]: P(tau = i, next = y | draft) for one row under the rule as docs/design.md
    section 4 states it. draft i32[G]; q f64[G,V]; p f64[G+1,V] (p_i in the context of
    x_1..x_{i-1}). rule: "token" or "block"."""
    G = len(draft)
    V_ = p.shape[-1]
    px = np.array([p[i, draft[i]] for i in range(G)])
    qx = np.array([q[i, draft[i]] for i in range(G)])
    out = np.zeros((G + 1, V_))
    if np.any(qx <= 0):  # the drafter never proposes this draft
        return out
    if rule == "token":
        a = np.minimum(1.0, px / qx)
        reach = 1.0
        for i in range(G):  # reject at i + 1 (0-based i) after accepting i tokens
            res = _residual(p[i], q[i])
            if reach * (1 - a[i]) > 0:
                out[i] = reach * (1 - a[i]) * res
            reach *= a[i]
        out[G] = reach * p[G]
        return out
    # block
    w = np.ones(G + 1)  # w_0..w_G
    for i in range(1, G + 1):
        w[i] = min(1.0, w[i - 1] * px[i - 1] / qx[i - 1])
    h = np.zeros(G + 1)  # h_1..h_G (h[0] unused)
    for i in range(1, G):
        A = np.maximum(w[i] * p[i] - q[i], 0.0).sum()
        den = A + 1.0 - w[i]
        h[i] = A / den if den > 0 else 1.0
    h[G] = w[G]
    for i in range(G + 1):
        p_tau = (h[i] if i > 0 else 1.0) * np.prod(1.0 - h[i + 1:])
        if p_tau <= 0:
            continue
        out[i] = p_tau * (p[G] if i == G else _residual(p[i], q[i], w[i]))
    return out


def expected_accepted(rule: str, draft, q, p) -> float:
    """E[tau | draft] for one row, exactly (see `exact_verdict`)."""
    return float(np.sum(exact_verdict(rule, draft, q, p).sum(axis=1) * np.arange(len(draft) + 1)))
