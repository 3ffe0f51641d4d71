"""Memory arithmetic from configs alone: bytes of weights, KV caches and the largest
activations, so that decode.py can refuse what cannot fit before allocating anything.

All figures are bytes, estimates from shapes (no allocation, no weights read):
  target weights  num_params * itemsize
  KV cache        2 (k, v) * L * B * K * S * H * itemsize  (layer-major [L,B,K,S,H])
  activations     the prefill's f32 logits [B,P,V] and one layer's f32 scores [B,N,P,S]

`decode_plan` and `train_plan` give per-device figures on a mesh; the command line
(`python -m specjax.plan`) is `specjax.tools.plan`.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def itemsize(dtype) -> int:
    """Bytes per element of a numpy/jax dtype."""
    return int(np.dtype(dtype).itemsize)


def kv_cache_bytes(num_layers: int, batch: int, num_kv_heads: int, capacity: int,
                   head_dim: int, dtype) -> int:
    """Keys and values of a [L,B,K,S,H] cache."""
    return 2 * num_layers * batch * num_kv_heads * capacity * head_dim * itemsize(dtype)


def weight_bytes(cfg, dtype) -> int:
    """The target's parameters (a `specjax.models.config.ModelConfig`) in `dtype`."""
    return int(cfg.num_params) * itemsize(dtype)


def prefill_activation_bytes(cfg, batch: int, prompt_width: int, capacity: int) -> int:
    """The prefill's largest live f32 arrays: logits [B,P,V] and one layer's attention
    scores and probabilities [B,N,P,S] (XLA may keep both of the latter)."""
    logits = batch * prompt_width * cfg.vocab_size * 4
    scores = 2 * batch * cfg.num_heads * prompt_width * capacity * 4
    return logits + scores


def available_bytes() -> tuple[int | None, str]:
    """(bytes free for arrays on the default device, its description); (None, ...) when
    unknown. Accelerators: bytes_limit - bytes_in_use from jax's memory_stats; CPU: the
    host's MemAvailable (/proc/meminfo), else physical memory."""
    import jax

    dev = jax.devices()[0]
    stats = None
    try:
        stats = dev.memory_stats()
    except Exception:  # backends without memory stats raise or return None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), str(dev.device_kind)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host memory (MemAvailable)"
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def fmt_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


# ------------------------------------------------------------------ per-device plan

class _Mesh:
    """Axis sizes only: enough for `specjax.mesh.logical_spec` (no devices)."""

    def __init__(self, data: int = 1, fsdp: int = 1, model: int = 1):
        self.shape = {"data": data, "fsdp": fsdp, "model": model}


def _local_bytes(shape, logical, mesh: _Mesh, dtype) -> int:
    """Bytes of one device's shard of an array of `shape` with logical axes `logical`
    (None: replicated), under the training rules (`logical_spec`)."""
    from specjax.mesh import logical_spec

    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if logical is None:
        return n * itemsize(dtype)
    spec = logical_spec(mesh, logical, tuple(shape))
    split = 1
    for axes in spec:
        if axes is None:
            continue
        for a in (axes,) if isinstance(axes, str) else axes:
            split *= mesh.shape[a]
    return n // split * itemsize(dtype)


def params_bytes_per_device(abstract_params, mesh: _Mesh, dtype, heads=None) -> int:
    """Per-device bytes of an nnx.State of parameters (abstract is enough) sharded by
    `specjax.mesh.PARAM_AXES` / LOGICAL_RULES; with heads=(N, K), as decoding
    shards them (`specjax.decoding.sharding`: heads kept whole, replicated where `model` does not
    divide N or K)."""
    from flax import nnx

    from specjax.decoding.sharding import whole_heads
    from specjax.mesh import PARAM_AXES, param_axes

    total = 0
    for path, var in nnx.to_flat_state(abstract_params):
        shape = tuple(var.get_value().shape)
        name = next((str(p) for p in reversed(path) if str(p) in PARAM_AXES), None)
        logical = None if name is None else param_axes(name, len(shape))
        if logical is not None and heads is not None:
            logical = whole_heads(logical, mesh, *heads)
        total += _local_bytes(shape, logical, mesh, dtype)
    return total


def abstract_target(cfg):
    """The target's parameters as an abstract nnx.State (no memory)."""
    from flax import nnx

    from specjax.models.model import Transformer

    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param, ...)[1]


def abstract_drafter(dcfg):
    """A drafter network's own parameters as an abstract nnx.State."""
    from flax import nnx

    from specjax.drafters import build_network

    net = nnx.eval_shape(lambda: build_network(dcfg, rngs=nnx.Rngs(0)))
    return nnx.split(net, nnx.Param, ...)[1]


