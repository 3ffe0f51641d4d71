"""Exported drafter directories: what train.py writes for a ttt / block run.

    save_drafter("runs/eagle3/drafter", dcfg, params, "checkpoints/demo/target", jnp.bfloat16)
    dcfg, params, target = load_drafter("runs/eagle3/drafter")

A drafter directory holds
  config.json        `DrafterConfig.to_json_dict()` plus
                     "target": {"path", "config_sha256", "weights_fingerprint",
                     "num_params", "vocab_size"}: the target it was trained against
                     (config_sha256: sha256 of the bytes of that target's config.json;
                     weights_fingerprint: `checkpoint.fingerprint`), and optionally "train": a record of the
                     run that selected these weights ({"objective", "step", "tau", ...});
  model.safetensors  ONLY the drafter's own weights (the target's embedding and LM head
                     are not copied), named by their nnx path ("fc", "q_proj", ...; a
                     nested module's "sub.w"), float32 or bfloat16.
The directory is written into a temporary sibling and renamed: it is complete or absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.config import CONFIG_NAME, FORMAT, DrafterConfig
from specjax.dtypes import storage_dtype
from specjax.errors import SpecjaxError
from specjax.fileio import read_config_json

WEIGHTS_NAME = "model.safetensors"


def target_record(target_dir: str) -> dict:
    """{"path", "config_sha256", "weights_fingerprint", "num_params", "vocab_size"} of the
    HF target at `target_dir` (path as given; fingerprint: `checkpoint.fingerprint`, which
    decode.py compares to refuse a drafter trained against other weights).

    Raises: SpecjaxError if its config.json or weights are missing or unreadable."""
    from specjax.models.checkpoint import fingerprint
    from specjax.models.config import ModelConfig

    cfg = ModelConfig.from_dir(target_dir)
    with open(os.path.join(target_dir, "config.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"path": target_dir, "config_sha256": digest,
            "weights_fingerprint": fingerprint(target_dir), "num_params": int(cfg.num_params),
            "vocab_size": int(cfg.vocab_size)}


def param_tensors(params: nnx.State, dtype=jnp.float32) -> dict[str, np.ndarray]:
    """Host numpy tensors of an nnx.State of parameters, named by their dotted nnx path,
    in f32 or bf16 (`dtype`). Sharded arrays are gathered (one process)."""
    np_dtype = storage_dtype(dtype)
    out = {}
    for path, var in nnx.to_flat_state(params):
        arr = np.asarray(jnp.asarray(var.get_value()).astype(jnp.float32))
        out[".".join(map(str, path))] = np.ascontiguousarray(arr).astype(np_dtype)
    return out


def save_drafter(path: str, dcfg: DrafterConfig, params: nnx.State, target_dir: str,
                 dtype=jnp.float32, *, train_record: dict | None = None) -> None:
    """Writes the drafter directory `path` (replacing an existing one).

    Args:
      path: the directory to write.
      dcfg: the drafter's config.
      params: nnx.State of the drafter network's nnx.Param leaves (host or device arrays).
      target_dir: the HF directory of the target it was trained against (recorded).
      dtype: safetensors dtype, jnp.float32 or jnp.bfloat16.
      train_record: optional JSON-able dict stored as config.json's "train".
    Raises: SpecjaxError if target_dir has no readable config.json.
    """
    from safetensors.numpy import save_file

    raw = {**dcfg.to_json_dict(), "target": target_record(target_dir)}
    if train_record is not None:
        raw["train"] = train_record
    tensors = param_tensors(params, dtype)
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-drafter-", dir=parent)
    old = None
    try:
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(raw, f, indent=2)
        save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "specjax"})
        for name in (CONFIG_NAME, WEIGHTS_NAME):  # mkdtemp and safetensors make them private
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=".old-drafter-", dir=parent)
            os.replace(path, os.path.join(old, "d"))
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.exists(path):
            with contextlib.suppress(OSError):
                os.replace(os.path.join(old, "d"), path)  # put the previous one back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def read_config(path: str) -> dict:
    """The raw config.json of drafter directory `path`.

    Raises: SpecjaxError for a missing directory or file, invalid JSON, or a config.json
      that is not a specjax drafter's."""
    raw = read_config_json(path, "drafter", fix="re-export it with train.py",
                           hint="pass a directory written by train.py (objective ttt or block)")
    cfg_path = os.path.join(path, CONFIG_NAME)
    if raw.get("format") != FORMAT:
        raise SpecjaxError(f"{cfg_path} is not a specjax drafter config (format != {FORMAT!r}); "
                           "pass a directory written by train.py")
    return raw


def load_drafter(path: str, dtype=jnp.float32, config: dict | None = None
                 ) -> tuple[DrafterConfig, nnx.State, dict]:
    """Reads a drafter directory written by `save_drafter`.

    Args:
      path: the directory.
      dtype: parameter dtype of the returned state (jnp.float32 or jnp.bfloat16).
      config: its config.json when the caller has read it already (a specjax drafter
        config, format checked by the caller; else read here with `read_config`).
    Returns: (DrafterConfig, nnx.State of the network's nnx.Param leaves with the stored
      weights (jax arrays), target record dict ({} if none was recorded)).
    Raises: SpecjaxError for a missing or corrupt config.json or safetensors file, and a
      missing, unexpected or wrongly shaped tensor, or one with NaN or Inf values.
    """
    from specjax import drafters
    from specjax.models.checkpoint import check_finite, open_safetensors

    raw = read_config(path) if config is None else config
    target = raw.get("target") or {}
    if not isinstance(target, dict):
        raise SpecjaxError(f"{os.path.join(path, CONFIG_NAME)}: \"target\" must be a JSON "
                           "object (the record of the target it was trained against)")
    fields = {k: v for k, v in raw.items() if k != "train"}
    dcfg = DrafterConfig.from_json_dict(fields, where=os.path.join(path, CONFIG_NAME))
    abstract = nnx.eval_shape(lambda: drafters.build_network(dcfg, dtype=dtype,
                                                             rngs=nnx.Rngs(0)))
    _, params, _ = nnx.split(abstract, nnx.Param, ...)
    expected = {".".join(map(str, p)): var for p, var in nnx.to_flat_state(params)}
    file = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(file):
        raise SpecjaxError(f"{file} is missing; re-export the drafter with train.py")
    seen = set()
    with open_safetensors(file) as f:
        for name in f.keys():
            if name not in expected:
                raise SpecjaxError(f"{file}: tensor {name} is not a weight of a {dcfg.kind} "
                                   "drafter with this config.json (unexpected name)")
            var = expected[name]
            arr = f.get_tensor(name)
            want = tuple(var.get_value().shape)
            if tuple(arr.shape) != want:
                raise SpecjaxError(f"{file}: tensor {name} has shape {tuple(arr.shape)}, "
                                   f"expected {want} from config.json")
            check_finite(name, arr, file)
            var.set_value(jnp.asarray(arr.astype(np.float32)).astype(dtype))
            seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise SpecjaxError(f"{file}: tensor {missing[0]}{more} missing (expected shape "
                           f"{tuple(expected[missing[0]].get_value().shape)})")
    return dcfg, params, target
