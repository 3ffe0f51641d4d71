"""Regenerated drafter training data: the target's own greedy continuations of prompts
cut from TRAINING files (docs/design.md section 6; SpecForge recommends regenerating data so
the drafter trains on the text the target actually writes).

    python -m specjax.regenerate --out runs/data/regen --prompts-per-file 4

What it writes into `--out`:
  generations.jsonl   one record per prompt as it finishes: {"id", "source", "split",
                      "prompt_ids", "output_ids"}; a second call skips the ids already
                      there, so an interrupted run resumes where it stopped.
  train.npy, val.npy  flat u16 token streams (i32 for vocabularies over 65,536): per
                      prompt, its ids, then the continuation, then EOS (unless the
                      continuation already ended with it). Use them as `data.tokens_npy`
                      (a list of several sets' train.npy reads them as one stream)
                      and `data.val_tokens_npy` of a drafter config.
  manifest.json       the target, the settings, and per-split counts.

Prompts are built like the bundled demo prompts (`specjax.decoding.prompts`): file text through
a `def` line and its docstring, asking for the function body, but from TRAINING files
only (`specjax.data.corpus.split_of`) and up to `--prompts-per-file` per file. Whole files go
to this data set's own val split (a hash of the path, salted so it differs from the
corpus split), so val rows share no file with train rows. The bundled prompts come
from the corpus VALIDATION files and are never used here.

Decoding is plain autoregressive greedy decoding of the target (specjax.decoding.engine.Engine,
no drafter), so the continuations are exactly what `decode.py` at temperature 0
produces for such prompts (`--temperature T` samples instead).

The user's own conversations (`--data FILE.jsonl`, OpenAI `messages` or ShareGPT
`conversations`, read by `specjax.data.chat.read_conversations`) replace the stdlib
prompts: each conversation is rendered with the target's chat template up to and
including its last user turn, with the generation prompt (`specjax.data.chat.prompt_ids`,
the ids `decode.py` decodes from), and the target answers it, stopping at the config's EOS
or the template's end-of-turn token. SpecForge regenerates the assistant turns with the
target for the same reason: the drafter learns the target's own distribution. Each
conversation goes to the val split by a hash of its id (`--val-fraction`). The streams
are then chat streams with loss masks:
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
import sys
import time

import numpy as np

from specjax import cli
from specjax.data.corpus import corpus_files, read_source, split_of, stdlib_root
from specjax.decoding.prompts import _candidates, prompt_text
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
        cands = _candidates(lines)
        for i, body_start in sorted(rng.sample(cands, min(per_file, len(cands)))):
            text = prompt_text(lines, i, body_start, context_lines, max_chars)
            if text.strip():
                out.append({"id": f"{rel}:{i + 1}", "prompt": text, "source": rel,
                            "split": own_split(rel, val_fraction)})
    return out


def _done_ids(path: str, truncate: bool = True) -> set[str]:
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


def _check_out_dir(out_dir: str) -> None:
    """SpecjaxError unless `out_dir` is a directory or could be made one (creates
    nothing)."""
    probe = existing_ancestor(out_dir)
    if not os.path.isdir(probe):
        what = "is a file" if probe == os.path.abspath(out_dir) else f"is under a file, {probe}"
        raise SpecjaxError(f"--out {out_dir} {what}; pass a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecjaxError(f"--out {out_dir}: {probe} is not writable; pass a writable "
                           "directory")


def regenerate(target_dir: str, out_dir: str, *, per_file: int = 4, seed: int = 0,
               max_chars: int = 800, max_new_tokens: int = 128, batch_size: int = 32,
               limit: int | None = None, val_fraction: float = 0.05,
               skip_seen: tuple[str, ...] = (), dtype: str = "auto",
               time_limit_s: float | None = None, root: str | None = None,
               data: str | None = None, temperature: float = 0.0) -> dict:
    """Generates and writes the data set (module docstring); returns the manifest.

    `skip_seen`: earlier output directories whose prompt ids (def sites) are left out, so
    a set made with another seed or a larger `per_file` holds only new prompts.
    `dtype`: the target's dtype while generating, "float32", "bfloat16", or "auto"
    (float32 on CPU, bfloat16 elsewhere). For the model that `decode.py` runs on CPU from
    another backend, pass "float32" and set JAX_DEFAULT_MATMUL_PRECISION=highest (GPUs
    otherwise multiply f32 in TF32); near-ties may still break differently (summation
    order).
    `root`: the corpus directory (default: this interpreter's standard library; another
    Python's library gives other files, and its own hash split of them).
    `time_limit_s`: start no batch after this many seconds from the start of generation
    (compilation excluded; the first batch always runs), then write the streams of what
    is done; a later call resumes. Batches hold prompts of similar lengths and run in a
    seeded random order, so a stopped run is a sample of every length.
    `data`: the user's conversations (JSONL) instead of stdlib prompts (module docstring);
    needs a target with a chat template. `temperature`: 0 = greedy, else sampled with
    the run's `seed` (each batch from its own key).

    Raises: SpecjaxError for a target without a tokenizer or EOS id, bad settings, an
    `out_dir` that is a file or cannot be created (checked first; a refused call creates
    no directory), or a `skip_seen` directory without generations.jsonl.
    """
    import jax
    from tqdm import tqdm

    from specjax.decoding.engine import Engine, prompt_width_for
    from specjax.models.checkpoint import load_model, load_tokenizer, parse_dtype
    from specjax.models.config import ModelConfig

    for name, v in (("--prompts-per-file", per_file), ("--max-new-tokens", max_new_tokens),
                    ("--batch-size", batch_size), ("--max-chars", max_chars)):
        if v < 1:
            raise SpecjaxError(f"{name}={v} must be >= 1")
    if time_limit_s is not None and time_limit_s <= 0:
        raise SpecjaxError(f"--time-limit={time_limit_s} must be > 0")
    if limit is not None and limit < 1:
        raise SpecjaxError(f"--limit={limit} must be >= 1")
    if temperature < 0:
        raise SpecjaxError(f"--temperature={temperature} must be >= 0")
    _check_out_dir(out_dir)
    cfg = ModelConfig.from_dir(target_dir)
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise SpecjaxError(f"{target_dir}: no tokenizer files; the prompts are text")
    if not cfg.eos_token_ids:
        raise SpecjaxError(f"{target_dir}: the config names no eos_token_id")
    eos_id, stops = cfg.eos_token_ids[0], None
    if data is not None:
        from specjax.data import chat

        if not chat.has_chat_template(tokenizer):
            raise SpecjaxError(f"--data needs a chat template, and the tokenizer of --target "
                               f"{target_dir} has none (chat_template.jinja or "
                               "tokenizer_config.json's chat_template)")
        eot = chat.end_of_turn_ids(tokenizer)
        eos_id = eot[0]
        stops = tuple(dict.fromkeys((*eot, *cfg.eos_token_ids)))

    seen = set()
    for d in skip_seen:
        path = os.path.join(d, GENERATIONS)
        if not os.path.isfile(path):
            raise SpecjaxError(f"--skip-seen {d}: no {GENERATIONS} there")
        if os.path.abspath(d) == os.path.abspath(out_dir):
            raise SpecjaxError(f"--skip-seen {d} is the output directory")
        seen |= _done_ids(path, truncate=False)  # another run's file: read only
    if data is not None:
        prompts = conversation_prompts(tokenizer, data, val_fraction)
    else:
        prompts = training_prompts(per_file, seed, max_chars=max_chars,
                                   val_fraction=val_fraction, root=root)
    prompts = [p for p in prompts if p["id"] not in seen]
    if not prompts:
        raise SpecjaxError("no prompts left after --skip-seen")
    rng = random.Random(seed)
    rng.shuffle(prompts)  # a prefix (--limit) samples every part of the corpus
    if limit is not None:
        prompts = prompts[:limit]
    for p in prompts:
        if "prompt_ids" not in p:
            p["prompt_ids"] = tokenizer(p["prompt"])["input_ids"]
    prompts = [p for p in prompts if p["prompt_ids"]]
    longest = max(len(p["prompt_ids"]) for p in prompts)
    max_length = longest + max_new_tokens
    if max_length > cfg.max_position_embeddings:
        what = "the longest conversation" if data is not None else f"--max-chars {max_chars}"
        raise SpecjaxError(f"{what}: prompts of {longest} tokens + "
                           f"{max_new_tokens} new exceed the target's "
                           f"max_position_embeddings {cfg.max_position_embeddings}")
    bad = [i for p in prompts for i in p["prompt_ids"] if not 0 <= i < cfg.vocab_size]
    if bad:
        raise SpecjaxError(f"token id {bad[0]} of a prompt is outside the target's vocabulary "
                           f"[0, {cfg.vocab_size}); the tokenizer does not match the target")
    try:  # only now: a call refused above creates nothing
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise SpecjaxError(f"--out {out_dir} cannot be created ({e.strerror}); pass a "
                           "writable directory") from None
    gen_path = os.path.join(out_dir, GENERATIONS)
    done = _done_ids(gen_path)
    todo = [p for p in prompts if p["id"] not in done]
    todo.sort(key=lambda p: len(p["prompt_ids"]))  # similar lengths share a batch
    print(f"regenerate: {len(prompts)} prompts ({len(done)} done before), "
          f"batch {batch_size}, {max_new_tokens} new tokens each", file=sys.stderr)
    if todo:
        if dtype == "auto":
            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        target = load_model(target_dir, dtype=parse_dtype(dtype))
        from specjax.core.sampling import SamplingParams

        engine = Engine(target, max_length=max_length,
                        prompt_width=prompt_width_for(longest, max_length),
                        batch_size=batch_size, eos_token_ids=stops or cfg.eos_token_ids,
                        sampling=SamplingParams(temperature))
        engine.compile()
        key = jax.random.key(seed)
        t0, new = time.perf_counter(), 0
        batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
        random.Random(seed + 1).shuffle(batches)
        with open(gen_path, "a") as f, tqdm(total=len(todo), desc="regenerate", unit="prompt",
                                            file=sys.stderr, disable=None) as bar:
            for n, batch in enumerate(batches):
                if (n and time_limit_s is not None
                        and time.perf_counter() - t0 > time_limit_s):
                    print(f"regenerate: --time-limit {time_limit_s:g} s reached after "
                          f"{n} of {len(batches)} batches; run again to resume",
                          file=sys.stderr)
                    break
                out = engine.run([p["prompt_ids"] for p in batch], max_new_tokens,
                                 jax.random.fold_in(key, n))
                for p, ids in zip(batch, out.outputs, strict=True):
                    f.write(json.dumps({"id": p["id"], "source": p["source"],
                                        "split": p["split"], "prompt_ids": p["prompt_ids"],
                                        "output_ids": ids}) + "\n")
                    new += len(ids)
                f.flush()
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{new / (time.perf_counter() - t0):.0f}")
    counts = build_streams(out_dir, eos_id, cfg.vocab_size, stops)
    manifest = {"target": os.path.abspath(target_dir), "seed": seed,
                "data": None if data is None else os.path.abspath(data),
                "temperature": temperature, "stop_ids": list(stops or (eos_id,)),
                "prompts_per_file": per_file, "max_chars": max_chars,
                "max_new_tokens": max_new_tokens, "limit": limit,
                "val_fraction": val_fraction, "eos_id": eos_id, "dtype": dtype,
                "backend": jax.default_backend(),
                "root": os.path.abspath(root or stdlib_root()),
                "skip_seen": [os.path.abspath(d) for d in skip_seen], "splits": counts}
    atomic_write(os.path.join(out_dir, MANIFEST),
                 lambda f: f.write(json.dumps(manifest, indent=1).encode("utf-8")))
    return manifest


def main(argv=None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = cli.ArgumentParser(
        prog="specjax.regenerate",
        description="The target's greedy continuations of training-file prompts, "
                    "as token streams for drafter training.")
    ap.add_argument("--target", default=os.path.join(here, "checkpoints", "demo", "target"))
    ap.add_argument("--out", required=True, help="output directory (resumes if present)")
    ap.add_argument("--data", default=None, metavar="FILE.jsonl",
                    help="the user's conversations (OpenAI messages or ShareGPT JSONL): the "
                         "target answers each up to its last user turn with its chat "
                         "template; writes loss masks too (default: stdlib prompts)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--val-fraction", type=float, default=0.05,
                    help="share of prompt files (or conversations) in the val split")
    ap.add_argument("--prompts-per-file", type=int, default=4)
    ap.add_argument("--max-chars", type=int, default=800, help="prompt length cap")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the target's dtype while generating (auto: float32 on CPU, "
                         "bfloat16 on TPU/GPU)")
    ap.add_argument("--root", default=None, metavar="DIR",
                    help="corpus directory (default: this Python's standard library)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="stop after this many seconds of generation (resumable)")
    ap.add_argument("--skip-seen", nargs="+", default=[], metavar="DIR",
                    help="earlier output directories whose prompts are left out")
    args = ap.parse_args(argv)
    try:
        m = regenerate(args.target, args.out, per_file=args.prompts_per_file, seed=args.seed,
                       max_chars=args.max_chars, max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, limit=args.limit,
                       skip_seen=tuple(args.skip_seen), dtype=args.dtype,
                       time_limit_s=args.time_limit, root=args.root, data=args.data,
                       temperature=args.temperature, val_fraction=args.val_fraction)
    except SpecjaxError as e:
        print(f"specjax.regenerate: error: {e}", file=sys.stderr)
        return 2
    for split, c in m["splits"].items():
        mask = (f" + {split}_loss_mask.npy ({c['target_tokens']} target tokens)"
                if "target_tokens" in c else "")
        print(f"{split}: {c['prompts']} prompts, {c['tokens']} tokens "
              f"({c['new_tokens']} generated) -> {os.path.join(args.out, split + '.npy')}"
              + mask)
    return 0


if __name__ == "__main__":
    sys.exit(main())
