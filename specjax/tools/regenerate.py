"""The target's continuations of training-file prompts (or its answers to the user's
conversations), as drafter training data: the command `python -m specjax.regenerate`.

    python -m specjax.regenerate --out runs/data/regen --prompts-per-file 4
    python -m specjax.regenerate --target DIR --data convs.jsonl --out runs/data/regen

The data set (its prompts, splits and files) is `specjax.data.regenerate`'s; this tool
runs the target over its prompts. Decoding is plain autoregressive greedy decoding of the
target (`specjax.decoding.engine.Engine`, no drafter), so the continuations are exactly
what `decode.py` at temperature 0 produces for such prompts (`--temperature T` samples
instead). With `--data`, the target answers each conversation, stopping at the config's
EOS or the template's end-of-turn token. SpecForge regenerates the assistant turns with
the target for the same reason: the drafter learns the target's own distribution.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from specjax import cli
from specjax.data.corpus import stdlib_root
from specjax.data.regenerate import (
    GENERATIONS,
    MANIFEST,
    build_streams,
    check_out_dir,
    conversation_prompts,
    done_ids,
    training_prompts,
)
from specjax.errors import SpecjaxError
from specjax.fileio import atomic_write


def regenerate(target_dir: str, out_dir: str, *, per_file: int = 4, seed: int = 0,
               max_chars: int = 800, max_new_tokens: int = 128, batch_size: int = 32,
               limit: int | None = None, val_fraction: float = 0.05,
               skip_seen: tuple[str, ...] = (), dtype: str = "auto",
               time_limit_s: float | None = None, root: str | None = None,
               data: str | None = None, temperature: float = 0.0) -> dict:
    """Generates and writes the data set (`specjax.data.regenerate`'s docstring says what
    it holds); returns the manifest.

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
    check_out_dir(out_dir)
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
        seen |= done_ids(path, truncate=False)  # another run's file: read only
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
    done = done_ids(gen_path)
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


def build_parser() -> cli.ArgumentParser:
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
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
