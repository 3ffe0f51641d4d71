"""HF checkpoint directories in and out: config.json + safetensors (+ tokenizer).

One name-mapping table per family (maxtext's idea): every HF tensor name maps to a
specjax parameter and, for per-layer tensors, a layer index into the stacked
weight. Loading checks that every tensor in the files is used and none is missing.
Never pickle, never remote code, never a download.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.dtypes import (
    parse_dtype,  # noqa: F401  (re-exported: its callers import it here)
    storage_dtype,
    storage_name,
)
from specjax.errors import SpecjaxError
from specjax.models.config import ModelConfig
from specjax.models.model import Transformer, layer_shapes

# HF per-layer suffix (after "model.layers.{i}.") -> stacked specjax weight.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
}
NAME_TABLES = {
    "llama": dict(_LAYER_NAMES),
    "qwen3": {**_LAYER_NAMES, "self_attn.q_norm.weight": "q_norm",
              "self_attn.k_norm.weight": "k_norm"},
}

def _expected_tensors(cfg: ModelConfig) -> dict[str, tuple[str, int | None, tuple]]:
    """HF name -> (specjax name, layer index or None, expected shape)."""
    shapes = layer_shapes(cfg)
    out = {}
    for hf_suffix, name in NAME_TABLES[cfg.family].items():
        if name in shapes:
            for i in range(cfg.num_layers):
                out[f"model.layers.{i}.{hf_suffix}"] = (name, i, shapes[name])
    V, D = cfg.vocab_size, cfg.hidden_size
    out["model.embed_tokens.weight"] = ("embed", None, (V, D))
    out["model.norm.weight"] = ("final_norm", None, (D,))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head", None, (V, D))
    return out


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise SpecjaxError(f"{index} is unreadable ({e})") from None
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    if os.path.exists(single):
        return [single]
    raise SpecjaxError(
        f"{path} has no model.safetensors or model.safetensors.index.json; "
        "specjax loads safetensors weights only"
    )


FINITE_CHUNK = 1 << 22  # elements per np.isfinite pass: a 4 MiB mask at most


def check_finite(name: str, array, where: str) -> None:
    """Raises SpecjaxError `"<where>: tensor <name> has NaN or Inf values ..."` (one line)
    unless every element of `array` is finite. Integer and bool arrays pass unchecked.

    Cheap enough for every tensor at load: one read of the data, in chunks of
    FINITE_CHUNK elements, so the temporary mask stays small however large the tensor
    (no copy of a contiguous array; bf16 through ml_dtypes works as f32 does).

    Args:
      name: the tensor's name in the file (e.g. "model.layers.0.mlp.up_proj.weight").
      array: a numpy array (np.ndarray, any float dtype incl. ml_dtypes.bfloat16).
      where: the file or directory it came from, for the message.
    Raises: SpecjaxError if any element is NaN, +Inf or -Inf."""
    array = np.asarray(array)
    if array.dtype.kind in "biu":
        return
    flat = array.reshape(-1)  # a view for contiguous arrays
    for i in range(0, flat.size, FINITE_CHUNK):
        if not np.isfinite(flat[i:i + FINITE_CHUNK]).all():
            raise SpecjaxError(f"{where}: tensor {name} has NaN or Inf values; the weights "
                               "are damaged or come from a diverged run, use a good copy")


def open_safetensors(file: str):
    """A safetensors handle of `file` (numpy framework), for `with ... as f`.

    Raises: SpecjaxError (one line) when the file is missing or not readable as
    safetensors."""
    from safetensors import safe_open

    if not os.path.isfile(file):
        raise SpecjaxError(f"{file} is listed in the safetensors index but missing")
    try:
        return safe_open(file, framework="numpy")
    except Exception as e:  # safetensors raises its own error types
        raise SpecjaxError(f"{file} is not a readable safetensors file ({e})") from None


def load_weights(path: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Reads all tensors into specjax names (stacked per layer), checking names and shapes.

    Returns: specjax name -> np.ndarray (stacked [L, ...] for per-layer weights), in
    the checkpoint's dtype.

    Raises:
      SpecjaxError naming the file and tensor: unknown tensor, missing tensor, wrong shape,
      NaN or Inf values (`check_finite`).
    """
    expected = _expected_tensors(cfg)
    seen = set()
    stacked: dict[str, list] = {}
    out: dict[str, np.ndarray] = {}
    for file in _weight_files(path):
        with open_safetensors(file) as f:
            for hf_name in f.keys():
                if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    seen.add(hf_name)  # some tied checkpoints still store it; identical copy
                    continue
                if hf_name not in expected:
                    raise SpecjaxError(
                        f"{file}: tensor {hf_name} is not used by a {cfg.family} model with "
                        f"this config.json (unexpected name)"
                    )
                name, layer, shape = expected[hf_name]
                arr = f.get_tensor(hf_name)
                if tuple(arr.shape) != tuple(shape):
                    raise SpecjaxError(
                        f"{file}: tensor {hf_name} has shape {tuple(arr.shape)}, expected "
                        f"{tuple(shape)} from config.json"
                    )
                check_finite(hf_name, arr, file)
                seen.add(hf_name)
                if layer is None:
                    out[name] = arr
                else:
                    stacked.setdefault(name, [None] * cfg.num_layers)[layer] = arr
    missing = sorted(set(expected) - seen, key=_natural_key)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise SpecjaxError(
            f"{path}: tensor {missing[0]}{more} missing from the safetensors files "
            f"(expected shape {tuple(expected[missing[0]][2])})"
        )
    for name, arrs in stacked.items():
        out[name] = np.stack(arrs)
    return out


