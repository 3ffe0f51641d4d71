"""Prefill scheduling: which static piece sizes cover a prompt, and the scan that runs a
forward over them (the target's chunked prefill and a learned drafter's pass over the
prompt both run this way). Sizes are per backend; docs/benchmarks.md has the benchmark
(`benchmarks/prefill.py`) that chose the CPU defaults.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def default_prefill_chunk() -> int:
    """The largest piece of a prefill (and of a learned drafter's pass over the prompt)
    when `LoopConfig.prefill_chunk` is None: 256 on the CPU backend, 512 elsewhere.

    On XLA:CPU a forward's cost grows with its rows, but much less than in proportion (a
    fixed cost per forward dominates small pieces), so a prompt is best covered by few
    large pieces with little padding past its end; see `prefill_pieces`. Measured by
    `python benchmarks/prefill.py` (docs/benchmarks.md)."""
    return 256 if jax.default_backend() == "cpu" else 512


def default_prefill_min_chunk(chunk: int) -> int:
    """The smallest piece of a prefill of chunks of `chunk` when
    `LoopConfig.prefill_min_chunk` is None: 64 on the CPU backend, so the rest of a prompt
    after its whole chunks of 256 runs as one piece of 64, 128 or 256 rows; `chunk`
    elsewhere, where pieces are not measured: whole chunks only.

    A smaller piece would save little padding on prompts of a few hundred tokens and cost
    one more compiled forward (1-2 s of compile time each); whole chunks of 64 spend more
    time in fixed per-forward costs. `python benchmarks/prefill.py --settings 64:64 default
    256:32` compares these settings in one process (docs/benchmarks.md)."""
    return 64 if jax.default_backend() == "cpu" else chunk


def prefill_pieces(chunk: int | None = None, min_chunk: int | None = None) -> tuple[int, ...]:
    """The static piece sizes of a prefill: `chunk`, then its exact halves down to the
    smallest one >= `min_chunk` (at least one size). 256, 32 -> (256, 128, 64, 32);
    64, 64 -> (64,): whole chunks only; 24, 5 -> (24, 12, 6). None: the backend's
    `default_prefill_chunk()` and `default_prefill_min_chunk(chunk)`.

    Raises ValueError for sizes < 1."""
    chunk = default_prefill_chunk() if chunk is None else chunk
    min_chunk = default_prefill_min_chunk(chunk) if min_chunk is None else min_chunk
    if chunk < 1 or min_chunk < 1:
        raise ValueError(f"prefill chunk sizes must be >= 1, got {chunk} and {min_chunk}")
    sizes = [chunk]
    while sizes[-1] % 2 == 0 and sizes[-1] // 2 >= min_chunk:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def pad_rows(x, axis: int, width: int):
    """x [..., T, ...] zero padded along `axis` to `width` >= T positions."""
    return jnp.pad(x, [(0, width - x.shape[axis] if a == axis else 0) for a in range(x.ndim)])


def padded_width(T: int, sizes: tuple[int, ...]) -> int:
    """Positions the inputs of `scan_prompt_pieces` over a T-wide prompt are padded to:
    whole chunks of sizes[0]."""
    return -(-T // sizes[0]) * sizes[0]


def scan_prompt_pieces(forward, carry, T: int, sizes: tuple[int, ...], last):
    """Runs carry = forward(carry, start, size) over positions 0..N-1 of a T-wide
    prompt, N = max(last) + 1 (last: i32[B], each row's last position that needs
    processing), in pieces of the static `sizes` (`prefill_pieces`): whole chunks of
    sizes[0] while they fit in N (a `lax.scan` over the ceil(T / sizes[0]) chunks, each a
    `lax.cond`), then the rest, if any, as ONE piece of the smallest size that covers it
    (`lax.switch`). The pieces run in order and cover each position once; what they
    cover past N is padding. Chunks past N are skipped and the carry passes through, so
    a short prompt padded to a wide T pays for its own pieces only.

    forward slices its own inputs: start is an i32 scalar, size a Python int, and
    `lax.dynamic_slice_in_dim(x, start, size, axis)` stays in bounds for inputs padded to
    `padded_width(T, sizes)` positions (`pad_rows`). The chunked prefill and a learned
    drafter's pass over the prompt both run this way. Returns the carry."""
    chunk = sizes[0]
    need = jnp.max(last) + 1
    full = need // chunk  # whole chunks

    def whole(carry, c):
        run = lambda carry: forward(carry, c * chunk, chunk)  # noqa: E731
        return jax.lax.cond(c < full, run, lambda carry: carry, carry), None

    carry, _ = jax.lax.scan(whole, carry, jnp.arange(-(-T // chunk), dtype=jnp.int32))
    start, rest = full * chunk, need - full * chunk  # 0 <= rest < chunk
    # branch 0: nothing left; branch k: a piece of sizes[k - 1], the smallest >= rest
    branches = [lambda carry: carry] + [
        lambda carry, size=size: forward(carry, start, size) for size in sizes]
    k = jnp.where(rest > 0, sum((rest <= s).astype(jnp.int32) for s in sizes), 0)
    return jax.lax.switch(k, branches, carry)
