"""DSpark's Markov and confidence heads on a block drafter (DeepSeek, arXiv 2607.05147;
written from SpecForge's `specforge/modeling/draft/dspark.py` and its trainer
`OnlineDSparkModel` in `specforge/algorithms/common/dflash_family_model.py`).

The block forward drafts every position at once, so draft position k cannot see the
token drafted before it. The Markov head adds that dependency as a low-rank logit bias,
no extra transformer forward. Per draft position k, with h_k the block's final-normed
output [D], u_k its logits [V] and x_{k-1} the token before it (the block's pending
token for the first draft position):

    e_k      = W1[x_{k-1}]                               W1 [V,R] (markov_w1, an embedding)
    vanilla: z_k = e_k
    gated:   z_k = sigmoid([h_k ; e_k] @ Wg.T + bg) * e_k        Wg [R,D+R], bg [R]
    rnn:     g, c, o = split3([s_{k-1} ; e_k ; h_k] @ Wj.T + bj)   Wj [3R,2R+D], bj [3R]
             s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c),  s_0 = 0
             z_k = tanh(o)
    logits_k = u_k + z_k @ W2.T                          W2 [V,R] (markov_w2, Linear(R, V))

Drafting walks the block left to right (`draft_chain`): at temperature 0 the argmax of
logits_k, above it a sample of the sampling filter over logits_k, whose distribution is
the q that verification needs (q_k depends on x_{k-1}: a sequential proposal, so the
verifiers stay exact). Training (`block_logits`) teacher-forces x_{k-1}.

The confidence head: c_k = [h_k ; e_k] @ Wc.T + bc (Wc [1,D+R], bc [1]; without
`confidence_head_with_markov` only h_k), sigmoid(c_k) the predicted acceptance of draft
position k; SpecForge trains it with BCE against 1 - TV(p_target, q_draft) there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.constraints.loop import draft_logits, draft_state, row_state
from specjax.core.sampling import SamplingParams, sample_logits
from specjax.models.matmul import linear


@dataclasses.dataclass(frozen=True)
class Head:
    """One Markov head's weights (arrays of a BlockNet, read inside a traced function).

    kind: "vanilla", "gated" or "rnn"; w1, w2: [V,R]; gate [R,D+R], gate_bias [R] (gated);
    joint [3R,2R+D], joint_bias [3R] (rnn); None where the kind has none."""

    kind: str
    w1: jax.Array
    w2: jax.Array
    gate: jax.Array | None = None
    gate_bias: jax.Array | None = None
    joint: jax.Array | None = None
    joint_bias: jax.Array | None = None

    @property
    def rank(self) -> int:
        return self.w1.shape[-1]


def prev_embedding(head: Head, prev):
    """f32[...,R]: W1[prev] for token ids prev i32[...]."""
    return jnp.take(head.w1, prev, axis=0).astype(jnp.float32)


def _affine(x, w, b):
    return linear(x, w, out_dtype=jnp.float32) + b.astype(jnp.float32)


def step(head: Head, e, h, state):
    """One position's (bias f32[...,V], new state): e f32[...,R] = W1[x_{k-1}], h [...,D]
    the position's final-normed output, state f32[...,R] (rnn; the others pass it on)."""
    h = h.astype(jnp.float32)
    if head.kind == "vanilla":
        z = e
    elif head.kind == "gated":
        z = jax.nn.sigmoid(_affine(jnp.concatenate([h, e], -1), head.gate, head.gate_bias)) * e
    else:  # rnn
        g, c, o = jnp.split(_affine(jnp.concatenate([state, e, h], -1), head.joint,
                                    head.joint_bias), 3, axis=-1)
        g = jax.nn.sigmoid(g)
        state = g * state + (1.0 - g) * jnp.tanh(c)
        z = jnp.tanh(o)
    return linear(z, head.w2, out_dtype=jnp.float32), state


def block_logits(head: Head, logits, h, prev):
    """f32[...,G,V]: the corrected logits of G draft positions given their predecessors.

    Args:
      logits: f32[...,G,V] the block's logits; h: [...,G,D] its final-normed outputs;
      prev: i32[...,G] the token before each position (teacher forcing in training).
    """
    G = logits.shape[-2]
    e = prev_embedding(head, prev)  # [...,G,R]
    if head.kind != "rnn":
        bias, _ = step(head, e, h, None)
        return logits.astype(jnp.float32) + bias
    state = jnp.zeros(e.shape[:-2] + (head.rank,), jnp.float32)
    out = []
    for k in range(G):  # static G: the recurrence over the block's positions
        bias, state = step(head, e[..., k, :], h[..., k, :], state)
        out.append(logits[..., k, :].astype(jnp.float32) + bias)
    return jnp.stack(out, axis=-2)


def draft_chain(head: Head, h, logits, first, key, sampling: SamplingParams,
                constraint=None):
    """A chain drafted left to right through the Markov head.

    Args:
      h: [B,G,D] the block's final-normed outputs at its G draft positions; logits:
        f32[B,G,V] its logits there; first: i32[B] the pending token (x_0's predecessor);
      key: PRNG key (unused at temperature 0); constraint: the loop's
      `specjax.constraints.loop.Constraint` or None (each position masked in the state
      the drafts before it reach).
    Returns: draft i32[B,G] and q f32[B,G,V], the filtered distribution of each position's
      corrected logits given the token drafted before it (one-hot at temperature 0)."""
    B, G, _ = logits.shape
    keys = jax.random.split(key, G)
    prev, state, draft, qs = first, jnp.zeros((B, head.rank), jnp.float32), [], []
    cs = row_state(constraint)
    for k in range(G):  # static G: one rank-R product per position
        bias, state = step(head, prev_embedding(head, prev), h[:, k], state)
        lg = draft_logits(constraint, logits[:, k].astype(jnp.float32) + bias, cs)
        x, q = sample_logits(keys[k], lg, sampling)
        draft.append(x)
        qs.append(q)
        prev, cs = x, draft_state(constraint, cs, x)
    return jnp.stack(draft, 1), jnp.stack(qs, 1)


def confidence_logits(proj, bias, h, e=None):
    """f32[...]: the confidence head's logit of outputs h [...,D] ([h ; e] when e, the
    Markov head's W1[x_{k-1}] f32[...,R], is given); proj [1,D(+R)], bias [1]."""
    x = h.astype(jnp.float32) if e is None else jnp.concatenate(
        [h.astype(jnp.float32), e], axis=-1)
    return _affine(x, proj, bias)[..., 0]


def predecessors(first, tokens):
    """i32[...,G]: the token before each of G positions: first i32[...] then tokens
    [...,G]'s first G-1."""
    return jnp.concatenate([first[..., None], tokens[..., :-1]], axis=-1)