def _natural_key(name):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def load_model(path: str, dtype=jnp.float32, matmul_dtype=None,
               cfg: ModelConfig | None = None) -> Transformer:
    """Loads a local HF Qwen3 / Llama-3 checkpoint directory into a `Transformer`.

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      dtype: parameter dtype (jnp.float32 or jnp.bfloat16).
      matmul_dtype: None (= dtype) or jnp.bfloat16 with dtype float32: the weight
        matrices (projections, embedding, LM head) are kept in bf16 and every matmul,
        attention dots included, takes bf16 inputs with f32 accumulation
        (`specjax.models.matmul.linear`); norms, softmax, activations and the KV cache stay f32. On
        XLA:CPU this makes a forward of a few tokens about 2x cheaper than f32
        (benchmarks/matmul_rows.py). A one-token and an 8-token forward give bitwise-equal
        rows there at most positions but not all (measured on the demo target: 40 of
        42 positions equal), so speculative output can differ from the bf16 target's
        own autoregressive output at near-ties; decode.py reports it
        ("identical to AR"). f32 stays exact.
      cfg: `path`'s ModelConfig when the caller has read its config.json already.

    Raises:
      SpecjaxError: missing directory or files, unsupported architecture, unknown or
        missing tensor, shape mismatch, NaN or Inf values.
    """
    if cfg is None:
        cfg = ModelConfig.from_dir(path)
    weights = load_weights(path, cfg)
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    # eval_shape gives abstract arrays; fill every parameter from the checkpoint.
    for name, arr in weights.items():
        is_matrix = name.endswith("_proj") or name in ("embed", "lm_head")
        dt = matmul_dtype if matmul_dtype is not None and is_matrix else dtype
        getattr(model, name).set_value(jnp.asarray(arr.astype(np.float32)).astype(dt))
    model.inv_freq.set_value(jnp.asarray(cfg.inv_freq(), jnp.float32))
    return model


def load_tokenizer(path: str):
    """`transformers.AutoTokenizer` for `path` when tokenizer files are present, else None."""
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # tokenizers raise many types
        raise SpecjaxError(f"{path}: tokenizer files present but unreadable ({e})") from None


def to_hf_tensors(model: Transformer, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF-named numpy tensors of `model` (inverse of `load_weights`)."""
    cfg = model.cfg
    np_dtype = storage_dtype(dtype)
    out = {}
    for hf_name, (name, layer, _) in _expected_tensors(cfg).items():
        arr = np.asarray(getattr(model, name)[...].astype(jnp.float32))
        if layer is not None:
            arr = arr[layer]
        out[hf_name] = np.ascontiguousarray(arr).astype(np_dtype)
    return out


def save_model(model: Transformer, path: str, *, dtype=jnp.float32, tokenizer=None,
               max_shard_bytes: int | None = None) -> None:
    """Writes `model` as a HF checkpoint directory that transformers and `load_model` read.

    Writes config.json, generation_config.json, model.safetensors (f32 or bf16) and,
    if given, the tokenizer. With `max_shard_bytes`, weights larger than that go to
    HF-style shards model-0000i-of-0000n.safetensors plus model.safetensors.index.json
    (a tensor is never split). The directory appears complete or not at all: files are
    written into a temporary sibling directory that is renamed at the end.
    """

    cfg = model.cfg
    dtype_name = storage_name(dtype)
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    try:
        hf_cfg = cfg.to_hf_config(dtype=dtype_name)
        hf_cfg.architectures = ["Qwen3ForCausalLM" if cfg.family == "qwen3" else "LlamaForCausalLM"]
        hf_cfg.save_pretrained(tmp)
        gen = {"_from_model_config": True}
        if cfg.eos_token_ids:
            gen["eos_token_id"] = (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                                   else cfg.eos_token_ids[0])
        if cfg.bos_token_id is not None:
            gen["bos_token_id"] = cfg.bos_token_id
        if cfg.pad_token_id is not None:
            gen["pad_token_id"] = cfg.pad_token_id
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
        _save_tensors(to_hf_tensors(model, dtype), tmp, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_tensors(tensors: dict, directory: str, max_shard_bytes: int | None) -> None:
    """model.safetensors, or shards of at most `max_shard_bytes` plus the HF index."""
    from safetensors.numpy import save_file

    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return
    shards, size = [{}], 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def fingerprint(path: str, chunk: int = 1 << 20) -> str:
    """A cheap identity of the weights in an HF checkpoint directory (hex sha256 over each
    weight file's name, size, first and last `chunk` bytes): retraining or re-saving the
    model changes it; reading it costs at most 2 MiB per file, whatever the model size.
    A drafter records its target's fingerprint so that a mismatch is caught at load.

    Raises: SpecjaxError if the directory holds no safetensors weights.
    """
    import hashlib

    h = hashlib.sha256()
    for name in _weight_files(path):
        size = os.path.getsize(name)
        h.update(f"{os.path.basename(name)}:{size}:".encode())
        with open(name, "rb") as f:
            h.update(f.read(chunk))
            if size > chunk:
                f.seek(max(size - chunk, chunk))
                h.update(f.read(chunk))
    return h.hexdigest()
