"""The one table of dtype names: what `--dtype`-style flags and config fields may say,
and the jnp dtype each means. specjax computes in float32 or bfloat16 only."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32,
          "bf16": jnp.bfloat16}


def parse_dtype(name: str):
    """'float32'/'f32' or 'bfloat16'/'bf16' -> the jnp dtype.

    Raises: SpecjaxError (one line) for any other name."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise SpecjaxError(f"unknown dtype {name!r}; use float32 or bfloat16") from None


def numpy_dtype(name: str) -> np.dtype:
    """A dtype name of `DTYPES` -> its numpy dtype (ml_dtypes' bfloat16 for bfloat16),
    for host arrays and byte counts.

    Raises: SpecjaxError (one line) for any other name."""
    return np.dtype(parse_dtype(name))


def storage_name(dtype) -> str:
    """How specjax stores weights of `dtype` (safetensors files, exports): "bfloat16" for
    bf16 (a jnp dtype, ml_dtypes' bfloat16 or the name), "float32" for anything else."""
    import ml_dtypes

    bf16 = dtype == "bfloat16" or dtype in (jnp.bfloat16, ml_dtypes.bfloat16)
    return "bfloat16" if bf16 else "float32"


def storage_dtype(dtype) -> np.dtype:
    """The numpy dtype of `storage_name(dtype)` (ml_dtypes' bfloat16 or float32)."""
    return numpy_dtype(storage_name(dtype))


def backend_default(backend: str | None = None):
    """The compute dtype "auto" means: float32 on the CPU backend (bfloat16 is slower
    there), bfloat16 on TPU and GPU."""
    import jax

    return jnp.float32 if (backend or jax.default_backend()) == "cpu" else jnp.bfloat16
