"""The decoding session as a library call (issue 51): `DecodeConfig` validated once, and
`build(cfg).run(prompts)` giving what `decode.py` writes for the same options."""

from __future__ import annotations

import dataclasses
import json

import pytest

import decode
import specjax
from specjax.decoding.options import DecodeConfig, add_arguments, from_args
from specjax.errors import SpecjaxError


def test_every_option_is_a_decode_flag():
    ap = decode.build_parser()
    flags = {a.dest for a in ap._actions}
    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    assert fields <= flags
    # the parsed defaults are the config's defaults (after gamma is resolved)
    assert from_args(ap.parse_args([])) == DecodeConfig()
    assert from_args(ap.parse_args(["--gamma", "3", "--drafter", "ngram"])).gamma == 3


def test_gamma_resolves_once():
    assert DecodeConfig().gamma == "auto"
    assert DecodeConfig(num_drafts=2).gamma == "fixed"
    assert DecodeConfig(drafter="none").gamma == "fixed"
    assert DecodeConfig(verify="fly").gamma == "fixed"  # FLy's figures are at a fixed G
    cfg = DecodeConfig(gamma="fixed")
    assert dataclasses.replace(cfg, seed=1).gamma == "fixed"  # idempotent
    assert DecodeConfig(gamma=5).draft_length == 5 and cfg.draft_length is None


@pytest.mark.parametrize("kwargs,match", [
    ({"gamma": "auto", "drafter": "none"}, "--gamma auto needs a drafter"),
    ({"gamma": 0}, "--gamma=0"),
    ({"num_drafts": 2, "gamma": "auto"}, "--gamma auto adapts"),
    ({"verify": "fly", "temperature": 1.0}, "--verify fly"),
    ({"verify": "fly", "gamma": "auto"}, "--verify fly .lossy. drafts a fixed length"),
    ({"partial_budget": 100}, "--partial-budget goes with --partial-verify"),
    ({"top_p": 0.0}, "--top-p"),
    ({"draft_reuse": True, "num_drafts": 2}, "--draft-reuse"),
])
def test_bad_options_raise_one_line(kwargs, match):
    with pytest.raises(SpecjaxError, match=match) as e:
        DecodeConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_add_arguments_gives_one_flag_per_field():
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert len([a for a in ap._actions if a.dest != "help"]) == len(
        dataclasses.fields(DecodeConfig))


def test_session_run_is_what_decode_writes(tiny_demo, tmp_path, capsys):
    args = ["--target", tiny_demo / "target", "--drafter", tiny_demo / "draft", "--prompts",
            tiny_demo / "prompts.jsonl", "--max-new-tokens", 8, "--batch-size", 2,
            "--gamma", 3, "--compile-cache", "none", "--output", tmp_path / "o.jsonl"]
    assert decode.main([str(a) for a in args]) == 0
    capsys.readouterr()
    written = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    cfg = specjax.DecodeConfig(target=str(tiny_demo / "target"),
                               drafter=str(tiny_demo / "draft"), max_new_tokens=8,
                               batch_size=2, gamma=3, compile_cache="none")
    session = specjax.build(cfg)
    prompts, chat = session.read_prompts(path=str(tiny_demo / "prompts.jsonl"))
    report = session.run(prompts, chat=chat)
    assert report.records == written
    assert report.summary["ar_identical"] is True and report.summary["gamma"] == 3
    assert report.summary["ar_identity_guaranteed"] is True  # f32 on CPU, lossless
    assert report.summary["kernel_paths"] == {  # auto on CPU: the fused jnp verifier
        "verify": "fused-reference", "target_attention": "jnp", "drafter_attention": None}
    again = session.run(prompts[:1], chat=chat)  # a second run reuses the loaded weights
    assert again.records == written[:1]


def test_fallbacks_and_bf16_speak_on_stderr(tiny_demo, tmp_path, capsys):
    """A fallback from the kernels asked for, and a bf16 target's lost guarantee, are one
    line each on stderr, and the summary records the path taken (issue 53)."""
    summary = tmp_path / "s.json"
    args = ["--target", tiny_demo / "target", "--drafter", tiny_demo / "draft", "--prompts",
            tiny_demo / "prompts.jsonl", "--max-new-tokens", 4, "--gamma", 2,
            "--compile-cache", "none", "--kernels", "reference", "--temperature", 1,
            "--top-k", 5, "--dtype", "bfloat16", "--show", 0, "--summary", summary]
    assert decode.main([str(a) for a in args]) == 0
    err = capsys.readouterr().err.splitlines()
    assert sum("top-k/top-p" in line for line in err) == 1
    assert sum("bfloat16" in line and "not guaranteed" in line for line in err) == 1
    s = json.loads(summary.read_text())
    assert s["kernels"] == "reference" and s["kernel_paths"]["verify"] == "unfused"
    assert s["ar_identity_guaranteed"] is False
