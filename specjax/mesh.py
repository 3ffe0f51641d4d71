"""The device mesh and the one table of logical-axis rules, shared by decoding
(`specjax.decoding.sharding`) and training (`specjax.train.mesh`, which adds the batch layout).

Mesh axes (jax.make_mesh, all `AxisType.Auto`, docs/design.md 9):
  data   pure data parallelism: parameters replicated, batch rows split
  fsdp   batch rows split AND parameters split along their embed (D) axis (ZeRO-3)
  model  tensor parallelism: heads, MLP width F and vocabulary V split

Every array names its axes with logical names (PARAM_AXES here, the training batch's in
`specjax.train.mesh`); LOGICAL_RULES maps each logical name to mesh axes. A dimension
that the mapped mesh axes do not divide stays replicated (e.g. K = 2 KV heads on model =
4), so any mesh runs any model.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh (data, fsdp, model). At most one axis may be -1: all remaining
    devices. The product must divide the device count; a smaller mesh uses the first
    devices (one process only)."""

    data: int = -1
    fsdp: int = 1
    model: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.model)
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise SpecjaxError(f"mesh {self.data}x{self.fsdp}x{self.model}: each axis must be "
                               ">= 1, and at most one may be -1 (all remaining devices)")



MESH_AXES = ("data", "fsdp", "model")

# logical axis -> mesh axis, axes, or None (replicated). The only such table.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "features": None,  # a drafter's concatenated inputs (C*D, 3D, D, Ls*K*H): the other
                       # dimension of the same matrix is the one split
    "layers": None,
    "norm": None,
    "seq": None,
    "accum": None,
}

# Parameter name -> logical axes (HF [out, in] layout; layer weights stacked on L or Ld).
# A name whose arrays come in several ranks (a drafter's norm [D] or stacked [Ld,D]) maps
# to a tuple of rules, one per rank; see `param_axes`.
PARAM_AXES: dict[str, tuple[str, ...] | tuple[tuple[str, ...], ...]] = {
    # the Transformer (model.py) and the drafters' decoder layers (layers.py)
    "embed": ("vocab", "embed"),  # [V, D]
    "lm_head": ("vocab", "embed"),  # [V, D]
    "final_norm": (("norm",), ("layers", "norm")),  # [D] (drafters: [D] or [Ld, D])
    "input_norm": ("layers", "norm"),  # [L, D]
    "post_norm": ("layers", "norm"),  # [L, D]
    "q_norm": ("layers", "norm"),  # [L, H]
    "k_norm": ("layers", "norm"),  # [L, H]
    "q_proj": ("layers", "heads", "embed"),  # [L, N*H, D]; eagle3/hybrid [1, N*H, 2D]
    "k_proj": ("layers", "kv_heads", "embed"),  # [L, K*H, D]; eagle3/hybrid [1, K*H, 2D]
    "v_proj": ("layers", "kv_heads", "embed"),  # [L, K*H, D]; eagle3/hybrid [1, K*H, 2D]
    "o_proj": ("layers", "embed", "heads"),  # [L, D, N*H]
    "gate_proj": ("layers", "mlp", "embed"),  # [L, F, D]
    "up_proj": ("layers", "mlp", "embed"),  # [L, F, D]
    "down_proj": ("layers", "embed", "mlp"),  # [L, D, F]
    "q_bias": ("layers", "heads"),  # [L, N*H]
    "k_bias": ("layers", "kv_heads"),  # [L, K*H]
    "v_bias": ("layers", "kv_heads"),  # [L, K*H]
    "o_bias": ("layers", "norm"),  # [L, D]
    # drafters only (docs/design.md 5)
    "fc": ("embed", "features"),  # [D, C*D]: target features -> D
    "embed_norm": (("norm",), ("layers", "norm")),  # [D]
    "hidden_norm": (("norm",), ("layers", "norm")),  # [D]
    "merge_k": ("layers", "kv_heads", "features"),  # [Lm, K*H, Ls*K*H]
    "merge_v": ("layers", "kv_heads", "features"),  # [Lm, K*H, Ls*K*H]
    "cross_q": ("heads", "embed"),  # [N*H, D]  hybrid's cross-attention path
    "cross_q_norm": ("norm",),  # [H]
    "cross_o": ("embed", "heads"),  # [D, N*H]
    "cross_norm": ("norm",),  # [D]
    "gate_w": ("embed", "features"),  # [D, 3D]  hybrid's gate over [n; o; o - n]
    "gate_b": ("norm",),  # [D]
    "gate_d": ("embed", "features"),  # [D, D]
}


