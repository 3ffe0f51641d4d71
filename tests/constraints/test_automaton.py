"""specjax.constraints.automaton against an independent reference: Python's `regex` module
over the decoded bytes of the demo's byte-level BPE vocabulary (8,192 tokens). A token is
allowed after a prefix exactly when the prefix's text plus the token's can still be
extended to a full match (`regex.fullmatch(..., partial=True)`), and a state is final
exactly when the text matches in full."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("outlines_core")
regex = pytest.importorskip("regex")

from specjax.constraints import automaton as am  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = os.path.join(ROOT, "checkpoints", "demo", "tokenizer")
V, EOS = 8192, 0


def _token_bytes():
    out = [None] * V
    for b, ids in am.byte_vocabulary(TOK).items():
        for i in ids:
            out[i] = b
    return out


TOKENS = _token_bytes()


def _viable(pattern, text: bytes) -> bool:
    try:
        s = text.decode("utf-8")
    except UnicodeDecodeError:  # a token that ends inside a UTF-8 character: the patterns
        return False            # below are ASCII, so such a prefix can never match
    return regex.fullmatch(pattern, s, partial=True) is not None


def _check(auto: am.TokenAutomaton, pattern: str, walks: int = 6, steps: int = 8):
    rng = np.random.default_rng(0)
    for _ in range(walks):
        state, text = 0, b""
        for _ in range(steps):
            allowed = auto.allowed(state)
            want = np.array([t is not None and t != b"" and _viable(pattern, text + t)
                             for t in TOKENS])
            np.testing.assert_array_equal(allowed[np.arange(V) != EOS], want[np.arange(V) != EOS])
            full = regex.fullmatch(pattern, text.decode("utf-8")) is not None
            assert bool(auto.final[state]) == full, text
            assert bool(allowed[EOS]) == full  # end of sequence only where it matches
            choices = np.flatnonzero(want)
            if len(choices) == 0:
                break
            t = int(rng.choice(choices))
            state, text = auto.step(state, t), text + TOKENS[t]
            assert state != am.DEAD


@pytest.mark.parametrize("pattern", [
    r"(yes|no|maybe)",
    r"[0-9]{1,3}(\.[0-9]+)?",
    r"(1|12)",
    r"def [a-z_]+\([a-z, ]*\):",
    r'\{"name": "[a-z ]{1,12}", "age": [0-9]{1,3}\}',
])
def test_table_equals_the_regex_over_the_vocabulary(pattern):
    auto = am.compile_regex(pattern, TOK, [EOS], V)
    assert auto.token_class.shape == (V,) and auto.final.shape == (auto.num_states,)
    _check(auto, pattern)


def test_a_prefix_that_already_matches_keeps_its_continuations():
    """outlines-core 0.2.14 drops a token that continues past a point where the pattern
    already matches (fixed after that release); `(?:R)$` avoids it: after "1", "." is
    still allowed by [0-9]+(\\.[0-9]+)?."""
    auto = am.compile_regex(r"[0-9]+(\.[0-9]+)?", TOK, [EOS], V)
    one, dot = TOKENS.index(b"1"), TOKENS.index(b".")
    s = auto.step(0, one)
    assert auto.final[s] and auto.allowed(s)[dot] and auto.allowed(s)[EOS]


def test_json_schema_outputs_validate():
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"], "additionalProperties": False}
    pattern = am.regex_from_json_schema(schema)
    auto = am.compile_regex(pattern, TOK, [EOS], V)
    rng = np.random.default_rng(1)
    for _ in range(20):  # random walks to acceptance: every output parses and validates
        state, out = 0, b""
        for _ in range(200):
            allowed = auto.allowed(state)
            if auto.final[state] and (rng.random() < 0.5 or allowed.sum() == 1):
                break
            choices = np.flatnonzero(allowed & (np.arange(V) != EOS))
            t = int(rng.choice(choices))
            state, out = auto.step(state, t), out + TOKENS[t]
        assert auto.final[state], out
        jsonschema.validate(json.loads(out), schema)


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(SpecjaxError, match="does not compile"):
        am.compile_regex("(unclosed", TOK, [EOS], V)
    with pytest.raises(SpecjaxError, match="over the limit"):
        am.compile_regex(r"[a-z]{1,40}", TOK, [EOS], V, max_table_bytes=10_000)
    with pytest.raises(SpecjaxError, match="JSON schema"):
        am.regex_from_json_schema({"type": "nonsense"})
    with pytest.raises(SpecjaxError, match="cannot read the tokenizer"):
        am.byte_vocabulary(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"vocab": {"a": 0}}, "decoder": {"type": "Metaspace"}}))
    with pytest.raises(SpecjaxError, match="byte-level"):
        am.byte_vocabulary(str(tmp_path))


def test_unenforced_schema_keywords_are_found_in_subschemas_only():
    from specjax.constraints.automaton import unenforced_keywords

    schema = {"type": "object", "properties": {
        "minimum": {"type": "string"},  # a property named like a keyword: fine
        "xs": {"type": "array", "items": {"type": "integer", "maximum": 3}},
        "u": {"anyOf": [{"type": "object", "properties": {"v": {"multipleOf": 2}}}]}},
        "$defs": {"d": {"oneOf": []}}}
    assert sorted(unenforced_keywords(schema)) == sorted([
        ("/properties/xs/items", "maximum"), ("/properties/u/anyOf/0/properties/v", "multipleOf"),
        ("/$defs/d", "oneOf")])
    assert unenforced_keywords({"type": "string", "maxLength": 3, "pattern": "a+"}) == []


def test_compiled_tables_are_cached_by_pattern_and_tokenizer(tmp_path, monkeypatch):
    """compile_cached writes CACHE/KEY.npz; a new process (an empty memory cache) reads it
    back without compiling; another pattern or eos id is another key."""
    from specjax.constraints import sets

    first = sets.compile_cached("[0-9]{2}", TOK, (0,), V, cache_dir=str(tmp_path))
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1
    monkeypatch.setattr(sets, "_MEMORY", {})

    def refuse(*a, **k):
        raise AssertionError("compiled again despite the cache")

    monkeypatch.setattr(sets, "compile_regex", refuse)
    again = sets.compile_cached("[0-9]{2}", TOK, (0,), V, cache_dir=str(tmp_path))
    for f in ("token_class", "next_state", "final"):
        np.testing.assert_array_equal(getattr(first, f), getattr(again, f))
    keys = {sets.cache_key(p, TOK, e, V) for p, e in
            [("[0-9]{2}", (0,)), ("[0-9]{3}", (0,)), ("[0-9]{2}", (0, 1))]}
    assert len(keys) == 3
