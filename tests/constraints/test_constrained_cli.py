"""decode.py and the library under a constraint (issue 55): --regex, --json-schema and
per-prompt "regex" / "json_schema" fields; every complete output matches its pattern
(Python's `regex` module) or validates against its schema (`jsonschema`); greedy output
equals constrained autoregressive decoding; bad input is one line, exit 2, before any
weights load; lossy modes are refused. The tiny random demo (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil

import jax
import jsonschema
import pytest
import regex as re_lib

import specjax
from specjax.constraints import ConstrainedIds, ConstraintSet, compile_cached
from specjax.decoding.engine import Engine, prompt_width_for
from tests.cli.test_decode_cli import base_args, run

pytestmark = pytest.mark.timeout(600)

PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _outputs(tmp_path):
    return [json.loads(x) for x in open(tmp_path / "o.jsonl")]


def test_regex_outputs_match_and_equal_constrained_ar(tiny_demo, tmp_path, capsys):
    code, out, err = run(base_args(tiny_demo, tmp_path, "--regex", PHONE,
                                   "--max-new-tokens", 24, "--batch-size", 2), capsys)
    assert code == 0, err
    recs = _outputs(tmp_path)
    for r in recs:
        assert r["regex"] == PHONE
        assert r["matched"], r
        assert re_lib.fullmatch(PHONE, r["text"]), r["text"]
    s = json.load(open(tmp_path / "s.json"))
    assert s["ar_identical"] is True
    assert s["constraint"]["matched"] == len(recs) == s["constraint"]["prompts"]
    assert "constraint" in out


def test_json_schema_and_per_prompt_constraints(tiny_demo, tmp_path, capsys):
    """--json-schema for every prompt without its own; one prompt with its own regex and
    one with its own schema; sampling at T = 1 with block verification."""
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    lines = [json.loads(x) for x in open(tiny_demo / "prompts.jsonl")][:3]
    lines[0]["regex"] = "(yes|no)"
    lines[1]["json_schema"] = {"type": "array", "items": {"type": "boolean"},
                               "maxItems": 3}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, _, err = run(base_args(tiny_demo, tmp_path, "--prompts", prompts, "--json-schema",
                                 schema_file, "--max-new-tokens", 64, "--temperature", 1.0,
                                 "--seed", 3), capsys)
    assert code == 0, err
    recs = _outputs(tmp_path)
    assert re_lib.fullmatch("(yes|no)", recs[0]["text"]) and recs[0]["matched"]
    for rec, schema in ((recs[1], lines[1]["json_schema"]), (recs[2], SCHEMA)):
        if rec["matched"]:  # else cut at --max-new-tokens: a prefix
            jsonschema.validate(json.loads(rec["text"]), schema)
    assert json.load(open(tmp_path / "s.json"))["constraint"]["patterns"] == 3


@pytest.mark.parametrize("extra,needle", [
    (["--regex", "(unclosed"], "does not compile"),
    (["--regex", "a*"], "matches the empty output"),
    (["--regex", "x", "--json-schema", "s.json"], "one constraint"),
    (["--json-schema", "missing.json"], "unreadable"),
    (["--regex", "[0-9]+", "--verify", "fly"], "lossy"),
    (["--regex", "[0-9]+", "--ignore-eos"], "--ignore-eos"),
])
def test_bad_constraints_fail_in_one_line_before_loading(tiny_demo, tmp_path, capsys,
                                                         extra, needle):
    """The target directory has no weights: an error about them would mean the model
    started to load before the constraint was checked."""
    target = tmp_path / "target"
    shutil.copytree(tiny_demo / "target", target)
    (target / "model.safetensors").unlink()
    extra = [str(tmp_path / a) if a.endswith(".json") else a for a in extra]
    args = base_args(tiny_demo, tmp_path, "--target", target, *extra)
    code, _, err = run(args, capsys)
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("schema,needle", [
    (3, "JSON object"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}},
     "'minimum' at /properties/n is not enforced"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' at /"),
])
def test_bad_per_prompt_schema_is_one_line(tiny_demo, tmp_path, capsys, schema, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "json_schema": schema}) + "\n")
    code, _, err = run(base_args(tiny_demo, tmp_path, "--prompts", prompts), capsys)
    assert code == 2 and "line 1" in err and needle in err, err
    assert len(err.strip().splitlines()) == 1


def test_library_engine_with_a_constraint_set(tiny_demo):
    """The library path: compile_cached + ConstraintSet + Engine(constraints=); a
    constrained and an unconstrained prompt in one batch; greedy speculative output equals
    the autoregressive engine's."""
    target = specjax.load_target(str(tiny_demo / "target"))
    d = specjax.load_drafter(str(tiny_demo / "draft"), target)
    eos = target.cfg.eos_token_ids
    auto = compile_cached("[a-z]{2,5}!", str(tiny_demo / "target"), eos,
                          target.cfg.vocab_size)
    cset = ConstraintSet([auto], eos, target.cfg.vocab_size)
    ids = target.tokenizer.encode("def f():")
    prompts = [ConstrainedIds(ids, auto.pattern), list(ids)]
    width = prompt_width_for(len(ids), len(ids) + 16)
    outs = []
    for drafter in (d.drafter, None):
        eng = Engine(target.model, drafter=drafter, drafter_params=d.params,
                     max_length=len(ids) + 16, prompt_width=width, batch_size=2,
                     eos_token_ids=eos, constraints=cset)
        outs.append(eng.run(prompts, 16, jax.random.key(0)).outputs)
    assert outs[0] == outs[1]
    text = target.tokenizer.decode(outs[0][0], skip_special_tokens=True)
    assert re_lib.fullmatch("[a-z]{2,5}!", text), text
    assert cset.matched(auto.pattern, outs[0][0])
