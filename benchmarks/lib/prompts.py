"""The prompt sets the benchmarks decode: the bundled demo prompts (read as decode.py reads
--prompts), held-out prompts cut from the regenerated validation stream, and held-out real
text of a given length."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from benchmarks.lib.provenance import ROOT

BUNDLED = os.path.join(ROOT, "checkpoints", "demo", "prompts.jsonl")
# the regenerated held-out stream of the KVShot redo (data.seed 0): the held-out prompts
VAL_NPY = os.path.join(ROOT, "benchmarks", "data", "study2", "val.npy")
DEMO_TOKENIZER = os.path.join(ROOT, "checkpoints", "demo", "tokenizer")


def prompt_ids(path: str, tokenizer, vocab_size: int, n: int, target_dir: str
               ) -> list[list[int]]:
    """The first `n` prompts of the JSONL `path` as token ids, read and checked as
    decode.py reads --prompts (`specjax.read_prompts`: "prompt" text or "input_ids";
    SpecjaxError on bad lines)."""
    from specjax.decoding.prompts import read_prompts

    return [ids for _, ids in read_prompts(tokenizer, vocab_size, path=path,
                                           target=target_dir)[:n]]


def prompt_file(n: int, path: str = BUNDLED) -> str:
    """A temporary JSONL file with the first n prompts of `path` (the caller removes it).
    Raises SpecjaxError when the file has fewer."""
    from specjax.errors import SpecjaxError

    with open(path) as f:
        lines = [x for x in f if x.strip()]
    if n > len(lines):
        raise SpecjaxError(f"--prompts {n}: {os.path.relpath(path, ROOT)} has {len(lines)} "
                           "prompts")
    fd, out = tempfile.mkstemp(suffix=".jsonl", prefix="bench-prompts-")
    with os.fdopen(fd, "w") as f:
        f.writelines(lines[:n])
    return out


def held_out_prompts(val_npy: str, n: int, prompt_tokens: int, eos: int = 0) -> list:
    """[(document index, i32 ids)]: the first `prompt_tokens` tokens of n documents of the
    held-out stream `val_npy` (documents end at `eos`), evenly spaced over the documents
    long enough to hold prompt_tokens + 1 tokens."""
    toks = np.load(val_npy, mmap_mode="r")
    ends = np.flatnonzero(np.asarray(toks) == eos)
    starts = np.r_[0, ends[:-1] + 1]
    docs = [(i, s, e) for i, (s, e) in enumerate(zip(starts, ends, strict=True))
            if e - s > prompt_tokens]
    if len(docs) < n:
        raise ValueError(f"{val_npy}: {len(docs)} documents of more than {prompt_tokens} "
                         f"tokens, {n} prompts asked for")
    pick = np.linspace(0, len(docs) - 1, n).round().astype(int)
    return [(int(docs[j][0]), [int(t) for t in toks[docs[j][1]:docs[j][1] + prompt_tokens]])
            for j in pick]


def text_ids(tokenizer_dir: str, n: int) -> list[int]:
    """n token ids of held-out real text (the standard library's validation split)."""
    from specjax.data.corpus import corpus_files, read_source, split_of, stdlib_root
    from specjax.models.checkpoint import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    root, ids = stdlib_root(), []
    for rel in corpus_files(root):
        if split_of(rel) == "val":
            ids.extend(tok.encode(read_source(root, rel)))
        if len(ids) >= n:
            break
    return ids[:n]