def decode_plan(cfg, mesh: _Mesh, batch: int, max_length: int, dtype, *, dcfg=None,
                prompt_width: int | None = None, gamma: int = 7) -> dict:
    """Per-device bytes for decoding: {"target weights", "KV cache", "drafter weights",
    "drafter state", "prefill activations"}. Weights sharded as decoding shards them
    (`specjax.decoding.sharding`: heads, F and V over `model`, a head never cut); the KV cache
    [L,B,K,S,H] splits B over data x fsdp and K over model (replicated when model does
    not divide K, as vLLM does)."""
    from specjax.decoding.sharding import whole_heads

    S = max_length + gamma + 1
    P = prompt_width or min(max_length, 512)

    heads = (cfg.num_heads, cfg.num_kv_heads)
    out = {"target weights": params_bytes_per_device(abstract_target(cfg), mesh, dtype, heads)}
    kv_logical = whole_heads(("layers", "batch", "kv_heads", "seq", None), mesh, *heads)
    kv_shape = (cfg.num_layers, batch, cfg.num_kv_heads, S, cfg.head_dim)
    out["KV cache"] = 2 * _local_bytes(kv_shape, kv_logical, mesh, dtype)
    if dcfg is not None:
        out["drafter weights"] = params_bytes_per_device(
            abstract_drafter(dcfg), mesh, dtype, (dcfg.num_heads, dcfg.num_kv_heads))
        layers = dcfg.spec.state_layers(dcfg)  # the kind's decoding-state caches
        out["drafter state"] = 2 * _local_bytes((max(layers, 1), batch, cfg.num_kv_heads, S,
                                                 cfg.head_dim), kv_logical, mesh, dtype)
    rows = max(batch // (mesh.shape["data"] * mesh.shape["fsdp"]), 1)
    v_local = cfg.vocab_size // mesh.shape["model"] if cfg.vocab_size % mesh.shape["model"] == 0 \
        else cfg.vocab_size
    n_local = cfg.num_heads // mesh.shape["model"] if cfg.num_heads % mesh.shape["model"] == 0 \
        else cfg.num_heads
    out["prefill activations"] = rows * P * v_local * 4 + 2 * rows * n_local * P * S * 4
    return out


def train_plan(cfg, mesh: _Mesh, batch: int, seq_len: int, *, dcfg=None, objective="lm",
               ttt_positions: int = 64, num_anchors: int = 32, dtype=np.float32) -> dict:
    """Per-device bytes for one training step (estimates): the trained parameters with
    their gradients and AdamW's two moments (f32), the frozen target (drafter objectives,
    no optimizer state), and the largest activations (f32 logits kept for the backward
    pass, and per layer B x T x (4D + 3F) f32 for an lm)."""
    rows = max(batch // (mesh.shape["data"] * mesh.shape["fsdp"]), 1)
    M = mesh.shape["model"]
    v_local = cfg.vocab_size // M if cfg.vocab_size % M == 0 else cfg.vocab_size
    out = {}
    if objective == "lm":
        p = params_bytes_per_device(abstract_target(cfg), mesh, np.float32)
        out["parameters (f32)"] = p
        out["gradients + AdamW moments (f32)"] = 3 * p
        width = 4 * cfg.hidden_size + 3 * cfg.intermediate_size // (
            M if cfg.intermediate_size % M == 0 else 1)
        out["activations"] = rows * seq_len * (cfg.num_layers * width + 2 * v_local) * 4
        return out
    out["frozen target"] = params_bytes_per_device(abstract_target(cfg), mesh, dtype)
    p = params_bytes_per_device(abstract_drafter(dcfg), mesh, np.float32)
    out["drafter parameters (f32)"] = p
    out["gradients + AdamW moments (f32)"] = 3 * p
    target_acts = rows * seq_len * v_local * 4 * 2  # logits and the soft-label softmax
    target_acts += rows * seq_len * cfg.hidden_size * 4 * len(dcfg.capture)
    target_acts += 2 * rows * seq_len * cfg.num_kv_heads * cfg.head_dim * 4 * len(dcfg.kv_layers)
    out["target activations"] = target_acts
    if objective == "ttt":
        chains = rows * min(ttt_positions or seq_len, seq_len)
        out["drafter activations"] = dcfg.gamma * chains * (
            2 * v_local + 6 * cfg.hidden_size + 3 * dcfg.intermediate_size) * 4
    else:
        slots = rows * num_anchors * (dcfg.gamma + 1)
        out["drafter activations"] = slots * (2 * v_local + dcfg.num_layers * (
            6 * cfg.hidden_size + 3 * dcfg.intermediate_size)) * 4
    return out


# ------------------------------------------------------------------ from text

def parse_mesh(text: str) -> _Mesh:
    """Axis sizes from "data=D,model=M[,fsdp=F]" (`--mesh`); SpecjaxError otherwise."""
    from specjax.errors import SpecjaxError

    sizes = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("data", "fsdp", "model") or not value.strip().isdigit() \
                or int(value) < 1:
            raise SpecjaxError(f"--mesh {text!r}: use data=D,model=M[,fsdp=F] with "
                               "positive integers")
        sizes[key.strip()] = int(value)
    return _Mesh(**sizes)


def drafter_config(arg: str, cfg, gamma: int):
    """A DrafterConfig from a drafter directory or a kind ("eagle3", "kv", "hybrid",
    "block" or "block:kv" / "block:both")."""
    from specjax.drafters.config import DrafterConfig

    if os.path.isdir(arg):
        from specjax.drafters.io import read_config

        raw = {k: v for k, v in read_config(arg).items() if k not in ("target", "train")}
        return DrafterConfig.from_json_dict(raw, where=arg)
    kind, _, context = arg.partition(":")
    return DrafterConfig.for_target(cfg, kind, gamma=gamma, context=context or None)


if __name__ == "__main__":  # `python -m specjax.plan`: specjax.tools.plan
    from specjax.tools.plan import main

    sys.exit(main())
