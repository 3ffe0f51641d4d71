"""Which attention and verification kernels a decoding loop runs: the policy, in one place.

    kernels = resolve_kernels("auto")   # "pallas" on TPU, "attention" on GPU, "reference" on CPU
    fn = target_attention(kernels, cache_sharding, "auto", None)   # Transformer(attention=)
    fn = drafter_attention(kernels, cache_sharding, "auto", None)  # attend(kernel=)
    drafter = with_drafter_attention(drafter, fn)   # a learned drafter attends with fn

Every choice is made from static configuration (`specjax.decoding.loop.LoopConfig`, the
trainers' `train.kernels`, `specjax.train.kernels`) and passed explicitly: the target's
forward takes `attention=`, a learned drafter carries its kernel in its `attention`
field (a frozen dataclass, static under jit, so a jit cache entry never mixes the kernel
and the jnp path), and `specjax.drafters.attend.attend` takes `kernel=`. Drafters without
that field (n-gram, draft LM, external ones) ignore the choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from specjax.core.drafter import AttentionKernel
from specjax.errors import SpecjaxError

KERNELS = ("auto", "off", "reference", "pallas", "attention")  # decode.py --kernels
LOOP_KERNELS = ("off", "reference", "pallas", "attention")  # resolved: `LoopConfig.kernels`
ATTENTION_KERNELS = ("pallas", "attention")  # the settings that run the attention kernels
FUSED_VERIFY = ("reference", "pallas")  # the settings that fuse verification


def resolve_kernels(kernels: str, backend: str | None = None) -> str:
    """The verification path for `LoopConfig.kernels`.

    "off": specjax.decoding.verify on the filtered probabilities (the original path);
    "reference" / "pallas": pallas_kernels.verify from the target's logits, as jnp or as
    Pallas kernels (interpret mode on CPU, slow there); the two give identical output.
    "pallas" also runs the target's decode and verify attention into its KV cache through
    pallas_kernels.attention (`target_attention`) and the learned drafters' attention
    through packed_attention (`drafter_attention`); "off" and "reference" keep the chunked
    jnp attention. "attention": the attention kernels of "pallas" with the unfused
    verification of "off".
    "auto": per kernel, the backend's entry in `specjax.backend_choices` (measured on
    GPU: "attention", the Triton attention kernel with unfused verification; a stated
    reason on TPU: "pallas"; "reference" on CPU, where the kernels run in interpret mode);
    `python benchmarks/kernel_choice.py` derives the measured entries from the device
    rounds.
    Raises SpecjaxError on any other name.
    """
    if kernels not in KERNELS:
        raise SpecjaxError(f"--kernels={kernels!r}: expected one of {', '.join(KERNELS)}")
    if kernels != "auto":
        return kernels
    from specjax.backend_choices import choice, kernels_setting

    return kernels_setting(choice(backend or jax.default_backend()))


def pallas_layout(pallas_backend: str, interpret: bool | None) -> tuple[str, bool | None]:
    """(backend "tpu" or "triton", interpret) of the attention kernels: "auto" is Triton
    on GPU, the Mosaic TPU layout elsewhere."""
    backend = pallas_backend
    if backend == "auto":
        backend = "triton" if jax.default_backend() == "gpu" else "tpu"
    return backend, interpret


def target_attention(kernels: str, cache_sharding, pallas_backend: str,
                     interpret: bool | None) -> Callable | None:
    """The `attention=` argument of the target's decode and verify forwards: None (the
    chunked jnp `specjax.models.attention.cache_attention`) unless kernels is "pallas" or
    "attention" (`ATTENTION_KERNELS`) and the
    cache is not sharded over a mesh (the kernel is not partitioned: XLA would gather the
    cache), then the causal `pallas_kernels.attention.decode_attention` over the
    layer-major cache, read in place (its tree mode when the forward passes tree_mask=, a
    draft tree's verify forward). See `specjax.decoding.loop.LoopConfig.target_attention`."""
    if kernels not in ATTENTION_KERNELS or cache_sharding is not None:
        return None
    from pallas_kernels.attention import decode_attention

    backend, interpret = pallas_layout(pallas_backend, interpret)

    def fn(q, k_cache, v_cache, layer, lengths, k_new, v_new, tree_mask=None):
        if tree_mask is not None:  # a draft tree's verify forward: the kernel's tree mode
            return decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, mode="tree",
                                    tree_mask=tree_mask, backend=backend,
                                    interpret=interpret, layer=layer)
        return decode_attention(q, k_cache, v_cache, lengths, k_new, v_new,
                                mode="causal", backend=backend, interpret=interpret,
                                layer=layer)

    return fn


