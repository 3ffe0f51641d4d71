"""Regenerated drafter training data: the target's own continuations of prompts cut from
TRAINING files, or its answers to the user's conversations (docs/design.md section 6;
SpecForge recommends regenerating data so the drafter trains on the text the target
actually writes). This module is the data set: its prompts, splits and files. The
target writes the continuations in `specjax.tools.regenerate` (the command
`python -m specjax.regenerate`), which runs the decoding engine and calls these.

The files of an output directory:
  generations.jsonl   one record per prompt as it finishes: {"id", "source", "split",
                      "prompt_ids", "output_ids"}; a second run skips the ids already
                      there (`done_ids`), so an interrupted run resumes where it stopped.
  train.npy, val.npy  flat u16 token streams (i32 for vocabularies over 65,536): per
                      prompt, its ids, then the continuation, then EOS (unless the
                      continuation already ended with it); `build_streams`. Use them as
                      `data.tokens_npy` (a list of several sets' train.npy reads them as
                      one stream) and `data.val_tokens_npy` of a drafter config.
  manifest.json       the target, the settings, and per-split counts.

Prompts (`training_prompts`) are built like the bundled demo prompts
(`specjax.decoding.prompts`, with the `def` sites and prompt text of
`specjax.data.code_prompts`): file text through a `def` line and its docstring, asking for
the function body, but from TRAINING files only (`specjax.data.corpus.split_of`) and up to
`per_file` per file. Whole files go to this data set's own val split (`own_split`: a hash
of the path, salted so it differs from the corpus split), so val rows share no file with
train rows. The bundled prompts come from the corpus VALIDATION files and are never used
here.

The user's own conversations (JSONL, OpenAI `messages` or ShareGPT `conversations`, read
by `specjax.data.chat.read_conversations`) replace the stdlib prompts
(`conversation_prompts`): each conversation is rendered with the target's chat template
up to and including its last user turn, with the generation prompt
(`specjax.data.chat.prompt_ids`, the ids `decode.py` decodes from), and the target
answers it. Each conversation goes to the val split by a hash of its id. The streams
are then chat streams with loss masks (`build_streams` with `stop_ids`):
  train.npy, val.npy                        per conversation: the rendered prompt, the
                                            answer, and the end-of-turn token when the
                                            answer was cut by --max-new-tokens;
  train_loss_mask.npy, val_loss_mask.npy    u8, 1 on the target's answer (its own
                                            end-of-turn token included), 0 on the prompt
                                            (earlier assistant turns of the user's data
                                            included: they are not the target's text) and
                                            on an appended end-of-turn token.
Use them as `data.tokens_npy`, `data.loss_mask_npy`, `data.val_tokens_npy` and
`data.val_loss_mask_npy`.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np

from specjax.data.code_prompts import def_sites, prompt_text
from specjax.data.corpus import corpus_files, read_source, split_of, stdlib_root
from specjax.errors import SpecjaxError
from specjax.fileio import atomic_write, existing_ancestor

GENERATIONS = "generations.jsonl"
MANIFEST = "manifest.json"


def own_split(relpath: str, val_fraction: float) -> str:
    """'train' or 'val' of this data set for a corpus TRAIN file: `split_of` of the path
    salted with "regenerate:", so it does not repeat the corpus split."""
    return split_of("regenerate:" + relpath, val_fraction)


def training_prompts(per_file: int = 4, seed: int = 0, context_lines: int = 30,
                     max_chars: int = 800, val_fraction: float = 0.05,
                     root: str | None = None) -> list[dict]:
    """[{"id", "prompt", "source", "split"}] from the corpus's TRAINING files.

    Per file, up to `per_file` distinct `def` sites (at least 4 body lines each, as in
    `specjax.decoding.prompts`), chosen by a seeded RNG; the prompt is at most `context_lines`
    lines before the `def` through its docstring, trimmed from the front at line
    boundaries to `max_chars` characters.
    """
    root = root or stdlib_root()
    files = [f for f in corpus_files(root) if split_of(f) == "train"]
    rng = random.Random(seed)
    out = []
    for rel in files:
        lines = read_source(root, rel).splitlines(keepends=True)
        cands = def_sites(lines)
        for i, body_start in sorted(rng.sample(cands, min(per_file, len(cands)))):
            text = prompt_text(lines, i, body_start, context_lines, max_chars)
            if text.strip():
                out.append({"id": f"{rel}:{i + 1}", "prompt": text, "source": rel,
                            "split": own_split(rel, val_fraction)})
    return out


def done_ids(path: str, truncate: bool = True) -> set[str]:
    """Ids already in generations.jsonl; a torn last line (a kill mid-write) is dropped,
    and with `truncate` cut from the file so that appending resumes cleanly."""
    done = set()
    if not os.path.exists(path):
        return done
    good = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                done.add(json.loads(line)["id"])
                good += len(line)
            except (ValueError, KeyError):
                break
    if truncate and good != os.path.getsize(path):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def build_streams(out_dir: str, eos_id: int, vocab_size: int,
                  stop_ids: tuple[int, ...] | None = None) -> dict:
    """train.npy / val.npy from generations.jsonl; returns per-split counts.

    stop_ids: chat data (the module docstring): an answer that ends with one of these
      ids is complete, otherwise `eos_id` (the end-of-turn token) is appended with mask
      0; and train_loss_mask.npy / val_loss_mask.npy are written beside the streams.
    """
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    parts = {"train": [], "val": []}
    masks = {"train": [], "val": []}
    counts = {s: {"prompts": 0, "prompt_tokens": 0, "new_tokens": 0} for s in parts}
    stops = (eos_id,) if stop_ids is None else stop_ids
    with open(os.path.join(out_dir, GENERATIONS)) as f:
        for line in f:
            rec = json.loads(line)
            ids = rec["prompt_ids"] + rec["output_ids"]
            mask = [0] * len(rec["prompt_ids"]) + [1] * len(rec["output_ids"])
            if not rec["output_ids"] or rec["output_ids"][-1] not in stops:
                ids, mask = ids + [eos_id], mask + [0]
            parts[rec["split"]].append(np.asarray(ids, dtype))
            masks[rec["split"]].append(np.asarray(mask, np.uint8))
            c = counts[rec["split"]]
            c["prompts"] += 1
            c["prompt_tokens"] += len(rec["prompt_ids"])
            c["new_tokens"] += len(rec["output_ids"])
    for split, arrs in parts.items():
        stream = np.concatenate(arrs) if arrs else np.zeros([0], dtype)
        counts[split]["tokens"] = int(stream.size)
        atomic_write(os.path.join(out_dir, f"{split}.npy"),
                     lambda f, a=stream: np.save(f, a))
        if stop_ids is not None:
            mask = np.concatenate(masks[split]) if arrs else np.zeros([0], np.uint8)
            counts[split]["target_tokens"] = int(mask.sum())
            atomic_write(os.path.join(out_dir, f"{split}_loss_mask.npy"),
                         lambda f, a=mask: np.save(f, a))
    return counts


def conversation_prompts(tokenizer, path: str, val_fraction: float) -> list[dict]:
    """[{"id", "source", "split", "prompt_ids"}] of the conversations in the JSONL `path`
    (see the module docstring): rendered up to the last user turn with the generation
    prompt; split "val" for a hash of the id below `val_fraction`.

    Raises: SpecjaxError (one line naming the line) for bad data or a conversation
      without a user turn; duplicate ids (resuming is by id)."""
    from specjax.data import chat

    out, seen = [], {}
    for conv in chat.read_conversations(path):
        where = f"{path} line {conv['line']}"
        if conv["id"] in seen:
            raise SpecjaxError(f"{where}: id {conv['id']!r} repeats line {seen[conv['id']]}; "
                               "ids must be unique (a run resumes by id)")
        seen[conv["id"]] = conv["line"]
        try:
            messages = chat.messages_until_last_user(conv["messages"])
        except SpecjaxError as e:
            raise SpecjaxError(f"{where}: {e}") from None
        out.append({"id": conv["id"], "source": where,
                    "split": split_of("conversation:" + conv["id"], val_fraction),
                    "prompt_ids": chat.prompt_ids(tokenizer, messages)})
    return out


def check_out_dir(out_dir: str) -> None:
    """SpecjaxError unless `out_dir` is a directory or could be made one (creates
    nothing)."""
    probe = existing_ancestor(out_dir)
    if not os.path.isdir(probe):
        what = "is a file" if probe == os.path.abspath(out_dir) else f"is under a file, {probe}"
        raise SpecjaxError(f"--out {out_dir} {what}; pass a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecjaxError(f"--out {out_dir}: {probe} is not writable; pass a writable "
                           "directory")
