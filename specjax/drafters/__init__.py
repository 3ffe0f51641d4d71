"""Drafters: the loop interface (base), the draft LM and n-gram lookup, and the learned
drafters that read the target (eagle3, kv, hybrid, block, and any kind registered with
`specjax.drafters.registry`; docs/design.md sections 5 and 11).

    net = build_network(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    drafter, dparams = make_drafter(dcfg, net, target, gamma=dcfg.gamma,
                                    sampling=SamplingParams())
    speculative_loop(..., drafter, dparams, ...)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.core.sampling import SamplingParams
from specjax.drafters import registry
from specjax.drafters.config import DrafterConfig
from specjax.errors import SpecjaxError


def network_class(kind: str):
    """The nnx.Module class of a drafter kind (`registry`)."""
    return registry.get(kind).network


def build_network(dcfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.Module:
    """A randomly initialised drafter network (its nnx.Param leaves are the drafter's own
    weights; the target's embedding and LM head are not part of it)."""
    return network_class(dcfg.kind)(dcfg, dtype=dtype, rngs=rngs)


def make_drafter(dcfg: DrafterConfig, net: nnx.Module, target, *, gamma: int | None = None,
                 sampling: SamplingParams = SamplingParams(), matmul_dtype=None,
                 draft_vocab=None, stop_below: float = 0.0):
    """(drafter, params) for `speculative_loop`: the loop adapter of `net`'s kind, and
    params {"net": net's state, "embed", "head", "inv_freq"} taken from `target` (a
    `specjax.models.model.Transformer`; its arrays are shared, not copied).

    matmul_dtype: None (the net's own dtype) or jnp.bfloat16: the drafter's matrices
      (every parameter of rank >= 2) and a copy of the LM head are cast to it, and its
      matmuls take bf16 inputs with f32 accumulation (`specjax.models.matmul.linear`); activations,
      norms, attention and caches keep the net's dtype. The target is untouched, so
      verification, and with it losslessness, does not depend on this choice; only the
      draft distributions q change (slightly) and with them the acceptance.
    draft_vocab: None (draft over all V ids) or i32[Vd] distinct target ids, a hot draft
      vocabulary (`specjax.drafters.vocab`): the drafter's head is the target's head rows
      of those ids ([Vd, D]: each draft step's LM-head matmul shrinks by V/Vd) and q is 0
      outside them. Verification is unchanged, so the output is too.
    stop_below: kinds that stop early only (`registry.early_stop_kinds`: eagle3, hybrid):
      end a step's drafting once every row's chain confidence (product of its drafts'
      top-1 draft probabilities) is below this, in [0, 1]; the rest of the G positions get a filler token with a one-hot q, which
      verification rejects unless the target agrees (lossless). 0: always draft G.

    Raises: SpecjaxError if `target` has other shapes than the drafter was built for, or
    for a `stop_below` outside [0, 1] or given to another kind.
    """
    spec = registry.get(dcfg.kind)
    dcfg.check_target(target.cfg)
    if not 0.0 <= stop_below <= 1.0:
        raise SpecjaxError(f"--draft-stop {stop_below}: a confidence in [0, 1] (0: off)")
    if stop_below > 0 and not spec.early_stop:
        names = registry.early_stop_kinds()
        stoppers = (" and ".join(names) if len(names) < 3
                    else ", ".join(names[:-1]) + " and " + names[-1])
        raise SpecjaxError(f"--draft-stop: only {stoppers} drafters stop early; this "
                           f"drafter is {dcfg.kind}")
    graphdef, state = nnx.split(net)
    drafter = spec.adapter(graphdef, dcfg, gamma or dcfg.gamma, sampling, stop_below)
    embed = target.embed[...]
    head = embed if target.lm_head is None else target.lm_head[...]
    if matmul_dtype is not None:
        state = jax.tree.map(
            lambda a: a.astype(matmul_dtype) if a.ndim >= 2 and jnp.issubdtype(
                a.dtype, jnp.floating) else a, state)
    embed, head = embed.astype(net.dtype), head.astype(matmul_dtype or net.dtype)  # no copy
    params = {"net": state, "embed": embed, "head": head, "inv_freq": target.inv_freq[...]}
    if draft_vocab is not None:
        ids = jnp.asarray(draft_vocab, jnp.int32)
        params["head"], params["draft_ids"] = jnp.take(head, ids, axis=0), ids
    return drafter, params


__all__ = ["DrafterConfig", "build_network", "make_drafter", "network_class"]