def drafter_attention(kernels: str, cache_sharding, pallas_backend: str,
                      interpret: bool | None) -> AttentionKernel | None:
    """The kernel a learned drafter attends with (`specjax.drafters.attend.attend`'s
    `kernel`): None (the jnp path) unless kernels is "pallas" or "attention" and no mesh,
    then
    `pallas_kernels.attention.packed_attention` for every source given by a per-query
    limit. See `specjax.decoding.loop.LoopConfig.drafter_attention`."""
    if kernels not in ATTENTION_KERNELS or cache_sharding is not None:
        return None
    from pallas_kernels.attention import packed_attention

    backend, interpret = pallas_layout(pallas_backend, interpret)

    def fn(q, k, v, limit):  # the kernel takes one dtype: the queries'
        return packed_attention(q, k.astype(q.dtype), v.astype(q.dtype), limit,
                                backend=backend, interpret=interpret)

    return fn


def has_attention(drafter) -> bool:
    """True for a drafter with an attention kernel of its own (an `attention` field: the
    learned drafters, `specjax.drafters.learned.LearnedDrafter`)."""
    return dataclasses.is_dataclass(drafter) and any(
        f.name == "attention" for f in dataclasses.fields(drafter))


def with_drafter_attention(drafter, kernel: AttentionKernel | None):
    """The drafter attending with `kernel` (None: the jnp path): a copy with its
    `attention` field set when it has one (`has_attention`); any other drafter as it is."""
    if has_attention(drafter):
        return dataclasses.replace(drafter, attention=kernel)
    return drafter


def describe(cfg, drafter) -> tuple[dict, list[str]]:
    """What the loop of `cfg` (a `specjax.decoding.loop.LoopConfig`) with `drafter` (None:
    autoregressive) runs, and where that falls short of what `cfg.kernels` asked for.

    Returns (paths, notes). paths: {"verify": "fused-pallas" | "fused-reference" |
    "unfused" | "none", "target_attention": "pallas" | "jnp", "drafter_attention":
    "pallas" | "jnp" | None (a drafter with no attention of its own)}: the path each part
    takes. notes: one line per fallback (the fused verifier skipped for draft trees,
    top-k/top-p, a custom or lossy rule; the attention kernels skipped on a mesh), which
    decode.py prints on stderr; none with kernels "off" (nothing was asked for), nor for
    verification with "attention" (which asks for it unfused)."""
    k, mesh = cfg.kernels, cfg.cache_sharding is not None
    notes = []
    attn = "pallas" if k in ATTENTION_KERNELS and not mesh else "jnp"
    if k in ATTENTION_KERNELS and mesh:
        notes.append(f"kernels={k}: the attention kernels are not partitioned over a mesh; "
                     "the target and drafter attend with the jnp path")
    verify = "none"
    if drafter is not None:
        verify = "unfused"
        if k in FUSED_VERIFY:
            rule = cfg.rule()
            tree = cfg.num_drafts > 1 or hasattr(drafter, "propose_tree")
            if tree:
                notes.append(f"kernels={k}: draft trees have no fused verification kernel; "
                             "verifying unfused (specjax.decoding.tree_verify)")
            elif rule.fused(cfg.sampling, k, cfg.pallas_backend,
                            cfg.pallas_interpret) is not None:
                verify = f"fused-{k}"
            else:
                note = getattr(rule, "fused_note", None)
                notes.append((note and note(cfg.sampling, k))
                             or f"kernels={k}: the {rule.name} rule is not fused; verifying "
                                "unfused")
    return ({"verify": verify, "target_attention": attn,
             "drafter_attention": attn if has_attention(drafter) else None}, notes)
