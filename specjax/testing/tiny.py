"""Small random-weight checkpoints for tests, benchmarks and the engine demo.

    python -m specjax.testing.tiny out/tiny            # target + draft + prompts

writes `out/tiny/target` (Qwen3, about 2M parameters), `out/tiny/draft` (a smaller
Qwen3 with the same tokenizer) and `out/tiny/prompts.jsonl`. The tokenizer is a
byte-level BPE trained on a few standard-library files (seconds). The weights are
random, so the text is gibberish: this exercises the engine, not a language model.
The command line is `specjax.tools.tiny`; `make_demo` is the library call.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig

from flax import nnx

from specjax.models.checkpoint import save_model
from specjax.models.config import ModelConfig
from specjax.models.model import Transformer


def tiny_config(vocab_size=512, family="qwen3", **overrides) -> ModelConfig:
    """A small config; `overrides` replace any ModelConfig field."""
    base = dict(family=family, vocab_size=vocab_size, hidden_size=128, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=352,
                rope_theta=10000.0, tie_word_embeddings=True, eos_token_ids=(0,),
                pad_token_id=1, max_position_embeddings=2048)
    base.update(overrides)
    return ModelConfig(**base)


def stdlib_texts(limit: int = 40) -> list[str]:
    """Source text of the first `limit` standard-library modules (sorted by name)."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[:limit]
    out = []
    for n in names:
        with open(os.path.join(root, n), encoding="utf-8", errors="replace") as f:
            out.append(f.read())
    return out


def write_token_corpus(out_dir: str, num_files: int = 12, vocab_size: int = 300,
                       chars_per_file: int = 6000):
    """A byte-level BPE of `vocab_size` tokens trained on the first `num_files`
    standard-library modules, and their token streams (the first `chars_per_file`
    characters of each, EOS after each; u16) split 9:1 into `out_dir`/tokens.npy and
    `out_dir`/val.npy. Returns (tokenizer, {"tokens": path, "val": path})."""
    import numpy as np

    from specjax.models.tokenizer import train_bpe

    texts = stdlib_texts(num_files)
    tok = train_bpe(texts, vocab_size)
    ids = []
    for text in texts:
        ids += tok.encode(text[:chars_per_file], add_special_tokens=False) + [tok.eos_token_id]
    ids = np.asarray(ids, np.uint16)
    paths = {"tokens": os.path.join(out_dir, "tokens.npy"),
             "val": os.path.join(out_dir, "val.npy")}
    np.save(paths["tokens"], ids[: len(ids) * 9 // 10])
    np.save(paths["val"], ids[len(ids) * 9 // 10:])
    return tok, paths


def save_random_drafter(target_dir: str, out_dir: str, kind: str = "eagle3",
                        gamma: int = 3) -> str:
    """Writes a random-init drafter of `kind` (G `gamma`) for the target at `target_dir`
    to the drafter directory `out_dir` (as train.py exports one) and returns `out_dir`."""
    from specjax.drafters import DrafterConfig, build_network
    from specjax.drafters.io import save_drafter

    dcfg = DrafterConfig.for_target(ModelConfig.from_dir(target_dir), kind, gamma=gamma)
    net = build_network(dcfg, rngs=nnx.Rngs(0))
    save_drafter(out_dir, dcfg, nnx.state(net, nnx.Param), target_dir)
    return out_dir


def make_demo(out_dir: str, vocab_size: int = 512, seed: int = 0) -> None:
    """Writes target/, draft/ and prompts.jsonl under `out_dir`."""
    from specjax.models.tokenizer import train_bpe

    texts = stdlib_texts()
    tok = train_bpe(texts, vocab_size)
    V = len(tok)
    target = Transformer(tiny_config(V), rngs=nnx.Rngs(seed))
    draft = Transformer(tiny_config(V, hidden_size=64, num_layers=2, num_heads=2,
                                    num_kv_heads=1, intermediate_size=176),
                        rngs=nnx.Rngs(seed + 1))
    save_model(target, os.path.join(out_dir, "target"), tokenizer=tok)
    save_model(draft, os.path.join(out_dir, "draft"), tokenizer=tok)
    with open(os.path.join(out_dir, "prompts.jsonl"), "w") as f:
        for i, text in enumerate(texts[:8]):
            f.write(json.dumps({"id": f"p{i}", "prompt": text[:200]}) + "\n")


if __name__ == "__main__":  # `python -m specjax.testing.tiny`: specjax.tools.tiny
    from specjax.tools.tiny import main

    sys.exit(main())
