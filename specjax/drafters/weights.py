"""The learned drafters' weights: initialisers and the stacked weights of Ld decoder
layers (HF [out, in] layout, the target's names, so the mesh rules shard them alike),
with one layer's halves around its attention (`specjax.models.layers` computes them, as for the
target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.config import DrafterConfig
from specjax.models import layers


def normal(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> nnx.Param:
    """A parameter drawn from N(0, std^2)."""
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype))


def ones(shape, dtype) -> nnx.Param:
    """A parameter of ones (a norm's weight)."""
    return nnx.Param(jnp.ones(shape, dtype))


def zeros(shape, dtype) -> nnx.Param:
    """A zero-initialised parameter."""
    return nnx.Param(jnp.zeros(shape, dtype))


def layer_weights(cfg: DrafterConfig, rngs: nnx.Rngs, dtype, num_layers: int,
                  in_dim: int | None = None, input_norm: bool = True) -> dict[str, nnx.Param]:
    """Stacked weights of `num_layers` decoder layers whose q/k/v read `in_dim` features
    (default D; eagle3 reads 2D): input_norm [Ld,D] (unless input_norm=False),
    q_proj [Ld,N*H,in], k_proj/v_proj [Ld,K*H,in], q_norm/k_norm [Ld,H] (unless
    cfg.qk_norm is False),
    o_proj [Ld,D,N*H], post_norm [Ld,D], gate_proj/up_proj [Ld,F,D], down_proj [Ld,D,F]."""
    D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    Ld, In = num_layers, in_dim or D
    norm = dict(input_norm=ones((Ld, D), dtype)) if input_norm else {}
    qk = dict(q_norm=ones((Ld, H), dtype), k_norm=ones((Ld, H), dtype)) if cfg.qk_norm else {}
    return dict(**norm,
        q_proj=normal(rngs, (Ld, N * H, In), dtype), k_proj=normal(rngs, (Ld, K * H, In), dtype),
        v_proj=normal(rngs, (Ld, K * H, In), dtype), **qk, o_proj=normal(rngs, (Ld, D, N * H), dtype),
        post_norm=ones((Ld, D), dtype), gate_proj=normal(rngs, (Ld, F, D), dtype),
        up_proj=normal(rngs, (Ld, F, D), dtype), down_proj=normal(rngs, (Ld, D, F), dtype))


LAYER_KEYS = ("input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj", "post_norm",
              "gate_proj", "up_proj", "down_proj")


def layer_params(module: nnx.Module, i: int) -> dict[str, jax.Array]:
    """Layer i's weights (static index) of a module holding `layer_weights` attributes."""
    return {k: getattr(module, k)[i] for k in LAYER_KEYS if hasattr(module, k)}


def layer_qkv(module, i: int, x, cos, sin):
    """Layer i of a module with `layer_weights` (input_norm included): q [B,T,N,H],
    k, v [B,T,K,H] of x [B,T,D] (`specjax.models.layers.layer_qkv`)."""
    c = module.cfg
    return layers.layer_qkv(layer_params(module, i), x, cos, sin, c.rms_norm_eps,
                            c.num_heads, c.num_kv_heads, c.head_dim)


def layer_out(module, i: int, x, attn):
    """Layer i's output: x + o_proj(attn [B,T,N*H]), then the MLP -> [B,T,D]
    (`specjax.models.layers.layer_out`)."""
    return layers.layer_out(layer_params(module, i), x, attn, module.cfg.rms_norm_eps)
