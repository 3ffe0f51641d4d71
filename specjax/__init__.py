"""specjax: lossless speculative decoding for Qwen3 / Llama-3 checkpoints in JAX.

specjax uses transformers only for configs and tokenizers (never its torch models),
so transformers' import-time advisory "PyTorch was not found. Models won't be
available ..." is noise for specjax users: it is silenced here, before any specjax
module imports transformers (a user who sets TRANSFORMERS_NO_ADVISORY_WARNINGS
keeps their own value).
"""

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# The library's decoding entry points (`specjax.decoding.loading`, `specjax.decoding.prompts`;
# a whole decode.py run: `specjax.DecodeConfig` and `specjax.build(cfg) -> Session`), imported on
# first use: `import specjax` stays free of jax for tools such as `python -m specjax.plan`.
_LAZY = {"load_target": "specjax.decoding.loading", "load_drafter": "specjax.decoding.loading",
         "Target": "specjax.decoding.loading", "LoadedDrafter": "specjax.decoding.loading",
         "DEMO_DIR": "specjax.decoding.loading", "read_prompts": "specjax.decoding.prompts",
         "DecodeConfig": "specjax.decoding.options", "Session": "specjax.decoding.session",
         "build": "specjax.decoding.session"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
