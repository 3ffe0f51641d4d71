"""A regex or JSON schema as a token-level automaton over a target's vocabulary, stored as
the arrays a static-shape loop reads (issue 55; docs/studies/structured.md says why
outlines-core builds it).

outlines-core (`outlines_core.Index`) compiles a regex into a DFA over bytes and walks every
token of a vocabulary through it from every reachable state; `Index.get_transitions()` is
the complete table {state: {token id: next state}} (a token absent from a state's dict is
not allowed there), `get_final_states()` the accepting states. llguidance and xgrammar
expose only incremental matchers (no enumerable state), which a jitted loop cannot use.
A JSON schema becomes a regex first (`outlines_core.json_schema.build_regex_from_schema`).

specjax gives outlines-core the vocabulary as raw bytes (byte-level BPE tokens mapped back
through GPT-2's byte-to-unicode table, so a token holding part of a UTF-8 character is
exact), without special tokens (they are not text) or empty tokens, and compiles `(?:R)$`
(anchored at both ends; see `compile_regex`).

The table is compressed into token classes (tokens whose next state is the same in every
state share a column):

    token_class  i32[V]    class of each token id (V: the target's logits width)
    next_state   i32[S,C]  next state of class c in state s; DEAD (-1): not allowed
    final        bool[S]   accepting states (end-of-sequence tokens allowed there)

States are renumbered 0..S-1 in breadth-first order from the initial state (state 0).
End-of-sequence tokens (the target's eos ids) form their own class: allowed in final
states only, where they keep the state (the row then stops). Ids that are neither in the
tokenizer nor eos (the padded rows of a logits matrix) are never allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from specjax.errors import SpecjaxError

DEAD = -1
# a grammar whose compressed table exceeds this is refused (S x C x 4 bytes + V x 4)
DEFAULT_MAX_TABLE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
    """The arrays of one constraint (module docstring); `pattern` the regex compiled."""

    pattern: str
    token_class: np.ndarray  # i32[V]
    next_state: np.ndarray  # i32[S,C]
    final: np.ndarray  # bool[S]

    @property
    def num_states(self) -> int:
        return int(self.next_state.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.next_state.shape[1])

    @property
    def table_bytes(self) -> int:
        return int(self.token_class.nbytes + self.next_state.nbytes + self.final.nbytes)

    def allowed(self, state: int) -> np.ndarray:
        """bool[V]: the tokens allowed in `state`."""
        return self.next_state[state][self.token_class] != DEAD

    def step(self, state: int, token: int) -> int:
        """The state after `token` (DEAD if it is not allowed)."""
        return int(self.next_state[state, self.token_class[token]])


def _brief(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def byte_vocabulary(tokenizer_dir: str) -> dict[bytes, list[int]]:
    """{token bytes: [ids]} of a Hugging Face tokenizer directory's tokenizer.json: every
    non-special token with non-empty bytes. Byte-level BPE vocabularies (GPT-2, Qwen,
    Llama-3) map back through the byte-to-unicode table; others must be byte-level too.

    Raises: SpecjaxError if tokenizer.json is missing or not a byte-level BPE."""
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecjaxError(f"{path}: cannot read the tokenizer ({e})") from None
    decoder = raw.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    if "ByteLevel" not in kinds:
        raise SpecjaxError(f"{path}: constraints need a byte-level BPE tokenizer (decoder "
                           f"{decoder.get('type')!r}); Qwen3 and Llama-3 tokenizers are")
    special = {t["id"] for t in raw.get("added_tokens") or [] if t.get("special")}
    table = _byte_decoder()
    vocab: dict[bytes, list[int]] = {}
    entries = list((raw.get("model") or {}).get("vocab", {}).items())
    entries += [(t["content"], t["id"]) for t in raw.get("added_tokens") or []
                if not t.get("special")]
    for text, i in entries:
        if i in special:
            continue
        try:
            b = bytes(table[c] for c in text)
        except KeyError:  # a non-special added token stored as plain text
            b = text.encode("utf-8")
        if b:
            vocab.setdefault(b, []).append(int(i))
    return vocab


# Keywords outlines-core 0.2.14 accepts but leaves out of the regex (numeric bounds become
# any number, oneOf becomes anyOf, ...): an output could match the regex and break them.
UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
              "uniqueItems", "minProperties", "maxProperties", "patternProperties",
              "dependentRequired", "dependentSchemas", "dependencies", "contains",
              "minContains", "maxContains", "propertyNames", "oneOf", "not", "if", "then",
              "else", "unevaluatedProperties", "unevaluatedItems",
              "allOf")  # allOf: 0.2.14 concatenates the parts' regexes (not JSON)
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "prefixItems", "items")


def unenforced_keywords(schema, path: str = "") -> list[tuple[str, str]]:
    """[(JSON pointer, keyword)]: the keywords of `schema` (a dict) that the regex would
    not enforce (`UNENFORCED`), in every subschema."""
    if not isinstance(schema, dict):
        return []
    out = [(path or "/", k) for k in schema if k in UNENFORCED]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                out += unenforced_keywords(sub, f"{path}/{key}/{name}")
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), dict):
            out += unenforced_keywords(schema[key], f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                out += unenforced_keywords(sub, f"{path}/{key}/{i}")
    return out


def regex_from_json_schema(schema) -> str:
    """The regex of a JSON schema (a dict or its JSON text), by outlines-core.

    Raises: SpecjaxError for a schema outlines-core cannot turn into a regex, or one with
    a keyword the regex would not enforce (`UNENFORCED`: an output could then match the
    regex and still fail validation)."""
    from outlines_core.json_schema import build_regex_from_schema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SpecjaxError(f"the JSON schema is not JSON ({e.msg})") from None
    if not isinstance(schema, dict):
        raise SpecjaxError("the JSON schema must be a JSON object")
    bad = unenforced_keywords(schema)
    if bad:
        where, key = bad[0]
        raise SpecjaxError(f"JSON schema keyword {key!r} at {where} is not enforced by "
                           f"outlines-core's regex (an output could break it): remove it "
                           f"(oneOf: anyOf), or constrain with --regex")
    text = json.dumps(schema)
    try:
        return build_regex_from_schema(text)
    except Exception as e:  # outlines-core raises ValueError / TypeError / its own
        raise SpecjaxError(f"JSON schema not supported ({_brief(e)})"
                           ) from None


def compile_regex(pattern: str, tokenizer_dir: str, eos_ids, vocab_size: int,
                  max_table_bytes: int = DEFAULT_MAX_TABLE_BYTES) -> TokenAutomaton:
    """The token automaton of `pattern` (a whole-output match) over the tokenizer.

    Args:
      pattern: a regex (Rust `regex` syntax, which outlines-core compiles); the output
        must match all of it. Compiled as `(?:pattern)$`: outlines-core 0.2.14 otherwise
        drops tokens that continue a match past a point where the pattern already
        matches (its own fix came after that release).
      tokenizer_dir: the target's HF directory (tokenizer.json); eos_ids: the target's
        end-of-sequence ids; vocab_size: V, the width of its logits.
    Raises: SpecjaxError for a pattern that does not compile, one no output can match,
      or a table over max_table_bytes (the message gives its size)."""
    from outlines_core import Index, Vocabulary

    eos_ids = sorted({int(e) for e in eos_ids})
    if not eos_ids:
        raise SpecjaxError("a constraint needs the target's end-of-sequence id")
    vocab = {b: [i for i in ids if i not in eos_ids and i < vocab_size]
             for b, ids in byte_vocabulary(tokenizer_dir).items()}
    vocab = {b: ids for b, ids in vocab.items() if ids}
    try:
        index = Index(f"(?:{pattern})$", Vocabulary(eos_ids[0], vocab))
    except Exception as e:  # outlines-core raises ValueError and its own errors
        why = _brief(e)
        if "universal start state" in why:  # outlines-core's words for this case
            why = ("it matches the empty output, which outlines-core does not compile: "
                   "require at least one character")
        raise SpecjaxError(f"regex {pattern[:80]!r} does not compile against this vocabulary "
                           f"({why})") from None
    trans = index.get_transitions()
    finals = set(index.get_final_states())
    # breadth-first renumbering from the initial state: only reachable states
    order, seen = [index.get_initial_state()], {index.get_initial_state(): 0}
    for s in order:
        for nxt in trans.get(s, {}).values():
            if nxt not in seen:
                seen[nxt] = len(order)
                order.append(nxt)
    S = len(order)
    eos = eos_ids[0]

    def edges(s) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, next states renumbered), i64[n] each: the tokens state s allows
        (end of sequence and ids >= V left out)."""
        d = trans.get(s, {})
        ids = np.fromiter((t for t in d if t != eos), np.int64)
        nxt = np.fromiter((seen[v] for t, v in d.items() if t != eos), np.int64)
        keep = ids < vocab_size
        return ids[keep], nxt[keep]

    def column(s) -> np.ndarray:  # i64[V]: next state (renumbered) of every token in s
        col = np.full(vocab_size, DEAD, np.int64)
        ids, nxt = edges(s)
        col[ids] = nxt
        return col

    # Partition refinement, state by state: two tokens share a class while their next
    # states agree in every state so far. A state splits only the tokens it allows (a
    # sort of those, not of all V: 33 s -> 3 s for a JSON record at V = 151,936); the
    # tokens it forbids keep their class.
    cls = np.zeros(vocab_size, np.int64)
    cls[[e for e in eos_ids if e < vocab_size]] = 1  # eos: a class of its own
    fresh = 2
    for s in order:
        ids, nxt = edges(s)
        if len(ids):
            pairs, inv = np.unique(cls[ids] * (S + 1) + nxt, return_inverse=True)
            cls[ids] = fresh + inv.reshape(-1)
            fresh += len(pairs)
    _, cls = np.unique(cls, return_inverse=True)  # classes numbered 0..C-1
    cls = cls.reshape(-1)
    C = int(cls.max()) + 1
    size = S * C * 4 + vocab_size * 4 + S
    if size > max_table_bytes:
        raise SpecjaxError(f"regex {pattern[:80]!r}: its token automaton needs {size:,} bytes "
                           f"({S} states x {C} token classes), over the limit of "
                           f"{max_table_bytes:,}")
    rep = np.zeros(C, np.int64)
    rep[cls] = np.arange(vocab_size)  # one token of each class
    table = np.stack([column(s)[rep] for s in order]).astype(np.int32)
    final = np.array([s in finals for s in order])
    for e in eos_ids:  # end of sequence: allowed in accepting states, where it stays
        if e < vocab_size:
            table[final, cls[e]] = np.flatnonzero(final)
    if not final.any():
        raise SpecjaxError(f"regex {pattern[:80]!r}: no output over this vocabulary matches it")
    return TokenAutomaton(pattern, cls.astype(np.int32), table, final)
