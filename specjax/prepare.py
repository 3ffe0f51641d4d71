"""Chat conversations -> token streams with a loss mask, for drafter training on chat data.

    python -m specjax.prepare --target DIR --data chats.jsonl --out runs/data/chat \\
        [--val-fraction 0.05] [--max-length N] [--seed 0]

Each conversation of `--data` (JSONL, OpenAI "messages" or ShareGPT "conversations";
`specjax.data.chat.read_conversations`) is rendered with the target's own chat template
(`specjax.data.chat.conversation_ids_and_mask`): the mask is 1 on assistant turns and the
end-of-turn token that closes each, 0 on system/user turns, role headers and BOS.

What it writes into `--out`:
  tokens.npy, loss_mask.npy          the training conversations one after another: a
                                     flat u16 token stream (i32 for vocabularies over
                                     65,536) and its u8 mask, same length.
  val_tokens.npy, val_loss_mask.npy  with --val-fraction > 0: the same for a validation
                                     split of whole conversations (a seeded shuffle).
  manifest.json                      the target, the data file, the settings, the
                                     end-of-turn ids and per-split counts.

Conversations are not padded or cut into rows here: the trainer cuts rows from the
concatenated stream, so a long conversation spans several rows. `--max-length N` cuts a
conversation to its first N tokens (counted in the manifest); by default each is kept
whole.

A conversation without an assistant turn is an error naming its line (it would train
nothing; drop it from the file). Everything is checked before anything is written; the
output appears complete or not at all (written into a temporary sibling directory,
renamed at the end). An existing non-empty `--out` is refused: pick a new directory.

The command line is `specjax.tools.prepare`; `prepare` is the library call.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile

import numpy as np

from specjax.errors import SpecjaxError
from specjax.fileio import existing_ancestor

MANIFEST = "manifest.json"
FILES = {"train": ("tokens.npy", "loss_mask.npy"),
         "val": ("val_tokens.npy", "val_loss_mask.npy")}


def _check_out_dir(out_dir: str) -> None:
    """SpecjaxError unless `out_dir` is absent or an empty directory whose parent can be
    written (creates nothing)."""
    if os.path.lexists(out_dir):
        if not os.path.isdir(out_dir):
            raise SpecjaxError(f"--out {out_dir} exists and is not a directory; pass a new "
                               "directory")
        if os.path.exists(os.path.join(out_dir, MANIFEST)):
            raise SpecjaxError(f"--out {out_dir} holds an earlier specjax.prepare output; "
                               "pick a new directory")
        if os.listdir(out_dir):
            raise SpecjaxError(f"--out {out_dir} is not empty; pick a new directory")
    probe = existing_ancestor(os.path.dirname(os.path.abspath(out_dir)))
    if not os.path.isdir(probe):
        raise SpecjaxError(f"--out {out_dir} is under a file, {probe}; pass a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecjaxError(f"--out {out_dir}: {probe} is not writable; pass a writable "
                           "directory")


def _val_indices(n: int, val_fraction: float, seed: int) -> set[int]:
    """Indices of the conversations of the validation split: round(n * val_fraction),
    at least 1 and at most n - 1, chosen by a shuffle seeded with `seed`."""
    if val_fraction <= 0:
        return set()
    if n < 2:
        raise SpecjaxError(f"--val-fraction {val_fraction:g} needs at least 2 conversations; "
                           f"--data has {n}")
    k = min(n - 1, max(1, round(n * val_fraction)))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return set(order[:k])


def prepare(target_dir: str, data_path: str, out_dir: str, *, val_fraction: float = 0.0,
            max_length: int | None = None, seed: int = 0) -> dict:
    """Renders, checks and writes the data set (module docstring); returns the manifest.

    Raises: SpecjaxError (one line) for bad settings, an unusable `out_dir`, a target
      without config, tokenizer or chat template, bad conversation data (naming the
      line), a conversation without assistant tokens, or token ids >= the config's
      vocab_size. Nothing is written when it raises."""
    from tqdm import tqdm

    from specjax.data.chat import (
        conversation_ids_and_mask,
        end_of_turn_ids,
        load_chat_tokenizer,
        read_conversations,
    )
    from specjax.models.config import ModelConfig

    if not 0 <= val_fraction < 1:
        raise SpecjaxError(f"--val-fraction={val_fraction:g} must be in [0, 1)")
    if max_length is not None and max_length < 1:
        raise SpecjaxError(f"--max-length={max_length} must be >= 1")
    _check_out_dir(out_dir)
    cfg = ModelConfig.from_dir(target_dir)
    tok = load_chat_tokenizer(target_dir)
    eot = end_of_turn_ids(tok)
    convs = read_conversations(data_path)
    val = _val_indices(len(convs), val_fraction, seed)
    dtype = np.uint16 if cfg.vocab_size <= 1 << 16 else np.int32
    parts = {"train": ([], []), "val": ([], [])}
    counts = {s: {"conversations": 0, "tokens": 0, "assistant_tokens": 0} for s in parts}
    formats: dict[str, int] = {}
    truncated = truncated_no_assistant = 0
    for k, c in enumerate(tqdm(convs, desc="prepare", unit="conv", file=sys.stderr,
                               disable=None)):
        where = f"--data {data_path} line {c['line']}"
        try:
            ids, mask = conversation_ids_and_mask(tok, c["messages"])
        except SpecjaxError as e:
            raise SpecjaxError(f"{where}: {e}") from None
        if not any(mask):
            raise SpecjaxError(f"{where}: no assistant turn (it would train nothing); "
                               "drop it from the file")
        top = max(ids)
        if top >= cfg.vocab_size:
            raise SpecjaxError(f"{where}: token id {top} >= the target's vocab_size "
                               f"{cfg.vocab_size}; the tokenizer does not match the config")
        if max_length is not None and len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
            truncated += 1
            truncated_no_assistant += not any(mask)
        split = "val" if k in val else "train"
        parts[split][0].append(np.asarray(ids, dtype))
        parts[split][1].append(np.asarray(mask, np.uint8))
        cs = counts[split]
        cs["conversations"] += 1
        cs["tokens"] += len(ids)
        cs["assistant_tokens"] += int(sum(mask))
        formats[c["format"]] = formats.get(c["format"], 0) + 1
    if val_fraction <= 0:
        del parts["val"], counts["val"]
    manifest = {"target": os.path.abspath(target_dir), "data": os.path.abspath(data_path),
                "val_fraction": val_fraction, "max_length": max_length, "seed": seed,
                "vocab_size": cfg.vocab_size, "dtype": np.dtype(dtype).name,
                "end_of_turn_ids": list(eot), "eos_token_ids": list(cfg.eos_token_ids),
                "formats": formats, "truncated": truncated,
                "truncated_no_assistant": truncated_no_assistant,
                "files": {s: list(FILES[s]) for s in parts}, "splits": counts}

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-",
                           dir=parent)
    try:
        for split, (toks, masks) in parts.items():
            tname, mname = FILES[split]
            np.save(os.path.join(tmp, tname),
                    np.concatenate(toks) if toks else np.zeros([0], dtype))
            np.save(os.path.join(tmp, mname),
                    np.concatenate(masks) if masks else np.zeros([0], np.uint8))
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, out_dir)  # an empty out_dir is replaced; checked above
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


if __name__ == "__main__":  # `python -m specjax.prepare`: specjax.tools.prepare
    from specjax.tools.prepare import main

    sys.exit(main())
