"""Systems built as decode.py builds them: a benchmark names a system by its
`DecodeConfig` (decode.py's flags) and gets the session's engines, so that what it times is
what `python decode.py FLAGS` runs.

    from benchmarks.lib import sessions

    cfg = sessions.config(drafter=EAGLE3, gamma=7, dtype="float32")
    spec = sessions.engine(cfg, prompts)            # the engine decode.py would run
    ar = sessions.autoregressive(cfg, prompts)      # its autoregressive reference
    sessions.compile_all({"AR": ar, "eagle3": spec})
    stats, outs = sessions.run_interleaved({"AR": ar, "eagle3": spec},
                                           [[p] for p in prompts], 64,
                                           [jax.random.key(i) for i in range(len(prompts))])

`prompts` are lists of token ids or (id, ids) pairs; only their lengths matter (the
session's shape: max_length = cfg.max_length or the longest prompt + max_new_tokens,
prompt_width the longest rounded up to 16). Each system is its own `Session` (its own copy
of the target's weights: cheap for the demo models). A benchmark that needs something a
session does not expose (a loop variant, a kernel A/B, a drafter built by hand) builds an
`Engine` itself and says why in a comment.
"""

from __future__ import annotations

import dataclasses
import time

from specjax.decoding.options import DecodeConfig


def current_compile_cache() -> str:
    """jax's persistent compilation cache as this process already has it (a directory, or
    "none"): a benchmark that times compilation must not start loading compiled loops
    from the cache decode.py fills (~/.cache/specjax/jax) because it builds sessions."""
    import jax

    if not jax.config.jax_enable_compilation_cache:
        return "none"
    return jax.config.jax_compilation_cache_dir or "none"


def config(**options) -> DecodeConfig:
    """`DecodeConfig(**options)` with two benchmark defaults: compare_ar False (a benchmark
    interleaves its own autoregressive reference: `autoregressive`) and compile_cache as
    this process has it (`current_compile_cache`). Raises SpecjaxError as DecodeConfig."""
    options.setdefault("compare_ar", False)
    options.setdefault("compile_cache", current_compile_cache())
    return DecodeConfig(**options)


def as_pairs(prompts) -> list[tuple]:
    """(id, ids) pairs from lists of ids or from pairs (kept)."""
    return [p if isinstance(p, tuple) else (i, list(p)) for i, p in enumerate(prompts)]


def session(cfg: DecodeConfig):
    """`specjax.decoding.session.build(cfg)`."""
    from specjax.decoding.session import build

    return build(cfg)


def engine_set(cfg: DecodeConfig, prompts, chat: bool = False):
    """The `specjax.decoding.engines.EngineSet` a session of `cfg` builds for these prompts'
    shape (weights loaded, engines not compiled): .main (an Engine, or the AdaptiveEngine
    under --gamma auto), .engines["ar"] with compare_ar, .session (its target, loaded
    drafter)."""
    return session(cfg).engines(as_pairs(prompts), chat)


def engine(cfg: DecodeConfig, prompts, chat: bool = False):
    """The speculative (or, with drafter "none", autoregressive) engine decode.py runs for
    `cfg` on these prompts' shape: `engine_set(...).main`."""
    return engine_set(cfg, prompts, chat).main


def ar_config(cfg: DecodeConfig) -> DecodeConfig:
    """`cfg` for autoregressive decoding: the same target, dtypes, sampling, batch, shape,
    EOS and kernels, no drafter (and none of the drafter's or the lossy rules' options)."""
    verify = "block" if cfg.verify == "fly" else cfg.verify
    return dataclasses.replace(
        cfg, drafter="none", gamma=None, cost_table=None, verify=verify, fly_window=None,
        fly_entropy=None, partial_verify=False, partial_budget=None, num_drafts=1,
        tree_topk=None, tree_nodes=None, step_timing=False, drafter_dtype="auto",
        draft_vocab="auto", draft_stop=0.0, draft_window=None, draft_reuse=False,
        compare_ar=False)


def autoregressive(cfg: DecodeConfig, prompts, chat: bool = False):
    """The autoregressive engine of `ar_config(cfg)` for these prompts' shape (what
    decode.py runs with --drafter none and cfg's other options)."""
    return engine(ar_config(cfg), prompts, chat)


def compile_all(engines: dict) -> dict:
    """Compiles every engine; {name: seconds}."""
    out = {}
    for name, eng in engines.items():
        t0 = time.perf_counter()
        eng.compile()
        out[name] = time.perf_counter() - t0
    return out


def warm_up(engines, batch: list[list[int]], new_tokens: int, passes: int = 1,
            key: int = 1) -> None:
    """`passes` untimed runs of every engine (a dict's values, or a list) over `batch`, with
    keys key, key + 1, ... (the first calls of a compiled loop are slower on CPU)."""
    import jax

    for eng in (engines.values() if isinstance(engines, dict) else engines):
        for w in range(passes):
            eng.run(batch, new_tokens, jax.random.key(key + w))


def run_interleaved(engines: dict, batches: list[list[list[int]]], new_tokens: int,
                    keys: list) -> tuple[dict, dict]:
    """Every batch through every engine in turn (the dict's order, batch i with keys[i]),
    so that all of them see the same machine state, as decode.py interleaves its
    autoregressive reference. Returns ({name: engine.Stats}, {name: outputs in order})."""
    from specjax.decoding.engine import Stats

    stats = {name: Stats() for name in engines}
    outs = {name: [] for name in engines}
    for batch, key in zip(batches, keys, strict=True):
        for name, eng in engines.items():
            out = eng.run(batch, new_tokens, key)
            stats[name].add(out)
            outs[name].extend(out.outputs)
    return stats, outs
