"""Constraints of a prompt set, host-side: which prompt follows which pattern
(`ConstrainedIds`), the automata compiled once per pattern and tokenizer (`compile_cached`,
memory and an on-disk cache), and the stacked table an engine compiles its loop for
(`ConstraintSet`, whose shapes do not change from batch to batch).

    from specjax.constraints import ConstrainedIds, ConstraintSet, compile_cached
    auto = compile_cached(r"[0-9]{3}-[0-9]{4}", target_dir, eos_ids, vocab_size)
    cset = ConstraintSet([auto], eos_ids, vocab_size)
    engine = Engine(target, ..., constraints=cset)
    engine.run([ConstrainedIds(ids, auto.pattern)], max_new_tokens, key)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

from specjax.constraints.automaton import (
    DEFAULT_MAX_TABLE_BYTES,
    TokenAutomaton,
    compile_regex,
    regex_from_json_schema,
)
from specjax.constraints.loop import Constraint, stack_automata, with_rows
from specjax.errors import SpecjaxError


class ConstrainedIds(list):
    """A prompt's token ids (a list of ints, usable wherever one is) that carry the regex
    its output must match (`regex`, None: unconstrained)."""

    def __init__(self, ids, regex: str | None = None):
        super().__init__(ids)
        self.regex = regex


def regex_of(regex=None, json_schema=None, where: str = "") -> str | None:
    """The regex of a constraint given as a regex or as a JSON schema (a dict, or JSON
    text); None for neither. Raises SpecjaxError (one line, prefixed with `where`) for
    both, a regex that is not a string, or a schema outlines-core cannot turn into a
    regex."""
    at = f"{where}: " if where else ""
    if regex is not None and json_schema is not None:
        raise SpecjaxError(f"{at}give a regex or a JSON schema, not both")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise SpecjaxError(f"{at}the regex must be a non-empty string")
        return regex
    if json_schema is None:
        return None
    try:
        return regex_from_json_schema(json_schema)
    except SpecjaxError as e:
        raise SpecjaxError(f"{at}{e}") from None


def read_schema_file(path: str) -> dict:
    """The JSON schema in `path` (--json-schema). Raises SpecjaxError (one line)."""
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise SpecjaxError(f"--json-schema {path} is unreadable ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecjaxError(f"--json-schema {path}: not a JSON file ({' '.join(str(e).split())[:120]})"
                           ) from None
    if not isinstance(schema, dict):
        raise SpecjaxError(f"--json-schema {path}: a schema is a JSON object")
    return schema


_MEMORY: dict[str, TokenAutomaton] = {}
CACHE_VERSION = 1


def _tokenizer_digest(tokenizer_dir: str) -> str:
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "missing"


def cache_key(pattern: str, tokenizer_dir: str, eos_ids, vocab_size: int) -> str:
    """The tables' key: the pattern, the tokenizer file's content, the eos ids, V and the
    outlines-core version (a new release may compile differently)."""
    import outlines_core

    blob = json.dumps([CACHE_VERSION, pattern, _tokenizer_digest(tokenizer_dir),
                       sorted(int(e) for e in eos_ids), int(vocab_size),
                       getattr(outlines_core, "__version__", "?")])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def compile_cached(pattern: str, tokenizer_dir: str, eos_ids, vocab_size: int,
                   cache_dir: str | None = None,
                   max_table_bytes: int = DEFAULT_MAX_TABLE_BYTES) -> TokenAutomaton:
    """`compile_regex` once per (pattern, tokenizer, eos ids, V): in this process's memory
    and, with `cache_dir`, as CACHE_DIR/KEY.npz (`cache_key`), written atomically; an
    unreadable or stale file is compiled again. Raises what `compile_regex` raises."""
    key = cache_key(pattern, tokenizer_dir, eos_ids, vocab_size)
    if key in _MEMORY:
        return _MEMORY[key]
    path = None if cache_dir is None else os.path.join(cache_dir, key + ".npz")
    auto = None
    if path is not None and os.path.isfile(path):
        try:
            with np.load(path) as z:
                if str(z["pattern"]) == pattern:
                    auto = TokenAutomaton(pattern, z["token_class"], z["next_state"],
                                          z["final"])
        except (OSError, ValueError, KeyError):
            auto = None
    if auto is None:
        auto = compile_regex(pattern, tokenizer_dir, eos_ids, vocab_size, max_table_bytes)
        if path is not None:
            try:
                os.makedirs(cache_dir, exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp.npz"
                np.savez(tmp, pattern=np.array(pattern), token_class=auto.token_class,
                         next_state=auto.next_state, final=auto.final)
                os.replace(tmp, path)
            except OSError:  # a read-only cache: compile again next time
                pass
    _MEMORY[key] = auto
    return auto


class ConstraintSet:
    """The automata of a prompt set stacked into one table (`specjax.constraints.loop`),
    plus the one-state automaton of unconstrained rows, so that every batch of the set
    has the same table shapes (one compiled loop). automata: distinct patterns; eos_ids,
    vocab_size: the target's."""

    def __init__(self, automata: Sequence[TokenAutomaton], eos_ids, vocab_size: int):
        self.automata = list(automata)
        self.index = {a.pattern: i for i, a in enumerate(self.automata)}
        if len(self.index) != len(self.automata):
            raise ValueError("ConstraintSet: one automaton per pattern")
        self.eos_ids = tuple(eos_ids)
        self.vocab_size = vocab_size
        self.table_bytes = sum(a.table_bytes for a in self.automata)
        # stacked once: a batch only sets its rows' automata and start states
        self._tables, self._starts = stack_automata(self.automata, self.eos_ids, vocab_size)

    def rows(self, prompts, batch_size: int) -> Constraint:
        """The `Constraint` of one batch: row b follows prompts[b]'s `regex` (a
        `ConstrainedIds`; plain lists and padding rows are unconstrained).
        Raises SpecjaxError for a regex this set was not built with."""
        which = []
        for ids in prompts:
            regex = getattr(ids, "regex", None)
            if regex is not None and regex not in self.index:
                raise SpecjaxError(f"a prompt's regex {regex[:60]!r} is not in the engine's "
                                   "ConstraintSet")
            which.append(None if regex is None else self.index[regex])
        which += [None] * (batch_size - len(which))
        return with_rows(self._tables, self._starts, which)

    def matched(self, regex: str, output_ids) -> bool:
        """Whether output_ids (new tokens, an end-of-sequence token included or not)
        walk pattern `regex`'s automaton to an accepting state."""
        auto = self.automata[self.index[regex]]
        state = 0
        for t in output_ids:
            state = auto.step(state, int(t))
            if state < 0:
                return False
        return bool(auto.final[state])

    def __repr__(self):
        return (f"ConstraintSet({len(self.automata)} automata, "
                f"{self.table_bytes:,} table bytes)")
