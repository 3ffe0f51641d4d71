"""Decoding over a device mesh: the target's weights and KV cache sharded over the
`model` axis (heads, MLP width F, vocabulary V) and batch rows over `data`, by the same
logical-axis rules as training (`specjax.mesh.LOGICAL_RULES`, the only table).

    mesh = decode_mesh("data=2,model=4")            # over the first 8 devices
    engine = Engine(target, ..., mesh=mesh)          # weights, cache and rows placed

The loop itself is unchanged: its inputs carry NamedShardings, the KV cache gets a
sharding constraint where it is created, and XLA's SPMD partitioner inserts the
collectives (the all-reduce after `o_proj` and `down_proj`, the all-gather of the
vocabulary-split logits), as in Megatron-style tensor parallelism.

Heads are never split inside a head: where the mesh's model axis does not divide the
query heads N or the KV heads K, that projection (and for K, the cache) is replicated
over the model axis instead, as vLLM replicates KV heads when K < the tensor-parallel
size. The output is the one-device output up to the order of floating-point sums.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.errors import SpecjaxError
from specjax.mesh import LOGICAL_RULES, MeshConfig, logical_spec, make_mesh, param_axes, param_name

CACHE_AXES = ("layers", "batch", "kv_heads", "seq", "norm")  # k, v [L,B,K,S,H]


def parse_mesh(text: str) -> MeshConfig:
    """"data=D,model=M[,fsdp=F]" -> MeshConfig. Raises SpecjaxError on anything else."""
    sizes = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in ("data", "fsdp", "model") or not value.isdigit() or int(value) < 1 \
                or key in sizes:
            raise SpecjaxError(f"--mesh {text!r}: use data=D,model=M (positive integers, "
                               "each axis once; fsdp=F optional)")
        sizes[key] = int(value)
    return MeshConfig(data=sizes.get("data", 1), fsdp=sizes.get("fsdp", 1),
                      model=sizes.get("model", 1))


def decode_mesh(spec: str | MeshConfig) -> jax.sharding.Mesh:
    """The (data, fsdp, model) mesh for decoding over the first D*F*M devices.

    Raises: SpecjaxError when D*F*M exceeds or does not divide the device count."""
    cfg = parse_mesh(spec) if isinstance(spec, str) else spec
    n, have = cfg.data * cfg.fsdp * cfg.model, jax.device_count()
    if n > have:
        raise SpecjaxError(f"--mesh data={cfg.data},model={cfg.model}"
                           f"{f',fsdp={cfg.fsdp}' if cfg.fsdp > 1 else ''} needs {n} devices; "
                           f"{have} are visible ({jax.default_backend()}); on CPU set "
                           f"JAX_NUM_CPU_DEVICES={n} to simulate them")
    return make_mesh(cfg)


def rows_per_shard(mesh) -> int:
    """How many ways batch rows are split (data x fsdp)."""
    axes = LOGICAL_RULES["batch"]
    return math.prod(mesh.shape[a] for a in axes)


def check_batch(mesh, batch_size: int) -> None:
    """Raises SpecjaxError unless `batch_size` rows split evenly over data x fsdp."""
    rows = rows_per_shard(mesh)
    if batch_size % rows:
        raise SpecjaxError(f"--batch-size {batch_size} does not split over the mesh's "
                           f"data axis ({rows}); use a multiple of {rows}")


def whole_heads(axes, mesh, num_heads: int, num_kv_heads: int):
    """`axes` with "heads" / "kv_heads" dropped (replicated) where the model axis does not
    divide N / K: a split inside a head would cut H. `mesh`: anything with a
    `.shape` dict holding "model"."""
    m = mesh.shape["model"]
    drop = {"heads": num_heads % m != 0, "kv_heads": num_kv_heads % m != 0}
    return tuple(None if drop.get(a, False) else a for a in axes)


def param_shardings(mesh, params, num_heads: int, num_kv_heads: int):
    """NamedShardings for a decoding params tree (a target's or a drafter's nnx.State):
    the training rules (`specjax.mesh.PARAM_AXES`), also for layer weights that
    `specjax.models.model.decoding_params` unstacked into per-layer tuples (their rule minus the
    leading layer axis); heads kept whole (see `whole_heads`); the rest replicated."""

    def one(path, leaf):
        name = param_name(path)
        shape = tuple(leaf.shape)
        unstacked = any(isinstance(k, jax.tree_util.SequenceKey) for k in path)
        axes = None if name is None else param_axes(name, len(shape) + unstacked)
        if axes is None:
            return NamedSharding(mesh, P())
        axes = whole_heads(axes[1:] if unstacked else axes, mesh, num_heads, num_kv_heads)
        logical = tuple(a if a is not None else "norm" for a in axes)  # "norm": replicated
        return NamedSharding(mesh, logical_spec(mesh, logical, shape))

    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(mesh, params, num_heads: int, num_kv_heads: int):
    """`params` placed on `mesh` by `param_shardings`."""
    return jax.device_put(params, param_shardings(mesh, params, num_heads, num_kv_heads))


def cache_sharding(mesh, shape: tuple[int, ...], num_heads: int) -> NamedSharding:
    """Sharding of a KV cache array [L,B,K,S,H]: rows over data, KV heads over model
    (replicated when the model axis does not divide K or N)."""
    axes = whole_heads(CACHE_AXES, mesh, num_heads, shape[2])
    return NamedSharding(mesh, logical_spec(mesh, tuple(a or "norm" for a in axes), shape))


def rows_sharding(mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of a per-row input: i32[B] or i32[B,T], rows over data x fsdp."""
    return NamedSharding(mesh, logical_spec(mesh, ("batch", "seq")[:len(shape)], shape))