def param_axes(name: str, rank: int) -> tuple[str, ...] | None:
    """The logical axes of parameter `name` at this rank, or None (no rule: replicated)."""
    rules = PARAM_AXES.get(name)
    if rules is None:
        return None
    if isinstance(rules[0], str):
        rules = (rules,)
    return next((r for r in rules if len(r) == rank), None)


def mesh_shape(cfg: MeshConfig, device_count: int) -> tuple[int, int, int]:
    """(data, fsdp, model) with a -1 axis filled in.

    Raises: SpecjaxError if the mesh does not divide `device_count`.
    """
    sizes = [cfg.data, cfg.fsdp, cfg.model]
    fixed = math.prod(s for s in sizes if s != -1)
    if device_count % fixed:
        raise SpecjaxError(f"mesh {'x'.join(map(str, sizes))} (data x fsdp x model) does not "
                           f"divide the {device_count} devices; use sizes whose product "
                           f"divides {device_count}")
    return tuple(device_count // fixed if s == -1 else s for s in sizes)


def make_mesh(cfg: MeshConfig) -> jax.sharding.Mesh:
    """The (data, fsdp, model) mesh over the first data*fsdp*model devices.

    Raises: SpecjaxError for a mesh that does not divide the device count, or one
    smaller than the device count when several processes run.
    """
    devices = jax.devices()
    shape = mesh_shape(cfg, len(devices))
    n = math.prod(shape)
    if n < len(devices) and jax.process_count() > 1:
        raise SpecjaxError(f"mesh {'x'.join(map(str, shape))} uses {n} of {len(devices)} "
                           "devices; with several processes the mesh must use all devices")
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices[:n])


def axis_size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def logical_spec(mesh, logical: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
    """PartitionSpec for an array of `shape` with logical axis names `logical`.

    A dimension whose mapped mesh axes do not divide it (or that maps to a mesh axis
    already used by an earlier dimension) is replicated.
    """
    used: set[str] = set()
    spec = []
    for name, size in zip(logical, shape, strict=True):
        axes = LOGICAL_RULES[name] if name is not None else None
        tup = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        tup = tuple(a for a in tup if mesh.shape[a] > 1)
        if not tup or used & set(tup) or size % axis_size(mesh, tup):
            spec.append(None)
            continue
        used |= set(tup)
        spec.append(tup[0] if len(tup) == 1 else tup)
    return P(*spec)


def param_name(path) -> str | None:
    """The parameter a tree path goes through (params, mu, nu, ...): the innermost key
    that names one (a drafter's submodule may carry another parameter's name)."""
    found = None
    for key in path:
        name = getattr(key, "key", None)
        if isinstance(name, str) and name in PARAM_AXES:
            found = name
    return found


def tree_shardings(mesh, abstract_tree):
    """NamedShardings for a tree of arrays (params, optimizer state, a train state):
    a leaf under a parameter's name gets that parameter's spec for its rank (see
    `param_axes`); everything else (step counters, RNG, scalars) is replicated."""

    def one(path, leaf):
        name = param_name(path)
        shape = tuple(np.shape(leaf))
        axes = None if name is None else param_axes(name, len(shape))
        if axes is not None:
            return NamedSharding(mesh, logical_spec(mesh, axes, shape))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, abstract_tree)


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
