"""Held-out code-completion prompts for the demo: prefixes of VALIDATION files only.

    python -m specjax.decoding.prompts checkpoints/demo/prompts.jsonl --n 50

(the command line is `specjax.tools.prompts`; the `def` sites and the prompt text are
`specjax.data.code_prompts`'s, shared with the regenerated training data)

How a prompt is chosen (deterministic for a given standard library and seed):
  1. Validation files (`specjax.data.corpus.split_of`) in sorted order, shuffled by `seed`.
  2. In each file, the top-level or method `def` lines whose function body is at least
     4 lines; one is picked at random (seeded).
  3. The prompt is the file's text from at most `context_lines` lines before that `def`
     through the `def` line and, if present, its docstring: the model is asked to write
     the function body.
  4. One prompt per file, until `n` prompts; prompts over `max_chars` are trimmed from the
     front at a line boundary.

`read_prompts` reads a prompts file (or one text prompt) as decode.py's --prompts and
--prompt do: text, token ids, or conversations rendered with the target's chat template.
"""

from __future__ import annotations

import json
import random
import sys

from specjax.data.code_prompts import def_sites, prompt_text
from specjax.data.corpus import corpus_files, read_source, split_of, stdlib_root
from specjax.errors import SpecjaxError


def held_out_prompts(n: int = 50, seed: int = 0, context_lines: int = 30,
                     max_chars: int = 1500, root: str | None = None) -> list[dict]:
    """[{"id", "prompt", "source"}] from validation files only (see the module docstring)."""
    root = root or stdlib_root()
    files = [f for f in corpus_files(root) if split_of(f) == "val"]
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for rel in files:
        lines = read_source(root, rel).splitlines(keepends=True)
        cands = def_sites(lines)
        if not cands:
            continue
        i, body_start = rng.choice(cands)
        text = prompt_text(lines, i, body_start, context_lines, max_chars)
        out.append({"id": f"{rel}:{i + 1}", "prompt": text, "source": rel})
        if len(out) == n:
            break
    return out


def read_prompts(tokenizer, vocab_size: int, *, prompt: str | None = None,
                 path: str | None = None, target: str | None = None, chat: bool = False
                 ) -> list[tuple[str, list[int]]]:
    """[(id, input_ids)] of `read_prompt_set` (the prompts only)."""
    return read_prompt_set(tokenizer, vocab_size, prompt=prompt, path=path, target=target,
                           chat=chat)[0]


