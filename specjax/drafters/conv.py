"""DFlash2's grouped dynamic causal convolution around a block drafter layer's attention
and MLP (z-lab/dflash `dflash/model.py`: `GroupedDynamicCausalConv`,
`_grouped_dynamic_convolve`; `DrafterConfig.conv_kernel_size` > 0).

Per sublayer (attention, MLP) with input x, taps T (`conv_kernel_size`) and groups of g
channels (`conv_group_size`), along a block of S positions:

    h     = norm(x)                                   (input_norm / post_norm)
    delta = h @ proj.T  -> [..., S, 2, T, D/g]        one coefficient per side, tap, group
    c_s(y)_t = sum_{j<T} (base[s, j] + delta_t[s, j, group(c)]) * y_{t-j}   per channel c
    x     = x + c_1(sublayer(c_0(h)))

base [2, T, D] and proj [2*T*(D/g), D] are the sublayer's weights; both sides'
coefficients come from the same normed input h (z-lab's `prepare` convolves h with side 0
and keeps side 1 for `finish`, which convolves the sublayer's output: after o_proj for
attention, after down_proj for the MLP). y_{t-j} is zero before the block's first
position: blocks packed along the query axis (training) never see each other. The
attention's context keys and values (the target features) are not convolved.

A new convolution starts as the identity (tap 0 of both sides 1, the rest and the
projection 0, as SpecForge initialises it), so a conv drafter starts as the plain one.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from specjax.drafters.config import DrafterConfig
from specjax.models.matmul import linear

# BlockNet attribute names, stacked over the Ld layers: (base [Ld,2,T,D], proj [Ld,2*T*(D/g),D])
ATTN, MLP = ("attn_conv_base", "attn_conv_proj"), ("mlp_conv_base", "mlp_conv_proj")


def conv_weights(cfg: DrafterConfig, dtype) -> dict[str, nnx.Param]:
    """The identity-initialised convolution weights of cfg.num_layers layers."""
    Ld, T, D = cfg.num_layers, cfg.conv_kernel_size, cfg.hidden_size
    groups = D // cfg.conv_group_size
    base = jnp.zeros((Ld, 2, T, D), dtype).at[:, :, 0].set(1)
    out = {}
    for b, p in (ATTN, MLP):
        out[b] = nnx.Param(base)
        out[p] = nnx.Param(jnp.zeros((Ld, 2 * T * groups, D), dtype))
    return out


def convolve(y, delta, base, group_size: int, block_size: int):
    """One side of the convolution along aligned blocks of `block_size` positions.

    Args:
      y: [B,Q,D] (Q a multiple of block_size); delta: [B,Q,T,D/g] the side's dynamic
        coefficients; base: [T,D] its base kernel.
    Returns: [B,Q,D] in y's dtype: out_t = sum_j (base[j] + delta_t[j]) * y_{t-j}, the
      terms with t - j before the block's first position left out."""
    B, Q, D = y.shape
    S, T, G = block_size, base.shape[0], D // group_size
    yb = y.reshape(B, Q // S, S, G, group_size)
    db = delta.reshape(B, Q // S, S, T, G)[..., None].astype(y.dtype)
    out = jnp.zeros_like(yb)
    for j in range(min(T, S)):  # static taps; a tap reaching past the block adds nothing
        v = yb if j == 0 else jnp.pad(yb[:, :, :S - j], ((0, 0), (0, 0), (j, 0), (0, 0), (0, 0)))
        out = out + base[j].reshape(G, group_size).astype(y.dtype) * v
        out = out + db[:, :, :, j] * v
    return out.reshape(B, Q, D)


def wrap(h, base, proj, group_size: int, block_size: int, sublayer):
    """c_1(sublayer(c_0(h))) for the normed input h [B,Q,D] of one sublayer, with that
    layer's base [2,T,D] and proj [2*T*(D/g),D]; sublayer: [B,Q,D] -> [B,Q,D]."""
    B, Q, D = h.shape
    T = base.shape[1]
    delta = linear(h, proj).reshape(B, Q, 2, T, D // group_size)
    y = sublayer(convolve(h, delta[:, :, 0], base[0], group_size, block_size))
    return convolve(y, delta[:, :, 1], base[1], group_size, block_size)
