"""jax's persistent compilation cache as specjax's scripts use it (decode.py's
--compile-cache; benchmarks that compile the same loops)."""

from __future__ import annotations

import os

# jax's persistent compilation cache when neither --compile-cache nor
# JAX_COMPILATION_CACHE_DIR names one
DEFAULT_COMPILE_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "specjax", "jax")


def cache_subdir(arg: str | None, name: str) -> str | None:
    """COMPILE_CACHE/name, beside jax's own files (it reads only its own there), for
    specjax's caches of other things (cost tables, constraint automata): COMPILE_CACHE is
    `arg` (--compile-cache), else jax's configured directory, else DEFAULT_COMPILE_CACHE;
    None with "none"."""
    if arg == "none":
        return None
    import jax

    base = arg or jax.config.jax_compilation_cache_dir or DEFAULT_COMPILE_CACHE
    return os.path.join(os.path.abspath(base), name)


def enable_compile_cache(arg: str | None) -> str | None:
    """Points jax's persistent compilation cache at `arg` ("none": off; None: the
    directory jax already has from JAX_COMPILATION_CACHE_DIR, else DEFAULT_COMPILE_CACHE,
    or off where JAX_ENABLE_COMPILATION_CACHE=false) and returns the directory used, or
    None; a default directory that cannot be created or written turns the cache off
    (raises SpecjaxError for an explicit `arg`). Call before the first compilation: jax
    reads the setting once per process. Programs that compile in under a second are not
    cached (jax's `jax_persistent_cache_min_compile_time_secs`); the cache key holds the
    program, the jax and XLA versions and XLA_FLAGS, so a stale entry is never loaded."""
    import jax

    if arg == "none" or (arg is None and not jax.config.jax_enable_compilation_cache):
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    from specjax.errors import SpecjaxError

    current = jax.config.jax_compilation_cache_dir
    path = arg or current or DEFAULT_COMPILE_CACHE
    try:
        os.makedirs(path, exist_ok=True)
        usable = os.access(path, os.W_OK)
    except OSError:
        usable = False
    if not usable:
        if arg:
            raise SpecjaxError(f"--compile-cache {arg}: cannot create or write that directory; "
                               "pass a writable one or --compile-cache none")
        jax.config.update("jax_enable_compilation_cache", False)  # a read-only home: skip
        return None
    if path != current:
        jax.config.update("jax_compilation_cache_dir", path)
    return path
