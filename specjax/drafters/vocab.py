"""A hot draft vocabulary for drafters that draft through the target's LM head.

EAGLE-3 drafts over a reduced vocabulary (32k of Llama-3's 128k ids, the most frequent
in its training data, mapped back by `d2t`; Li et al. 2025, section 3; SpecForge
`generate_vocab_mapping`): each draft step multiplies by a [Vd, D] head instead of
[V, D]. specjax's own drafters (eagle3, hybrid, kv, block) read the target's head, so
the hot head is simply the target's rows of the Vd most frequent ids: no training, and
the draft logits of those ids are unchanged. Draft tokens and q [B,G,V] stay in the
target's vocabulary (q is 0 outside the hot set, see `learned.hot_to_target`), so
verification, and losslessness, do not change; only ids outside the set can never be
drafted.

    python -m specjax.drafters.vocab checkpoints/demo/drafters/eagle3 --size 2048
    python -m specjax.drafters.vocab DIR --tokens-npy runs/data/regen-demo/train.npy

(the second counts a token stream instead, such as the target's regenerated
continuations of `specjax.regenerate`: the ids the target itself writes)

writes `<drafter dir>/draft_vocab.json`: {"size", "coverage" (the fraction of counted
tokens inside the set), "counted_tokens", "source", "ids" (sorted target ids)}, which
decode.py uses by default (`--draft-vocab auto`). The command line is
`specjax.tools.vocab`.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from specjax.errors import SpecjaxError

VOCAB_NAME = "draft_vocab.json"


def check_size(size: int, vocab_size: int) -> None:
    """Raises SpecjaxError unless 1 <= size <= vocab_size."""
    if not 1 <= size <= vocab_size:
        raise SpecjaxError(f"--size {size}: a draft vocabulary needs 1..{vocab_size} ids")


def hot_ids(counts: np.ndarray, size: int) -> np.ndarray:
    """i32[size]: the `size` most frequent ids of `counts` (i64[V]; ties: lower id first),
    sorted ascending. Raises SpecjaxError unless 1 <= size <= V."""
    counts = np.asarray(counts)
    check_size(size, counts.shape[0])
    order = np.argsort(-counts, kind="stable")  # stable: equal counts keep id order
    return np.sort(order[:size]).astype(np.int32)


def save_draft_vocab(drafter_dir: str, counts: np.ndarray, size: int, source: str) -> dict:
    """Writes `drafter_dir`/draft_vocab.json (atomically) and returns its contents."""
    from specjax.fileio import atomic_write

    ids = hot_ids(counts, size)
    total = int(np.sum(counts))
    record = {"size": int(size), "coverage": float(np.sum(counts[ids]) / max(total, 1)),
              "counted_tokens": total, "source": source, "ids": ids.tolist()}
    data = (json.dumps(record) + "\n").encode()
    atomic_write(os.path.join(drafter_dir, VOCAB_NAME), lambda f: f.write(data))
    return record


def load_draft_vocab(drafter_dir: str, vocab_size: int) -> np.ndarray | None:
    """i32[Vd] hot ids from `drafter_dir`/draft_vocab.json, or None when there is none.

    Raises: SpecjaxError if the file is malformed or its ids are not distinct ids in
    [0, vocab_size)."""
    path = os.path.join(drafter_dir, VOCAB_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f)["ids"]
        arr = np.asarray(ids)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecjaxError(f"{path}: unreadable draft vocabulary ({e}); rebuild it with "
                           "python -m specjax.drafters.vocab") from None
    if (arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer)
            or arr.min() < 0 or arr.max() >= vocab_size or np.unique(arr).size != arr.size):
        raise SpecjaxError(f"{path}: \"ids\" must be distinct token ids in [0, {vocab_size})")
    return arr.astype(np.int32)


def corpus_counts(tokenizer_dir: str, cache_dir: str, vocab_size: int) -> np.ndarray:
    """i64[V] token counts of the training split (the stdlib corpus of specjax.data.corpus,
    tokenized with `tokenizer_dir`, cached in `cache_dir`)."""
    from specjax.data.corpus import load_tokens, tokenize_corpus

    paths = tokenize_corpus(tokenizer_dir, cache_dir)
    return np.bincount(load_tokens(paths["train"]), minlength=vocab_size)[:vocab_size]


def stream_counts(paths: list[str], vocab_size: int) -> np.ndarray:
    """i64[V] token counts of flat .npy token streams. Raises SpecjaxError for an
    unreadable file or ids outside [0, vocab_size)."""
    counts = np.zeros(vocab_size, np.int64)
    for path in paths:
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise SpecjaxError(f"--tokens-npy {path}: unreadable ({e})") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise SpecjaxError(f"--tokens-npy {path}: not a flat integer token stream")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
            raise SpecjaxError(f"--tokens-npy {path}: ids outside [0, {vocab_size})")
        counts += np.bincount(np.asarray(arr, np.int64), minlength=vocab_size)
    return counts


if __name__ == "__main__":  # `python -m specjax.drafters.vocab`: specjax.tools.vocab
    from specjax.tools.vocab import main

    sys.exit(main())
