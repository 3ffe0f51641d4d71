"""The training side of the device mesh: the batch's logical axes, its sharding, and
host <-> global arrays. The mesh, the logical-axis rules and the parameter shardings are
`specjax.mesh`'s (decoding uses them too), re-exported here.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from specjax.errors import SpecjaxError
from specjax.mesh import (  # noqa: F401  (re-exported: the trainer's mesh_lib.* names)
    LOGICAL_RULES,
    MESH_AXES,
    PARAM_AXES,
    MeshConfig,
    axis_size,
    logical_spec,
    make_mesh,
    mesh_shape,
    param_axes,
    param_name,
    replicated,
    tree_shardings,
)
from specjax.train.config import TrainLoopConfig

BATCH_AXES = ("accum", "batch", "seq")  # training batch i32[A, B/A, T+1]
EVAL_BATCH_AXES = ("batch", "seq")  # validation batch i32[B, T+1]


def check_batch(mesh: jax.sharding.Mesh, loop: TrainLoopConfig) -> None:
    """Raises SpecjaxError unless each micro-batch splits evenly over data*fsdp devices."""
    rows = axis_size(mesh, LOGICAL_RULES["batch"])
    if loop.micro_batch % rows:
        raise SpecjaxError(
            f"train.batch_size={loop.batch_size} / train.grad_accum={loop.grad_accum} = "
            f"{loop.micro_batch} rows per micro-step is not divisible by data*fsdp={rows}; "
            f"use a batch size that is a multiple of {rows * loop.grad_accum}")


def batch_sharding(mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of a training batch i32[A, B/A, T+1] (or a validation batch [B, T+1])."""
    axes = BATCH_AXES if len(shape) == 3 else EVAL_BATCH_AXES
    return NamedSharding(mesh, logical_spec(mesh, axes, shape))


def host_to_global(rows: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global batch as one jax.Array; each process places only the rows of its own
    devices (its addressable shards), whatever the order of the mesh's devices.

    Args:
      rows: the GLOBAL batch, the same on every process (computed from the same
        deterministic stream), e.g. i32[A, B/A, T+1] or i32[B, T+1].
      sharding: the batch's NamedSharding.
    """
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def host_tree(tree):
    """A tree of (sharded) arrays as host numpy arrays, gathered from every process when
    several run (a collective: call it on every process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)
