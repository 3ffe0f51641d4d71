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
    """The target's parameters (a `specjax.config.ModelConfig`) in `dtype`."""
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
