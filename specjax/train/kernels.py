"""Attention kernels in training: `train.kernels` in configs, `train.py --kernels`.

    kernels = resolve("auto")                 # "pallas" on TPU/GPU, "reference" on CPU
    fn = packed_attention_fn(mesh)            # fn(q, k, v, limit) -> (o, lse) or None

With "pallas" the attention of every training forward goes through
`pallas_kernels.attention.packed_attention` (flash attention with a per-query limit,
forward and backward as Pallas kernels, docs/design.md section 10):
- the target's cache-free causal forward (objective lm, and the frozen target inside the
  drafter objectives): `specjax.models.model.Transformer(..., self_attention=fn)`;
- the drafters' attention over their context (TTT: step-0 keys at positions <= t and,
  for kv/hybrid, the merged target memory; block-wise: the context strictly before each
  block's anchor): the trainer passes fn explicitly to the objective, which hands it to
  every `specjax.drafters.attend.attend` as `kernel` (`specjax.decoding.kernel_policy`); the block's own
  entries and TTT's diagonal stay jnp (a few entries per query) and are merged with the
  kernel's output by log-sum-exp.
No [T, S] scores are then kept for the backward pass, which is what TTT runs out of
memory on at long sequences. With "reference" the jnp attention runs (the same
function; results agree up to f32 summation order). With "chunked" (jnp, any platform)
the queries are split into chunks of `CHUNK_Q` that each attend over every key slot
under `jax.checkpoint`, so at most one chunk's [chunk, S] scores exist at a time, in the
forward and in the backward (which recomputes them): the long-context path on CPU
(`configs/long_target.yaml` trains at 16k-token rows with it). It reads every key slot
for every chunk, so a causal forward does about twice the attention arithmetic of a
kernel that skips the masked blocks.

On a mesh with more than one device the kernel runs under `jax.shard_map`: rows split
over the batch axes (data, fsdp) and heads over `model` when it divides both N and K
(else heads are replicated), so each device runs the kernel on its own shard and XLA
never has to gather a custom call's operands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.errors import SpecjaxError

KERNEL_CHOICES = ("auto", "pallas", "reference", "chunked")
CHUNK_Q = 512  # queries per chunk of the "chunked" attention

_log = logging.getLogger("specjax.train")


def resolve(kernels: str, backend: str | None = None) -> str:
    """"pallas", "reference" or "chunked" for `train.kernels`: "auto" is "pallas" on TPU
    and GPU and "reference" on CPU (where Pallas runs only in its slow interpret mode).

    Raises: SpecjaxError (one line) for any other value."""
    if kernels not in KERNEL_CHOICES:
        raise SpecjaxError(f"train.kernels={kernels!r}: expected one of "
                           f"{', '.join(KERNEL_CHOICES)}")
    if kernels != "auto":
        return kernels
    return "reference" if (backend or jax.default_backend()) == "cpu" else "pallas"


def chunked_attention(q, k, v, limit, *, chunk: int = CHUNK_Q):
    """`pallas_kernels.attention.packed_attention_reference` computed one chunk of
    queries at a time: q [B,T,N,H], k/v [B,K,S,H], limit i32[B,T] (query t sees slots
    s < limit[b, t]) -> (o [B,T,N,H] in q.dtype, lse f32[B,T,N]), equal to the
    reference up to f32 summation order.

    Each chunk of `chunk` queries runs under `jax.checkpoint` inside `lax.map`, so the
    [B, chunk, N, S] scores of one chunk are the largest intermediate, in the forward
    and in the recomputing backward (T/chunk times less than the reference). T is padded
    to a multiple of `chunk` with queries that see nothing. Raises ValueError on bad
    arguments or chunk < 1."""
    from pallas_kernels.attention.packed_reference import check_args, packed_attention_reference

    B, T, N, _, _, _, H = check_args(q, k, v, limit)
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be positive")
    chunk = min(chunk, T)
    pad = -T % chunk
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    lp = jnp.pad(limit.astype(jnp.int32), ((0, 0), (0, pad)))
    n = (T + pad) // chunk
    qc = qp.reshape(B, n, chunk, N, H).swapaxes(0, 1)  # [n,B,c,N,H]
    lc = lp.reshape(B, n, chunk).swapaxes(0, 1)  # [n,B,c]

    @jax.checkpoint
    def one(args):
        return packed_attention_reference(args[0], k, v, args[1])

    o, lse = jax.lax.map(one, (qc, lc))
    o = o.swapaxes(0, 1).reshape(B, n * chunk, N, H)[:, :T]
    lse = lse.swapaxes(0, 1).reshape(B, n * chunk, N)[:, :T]
    return o, lse


def attention_fn(kernels: str, mesh=None, *, causal: bool = False) -> Callable | None:
    """The attention function of the training forwards for a resolved `kernels`:
    `packed_attention_fn(mesh)` for "pallas"; for "chunked" (plain jnp: XLA partitions
    it over the mesh like any other op) `causal_chunked_attention` when `causal` (the
    caller promises limit <= t + 1 over its own keys: the target's cache-free forward),
    else `chunked_attention`; None for "reference" (the model's own jnp attention)."""
    if kernels == "pallas":
        return packed_attention_fn(mesh)
    if kernels == "chunked":
        return causal_chunked_attention if causal else chunked_attention
    return None


def causal_chunked_attention(q, k, v, limit, *, chunk: int = CHUNK_Q):
    """`chunked_attention` for a causal forward whose keys are its own queries (S = T and
    limit[b, t] <= t + 1, as in the target's cache-free training forward): chunk i of
    queries reads only the key slots below (i + 1) * chunk, a static slice, so the
    attention arithmetic is (n + 1) / 2n of reading every slot for n chunks. The chunks
    are a Python loop (each under `jax.checkpoint`). Same arguments and results as
    `chunked_attention`; a limit above t + 1 would be cut at the chunk's end (not
    checked: a traced limit has no static value). Raises ValueError if S != T."""
    from pallas_kernels.attention.packed_reference import check_args, packed_attention_reference

    B, T, N, _, _, S, H = check_args(q, k, v, limit)
    if S != T:
        raise ValueError(f"causal_chunked_attention needs S == T, got S={S}, T={T}")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be positive")
    one = jax.checkpoint(packed_attention_reference)
    outs, lses = [], []
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        o, lse = one(q[:, a:b], k[:, :, :b], v[:, :, :b], limit[:, a:b])
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def packed_attention_fn(mesh=None, *, backend: str | None = None,
                        interpret: bool | None = None) -> Callable:
    """fn(q [B,T,N,H], k, v [B,K,S,H], limit i32[B,T]) -> (o [B,T,N,H], lse f32[B,T,N]):
    `pallas_kernels.attention.packed_attention` (query t of row b sees slots
    s < limit[b, t]), under `jax.shard_map` when `mesh` has more than one device (see
    the module doc).

    backend: "tpu" (Mosaic layout) or "triton" (GPU); None: triton on GPU, else tpu.
    interpret: None (interpret mode on CPU only) or a bool."""
    from pallas_kernels.attention import packed_attention

    if backend is None:
        backend = "triton" if jax.default_backend() == "gpu" else "tpu"

    def local(q, k, v, limit):  # the kernel takes one dtype: the queries'
        return packed_attention(q, k.astype(q.dtype), v.astype(q.dtype), limit,
                                backend=backend, interpret=interpret)

    if mesh is None or mesh.size == 1:
        return local

    def sharded(q, k, v, limit):
        from specjax.train import mesh as mesh_lib

        B, N, K = q.shape[0], q.shape[2], k.shape[1]
        batch = tuple(a for a in mesh_lib.LOGICAL_RULES["batch"] if mesh.shape[a] > 1)
        rows = batch if batch and B % mesh_lib.axis_size(mesh, batch) == 0 else None
        rows = rows[0] if rows and len(rows) == 1 else rows
        M = mesh.shape["model"]
        heads = "model" if M > 1 and N % M == 0 and K % M == 0 else None
        if heads is None and M > 1:
            _log.info("kernels=pallas: %d query / %d KV heads do not split over model=%d; "
                      "the attention kernel sees every head on each device", N, K, M)
        spec_q = P(rows, None, heads, None)
        spec_kv = P(rows, heads, None, None)
        run = jax.shard_map(local, mesh=mesh,
                            in_specs=(spec_q, spec_kv, spec_kv, P(rows, None)),
                            out_specs=(spec_q, P(rows, None, heads)), check_vma=False)
        return run(q, k, v, limit)

    return sharded
