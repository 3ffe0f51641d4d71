"""Memory arithmetic from configs alone: bytes of weights, KV caches and the largest
activations, so that decode.py can refuse what cannot fit before allocating anything.

All figures are bytes, estimates from shapes (no allocation, no weights read):
  target weights  num_params * itemsize
  KV cache        2 (k, v) * L * B * K * S * H * itemsize  (layer-major [L,B,K,S,H])
  activations     the prefill's f32 logits [B,P,V] and one layer's f32 scores [B,N,P,S]
"""

from __future__ import annotations

import os

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


# ------------------------------------------------------------------ command line

def _parse_mesh(text: str) -> _Mesh:
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


def _drafter_config(arg: str, cfg, gamma: int):
    """A DrafterConfig from a drafter directory or a kind ("eagle3", "kv", "hybrid",
    "block" or "block:kv" / "block:both")."""
    from specjax.drafters.config import DrafterConfig

    if os.path.isdir(arg):
        from specjax.drafters.io import read_config

        raw = {k: v for k, v in read_config(arg).items() if k not in ("target", "train")}
        return DrafterConfig.from_json_dict(raw, where=arg)
    kind, _, context = arg.partition(":")
    return DrafterConfig.for_target(cfg, kind, gamma=gamma, context=context or None)


def main(argv=None) -> int:
    import sys

    from specjax import cli
    from specjax.errors import SpecjaxError

    ap = cli.ArgumentParser(
        prog="python -m specjax.plan",
        description="Per-device memory of decoding and of training, from configs alone.")
    ap.add_argument("--config", required=True, help="the target's HF config.json (or its dir)")
    from specjax.drafters import registry

    ap.add_argument("--drafter", help="a drafter directory, or a kind: "
                                      f"{', '.join(registry.kinds())} (block:kv, block:both: "
                                      "a block drafter's context)")
    ap.add_argument("--mesh", default="data=1,model=1", help="data=D,model=M[,fsdp=F]")
    ap.add_argument("--max-length", type=int, default=4096, help="S: prompt + new tokens")
    ap.add_argument("--batch", type=int, default=1, help="decoding rows")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="decoding (and frozen-target) dtype")
    ap.add_argument("--train-batch", type=int, default=None,
                    help="also plan a training step with this global batch")
    ap.add_argument("--seq-len", type=int, default=2048, help="training T")
    ap.add_argument("--device-memory-gb", type=float, default=None,
                    help="per-device memory to compare with (GB)")
    args = ap.parse_args(argv)
    try:
        from specjax.models.config import ModelConfig

        path = args.config
        cfg = ModelConfig.from_dir(os.path.dirname(path) if os.path.isfile(path) else path)
        mesh = _parse_mesh(args.mesh)
        for flag in ("max_length", "batch", "gamma", "seq_len"):
            if getattr(args, flag) < 1:
                raise SpecjaxError(f"--{flag.replace('_', '-')} must be >= 1")
        from specjax.dtypes import numpy_dtype

        dtype = numpy_dtype(args.dtype)
        dcfg = _drafter_config(args.drafter, cfg, args.gamma) if args.drafter else None
        sections = {"decoding": decode_plan(cfg, mesh, args.batch, args.max_length, dtype,
                                            dcfg=dcfg, gamma=args.gamma)}
        if args.train_batch:
            objective = "lm" if dcfg is None else dcfg.spec.objective
            sections[f"training ({objective}, batch {args.train_batch} x T {args.seq_len})"] = \
                train_plan(cfg, mesh, args.train_batch, args.seq_len, dcfg=dcfg,
                           objective=objective, dtype=dtype)
    except SpecjaxError as e:
        print(f"specjax.plan: error: {e}", file=sys.stderr)
        return 2
    m = mesh.shape
    print(f"{cfg.family} target: {cfg.num_params / 1e9:.2f}B parameters (L {cfg.num_layers}, "
          f"D {cfg.hidden_size}, N {cfg.num_heads}, K {cfg.num_kv_heads}, H {cfg.head_dim}, "
          f"F {cfg.intermediate_size}, V {cfg.vocab_size}); mesh data={m['data']} "
          f"fsdp={m['fsdp']} model={m['model']} ({m['data'] * m['fsdp'] * m['model']} devices)"
          + (f"; drafter {dcfg.kind}" if dcfg else ""))
    print(f"decoding: batch {args.batch}, max length {args.max_length}, {args.dtype}\n")
    print("| per device | bytes |\n|---|---|")
    for title, parts in sections.items():
        print(f"| **{title}** | |")
        for k, v in parts.items():
            print(f"| {k} | {fmt_bytes(v)} |")
        total = sum(parts.values())
        fits = ""
        if args.device_memory_gb:
            fits = " (fits)" if total <= args.device_memory_gb * 1e9 else " (does NOT fit)"
        print(f"| total | **{fmt_bytes(total)}**{fits} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
