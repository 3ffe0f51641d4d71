"""Chat templates and conversation data: the one place in specjax that knows them.

Every rendering goes through transformers' `tokenizer.apply_chat_template` with the
target's own template (`chat_template.jinja` or tokenizer_config.json's `chat_template`),
so the token ids here are exactly the ones the target sees at inference.

Conversations (`read_conversations`) are JSONL, one per line, OpenAI format
`{"messages": [{"role", "content"}]}` or ShareGPT `{"conversations": [{"from", "value"}]}`,
normalised to roles system / user / assistant.

The loss mask (`conversation_ids_and_mask`): a drafter is trained on the tokens the target
writes, so the mask is 1 exactly on assistant turns, as SpecForge does
(github.com/sgl-project/SpecForge, specforge/data/preprocessing.py,
`_apply_loss_mask_from_chat_template`: tokens overlapping an assistant response span).
What is masked:
  1 on an assistant turn's text as the template renders it after the role header
    (including what the template puts there itself, e.g. Qwen3's `<think>\\n\\n</think>\\n\\n`
    in the last turn, or Llama-3's trimming of the content) and on the end-of-turn token
    that closes the turn (`<|im_end|>`, `<|eot_id|>`): the target must learn to stop;
  0 on BOS, system and user turns, role headers (`<|im_start|>assistant\\n`,
    `<|start_header_id|>assistant<|end_header_id|>\\n\\n`) and whatever follows the
    end-of-turn token (the "\\n" after `<|im_end|>`).
A token that straddles a span boundary (BPE merged a header's "\\n" with a leading "\\n"
of the content) counts as assistant: the overlap rule, as SpecForge's.

How the spans are found:
  - Templates with `{% generation %}` blocks: transformers'
    `apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)`
    (transformers docs, "Chat templates": training with assistant masks), extended by the
    end-of-turn token right after each masked run when the block leaves it out.
  - Other templates (Qwen3, Llama-3 and most released ones): by prefixes. For assistant
    message i, P_i = render(messages[:i], add_generation_prompt=True) as text; the
    full render must start with P_i (else SpecjaxError: the template does not render
    prefixes consistently); the span runs from len(P_i) through the first end-of-turn
    token text after it. Char spans map to tokens by the fast tokenizer's offsets on the
    full text (add_special_tokens=False), whose ids must equal apply_chat_template's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from specjax.errors import SpecjaxError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant"}
_SENTINEL = "SPECJAXSENTINEL7Q"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_chat_tokenizer(target_dir: str):
    """The tokenizer of `target_dir` (AutoTokenizer, local files only), which must carry
    a chat template.

    Raises: SpecjaxError (one line) when the directory has no readable tokenizer or no
      chat template."""
    import os

    import transformers

    if not os.path.isdir(target_dir):
        raise SpecjaxError(f"--target {target_dir} does not exist; pass a local HF model "
                           "directory")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    except Exception as e:  # tokenizers/transformers raise many types
        msg = " ".join(str(e).split())[:200]
        raise SpecjaxError(f"--target {target_dir} has no readable tokenizer ({msg})") from None
    if not has_chat_template(tok):
        raise SpecjaxError(f"--target {target_dir} has no chat template (chat_template.jinja "
                           "or tokenizer_config.json's chat_template); chat needs an "
                           "instruct model's tokenizer")
    return tok


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` carries a (non-empty) chat template."""
    t = getattr(tokenizer, "chat_template", None)
    return bool(t) and (not isinstance(t, dict) or any(t.values()))


def _template_text(tokenizer) -> str:
    t = tokenizer.chat_template
    if isinstance(t, dict):  # named templates: the default one renders
        t = t.get("default") or next(iter(t.values()))
    return t or ""


def _line_error(path: str, n: int, what: str) -> SpecjaxError:
    return SpecjaxError(f"{path} line {n}: {what}")


