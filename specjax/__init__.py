"""specjax: lossless speculative decoding for Qwen3 / Llama-3 checkpoints in JAX.

specjax uses transformers only for configs and tokenizers (never its torch models),
so transformers' import-time advisory "PyTorch was not found. Models won't be
available ..." is noise for specjax users: it is silenced here, before any specjax
module imports transformers (a user who sets TRANSFORMERS_NO_ADVISORY_WARNINGS
keeps their own value).
"""

import os

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