def read_prompt_set(tokenizer, vocab_size: int, *, prompt: str | None = None,
                    path: str | None = None, target: str | None = None, chat: bool = False
                    ) -> tuple[list[tuple[str, list[int]]], bool]:
    """([(id, input_ids)], rendered) from the text `prompt` (--prompt) or else the JSONL
    `path` (--prompts; None: the bundled prompts, UTF-8, a leading BOM allowed), as
    decode.py reads them: JSON objects with "prompt" (text, encoded with `tokenizer`),
    "input_ids" (a list of ints), or a conversation, "messages" (OpenAI) or
    "conversations" (ShareGPT), an optional "id", and an optional constraint on the
    output, "regex" (a pattern) or "json_schema" (a schema object): the prompt's ids are
    then a `specjax.constraints.ConstrainedIds` carrying the pattern (the schema's regex,
    docs/structured.md); `vocab_size` bounds the ids and
    `target` names the tokenizer's directory in errors. Nothing is changed.

    Conversations are rendered with the tokenizer's chat template up to and including
    their last user turn, with the generation prompt (`specjax.data.chat.prompt_ids`:
    the ids of transformers' `apply_chat_template(..., add_generation_prompt=True)`).
    With `chat`, a text prompt (--prompt, or a "prompt" line) is one user turn, rendered
    the same way. `rendered` is True when any prompt went through the chat template (the
    caller then also stops at the template's end-of-turn token).

    Raises: SpecjaxError (one line naming the file and line, or --prompt) for an
      unreadable file, a line that is not UTF-8 or not a JSON object with "prompt",
      "input_ids", "messages" or "conversations", a malformed conversation (unknown role,
      no user turn, ...), a conversation or `chat` without a chat template in the
      tokenizer, text with lone surrogates (not Unicode: a --prompt argument holding
      bytes that are not UTF-8, or an unpaired \\udXXX JSON escape), an empty prompt
      or a token id outside [0, vocab_size), and for a "regex" that is not a string or a
      "json_schema" outlines-core cannot turn into a regex."""
    from specjax.decoding.loading import DEMO_PROMPTS

    def check_text(text, where, what="the prompt"):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SpecjaxError(
                f"{where}: {what} holds a lone surrogate (U+{ord(text[e.start]):04X} at "
                f"character {e.start}), which is not Unicode text; pass UTF-8 text"
                + ("" if where == "--prompt" else " (a JSON \\udXXX escape needs its pair)")
            ) from None

    def encode(text, where):
        check_text(text, where)
        if tokenizer is None:
            raise SpecjaxError(f"{where}: text prompts need a tokenizer in --target "
                               f"{target}; give \"input_ids\" instead")
        if chat:
            return render([{"role": "user", "content": text}], where)
        return list(tokenizer.encode(text))

    def render(messages, where):
        from specjax.data import chat as chat_lib

        for m in messages:
            check_text(m["content"], where, f"a {m['role']} message")
        if tokenizer is None or not chat_lib.has_chat_template(tokenizer):
            raise SpecjaxError(f"{where}: chat needs a chat template, and the tokenizer of "
                               f"--target {target} has none (chat_template.jinja or "
                               "tokenizer_config.json's chat_template); pass text prompts "
                               "without --chat")
        try:
            messages = chat_lib.messages_until_last_user(messages)
        except SpecjaxError as e:
            raise SpecjaxError(f"{where}: {e}") from None
        rendered.append(where)
        return chat_lib.prompt_ids(tokenizer, messages)

    items, rendered = [], []
    if prompt is not None:
        items.append(("0", encode(prompt, "--prompt"), "--prompt"))
    else:
        file = path or DEMO_PROMPTS
        try:
            with open(file, "rb") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise SpecjaxError(f"--prompts {file} is unreadable ({e.strerror}); "
                               "pass a JSONL file or --prompt TEXT") from None
        for n, raw in enumerate(lines, 1):
            where = f"{file} line {n}"
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise SpecjaxError(f"{where}: byte 0x{raw[e.start]:02x} at column "
                                   f"{e.start + 1} is not UTF-8; save the file as UTF-8 "
                                   "JSONL") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecjaxError(f"{where}: malformed JSON ({e.msg}); each line must be "
                                   "one JSON object") from None
            conversation = isinstance(obj, dict) and ("messages" in obj
                                                      or "conversations" in obj)
            if not isinstance(obj, dict) or not (conversation or "prompt" in obj
                                                 or "input_ids" in obj):
                raise SpecjaxError(f"{where}: needs a \"prompt\" (text), \"input_ids\" "
                                   "(list of ints), or \"messages\" (a conversation) field")
            if conversation:
                from specjax.data.chat import normalise_conversation

                conv = normalise_conversation(file, n, obj, len(items))
                ids = render(conv["messages"], where)
            elif "input_ids" in obj:
                ids = obj["input_ids"]
                if not isinstance(ids, list) or not all(
                        isinstance(i, int) and not isinstance(i, bool) for i in ids):
                    raise SpecjaxError(f"{where}: \"input_ids\" must be a list of ints")
            else:
                if not isinstance(obj["prompt"], str):
                    raise SpecjaxError(f"{where}: \"prompt\" must be a string")
                ids = encode(obj["prompt"], where)
            if "regex" in obj or "json_schema" in obj:  # structured output, this prompt's
                from specjax.constraints.sets import ConstrainedIds, regex_of

                ids = ConstrainedIds(ids, regex_of(obj.get("regex"), obj.get("json_schema"),
                                                   where))
            pid = str(obj.get("id", len(items)))
            check_text(pid, where, "the \"id\"")
            items.append((pid, ids, where))
    if not items:
        raise SpecjaxError(f"--prompts {path or DEMO_PROMPTS}: "
                           "no prompts found")
    for _, ids, where in items:
        if not ids:
            raise SpecjaxError(f"{where}: the prompt is empty")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise SpecjaxError(f"{where}: token id {bad[0]} is outside the vocabulary "
                               f"[0, {vocab_size})")
    return [(pid, ids) for pid, ids, _ in items], bool(rendered)


if __name__ == "__main__":  # `python -m specjax.decoding.prompts`: specjax.tools.prompts
    from specjax.tools.prompts import main

    sys.exit(main())