def normalise_conversation(path: str, n: int, obj, index: int) -> dict:
    """One JSONL object (line `n` of `path`, the `index`-th conversation) -> {"id", "line",
    "format", "messages"}, checked as `read_conversations` checks a line (decode.py's
    --prompts reads conversation lines with it)."""
    if not isinstance(obj, dict):
        raise _line_error(path, n, f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        fmt, raw, rkey, ckey = "openai", obj["messages"], "role", "content"
    elif "conversations" in obj:
        fmt, raw, rkey, ckey = "sharegpt", obj["conversations"], "from", "value"
    else:
        raise _line_error(path, n, 'neither "messages" (OpenAI) nor "conversations" '
                                   "(ShareGPT) is present")
    if not isinstance(raw, list):
        raise _line_error(path, n, f"{fmt} messages must be a list")
    if not raw:
        raise _line_error(path, n, "empty conversation (no messages)")
    messages = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _line_error(path, n, f"message {j} is not an object")
        role = m.get(rkey)
        norm = (role if role in ROLES else None) if fmt == "openai" else SHAREGPT_ROLES.get(
            role.lower() if isinstance(role, str) else role)
        if norm is None:
            known = ", ".join(ROLES if fmt == "openai" else sorted(SHAREGPT_ROLES))
            raise _line_error(path, n, f"message {j} has unknown {rkey} {role!r} (expected "
                                       f"one of {known})")
        content = m.get(ckey)
        if not isinstance(content, str):
            raise _line_error(path, n, f"message {j} {ckey} must be a string, got "
                                       f"{type(content).__name__}")
        if norm == "system" and j != 0:
            raise _line_error(path, n, f"message {j} is a system message; only the first "
                                       "message may be one")
        messages.append({"role": norm, "content": content})
    cid = obj.get("id", str(index))
    if not isinstance(cid, (str, int)) or isinstance(cid, bool):
        raise _line_error(path, n, '"id" must be a string or an integer')
    return {"id": str(cid), "line": n, "format": fmt, "messages": messages}


def read_conversations(path: str) -> list[dict]:
    """Reads conversations from a JSONL file.

    Each non-blank line (UTF-8; a BOM on line 1 is allowed) is an object with either
    "messages" (OpenAI: [{"role": system|user|assistant, "content": str}]) or
    "conversations" (ShareGPT: [{"from": system|human|user|gpt|assistant|chatgpt|bing|bard,
    "value": str}]), and optionally "id" (default: the conversation's 0-based index, as str).

    Returns: [{"id": str, "line": int (1-based), "format": "openai"|"sharegpt",
      "messages": [{"role": "system"|"user"|"assistant", "content": str}]}].
    Raises: SpecjaxError naming `PATH line N` for a line that is not UTF-8, not JSON or
      not an object, with neither key, an unknown role (tool roles included), non-string
      content, no messages, or a system message that is not first; a one-line
      SpecjaxError for a missing/unreadable file or one without conversations.
    """
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as e:
        raise SpecjaxError(f"--data {path} cannot be read ({e.strerror or e})") from None
    out = []
    for n, raw in enumerate(raw_lines, 1):
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _line_error(path, n, "not UTF-8") from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise _line_error(path, n, f"not JSON ({e.msg})") from None
        out.append(normalise_conversation(path, n, obj, len(out)))
    if not out:
        raise SpecjaxError(f"--data {path} holds no conversations")
    return out


def _ids(result) -> list[int]:
    """input_ids of what apply_chat_template(tokenize=True) returns (a list or, in
    transformers 5, a BatchEncoding)."""
    if isinstance(result, Mapping) or hasattr(result, "keys"):
        result = result["input_ids"]
    return [int(i) for i in result]


def _render(tokenizer, messages, what: str, **kw):
    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except Exception as e:  # jinja2 TemplateError, raise_exception() in templates
        msg = " ".join(str(e).split())[:200]
        raise SpecjaxError(f"the chat template cannot render {what} ({type(e).__name__}: "
                           f"{msg})") from None


def _is_special(tokenizer, tid: int) -> bool:
    return tid in set(tokenizer.all_special_ids) or tid in set(
        tokenizer.get_added_vocab().values())


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """The token(s) that close an assistant turn in this tokenizer's template: the first
    token of the text the template renders right after an assistant message
    (`<|im_end|>` for Qwen3, `<|eot_id|>` for Llama-3). Only what the template emits:
    callers add the config's EOS ids themselves where they want them.

    Raises: SpecjaxError when the template renders nothing after the assistant message
      or the first token there is not a special/added token."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    text = _render(tokenizer, probe, "a probe conversation", tokenize=False)
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise SpecjaxError("the chat template drops the assistant message's content; cannot "
                           "find its end-of-turn token")
    after = text[at + len(_SENTINEL):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids or not _is_special(tokenizer, ids[0]):
        raise SpecjaxError(f"the chat template closes an assistant turn with {after[:30]!r}, "
                           "not a special token; cannot tell where a turn ends")
    return (int(ids[0]),)


def prompt_ids(tokenizer, messages) -> list[int]:
    """i32-valued token ids of `messages` rendered with the generation prompt
    (`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`'s ids).

    Raises: SpecjaxError if the template fails or renders to no tokens."""
    ids = _ids(_render(tokenizer, messages, "the conversation", add_generation_prompt=True,
                       tokenize=True))
    if not ids:
        raise SpecjaxError("the chat template renders the conversation to no tokens")
    return ids


def conversation_ids_and_mask(tokenizer, messages) -> tuple[list[int], list[int]]:
    """The whole conversation's token ids (no generation prompt; equal to
    `apply_chat_template(messages, tokenize=True)`'s) and its loss mask (0/1 per token,
    same length): 1 on assistant turns and their end-of-turn token (module docstring).
    A conversation without an assistant turn gives an all-zero mask.

    Raises: SpecjaxError if the template fails or renders to no tokens, does not render
      prefixes consistently, or the offsets tokenization disagrees with
      apply_chat_template's ids."""
    ids = _ids(_render(tokenizer, messages, "the conversation", tokenize=True))
    if not ids:
        raise SpecjaxError("the chat template renders the conversation to no tokens")
    if not any(m["role"] == "assistant" for m in messages):
        return ids, [0] * len(ids)
    eot = end_of_turn_ids(tokenizer)
    if _GENERATION.search(_template_text(tokenizer)):
        return ids, _mask_from_generation(tokenizer, messages, ids, eot)
    text = _render(tokenizer, messages, "the conversation", tokenize=False)
    eot_texts = [tokenizer.convert_ids_to_tokens(i) for i in eot]
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], f"the prefix before turn {i}",
                         tokenize=False, add_generation_prompt=True)
        if not text.startswith(prefix):
            raise SpecjaxError(f"the chat template does not render prefixes consistently: the "
                               f"conversation up to assistant turn {i} with the generation "
                               "prompt is not a prefix of the whole conversation")
        start = len(prefix)
        ends = [text.find(t, start) for t in eot_texts]
        ends = [e + len(t) for e, t in zip(ends, eot_texts, strict=True) if e >= 0]
        if not ends:
            raise SpecjaxError(f"assistant turn {i}: no end-of-turn token after it")
        spans.append((start, min(ends)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if [int(i) for i in enc["input_ids"]] != ids:
        raise SpecjaxError("tokenizing the rendered conversation does not give "
                           "apply_chat_template's ids; cannot map turns to tokens")
    mask = [0] * len(ids)
    for k, (s, e) in enumerate(enc["offset_mapping"]):
        if any(s < b and e > a for a, b in spans):
            mask[k] = 1
    return ids, mask


def _mask_from_generation(tokenizer, messages, ids, eot) -> list[int]:
    """The mask of a template with {% generation %} blocks: transformers'
    assistant_masks, plus the end-of-turn token right after each masked run."""
    enc = _render(tokenizer, messages, "the conversation", tokenize=True, return_dict=True,
                  return_assistant_tokens_mask=True)
    if _ids(enc) != ids:
        raise SpecjaxError("apply_chat_template's ids differ with and without "
                           "return_assistant_tokens_mask")
    mask = [1 if int(v) else 0 for v in enc["assistant_masks"]]
    for k in range(len(mask) - 1):
        if mask[k] and not mask[k + 1] and ids[k + 1] in eot:
            mask[k + 1] = 1
    return mask


def messages_until_last_user(messages) -> list[dict]:
    """`messages` up to and including the last user turn (the prompt whose answer is
    regenerated).

    Raises: SpecjaxError if there is no user turn."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return list(messages[: i + 1])
    raise SpecjaxError("the conversation has no user turn")
