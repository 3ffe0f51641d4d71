"""The chat recipe end to end, as docs/chat.md gives it: a small chat target built here,
conversations in both formats -> `python -m specjax.prepare` -> `python -m
specjax.regenerate --data` -> train.py (eagle3 and block, a few steps, on both data sets
with their loss masks) -> `decode.py --chat` with each exported drafter: greedy output
identical to autoregressive decoding."""

from __future__ import annotations

import json
import os

import pytest

import decode
import train as train_cli
from specjax.testing.chat import make_chat_target, write_conversations
from specjax.tools import prepare
from specjax.tools import regenerate as rg

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "test_tiny_drafter.yaml")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipe")
    target = make_chat_target(str(d / "target"), "qwen3")
    openai = write_conversations(str(d / "openai.jsonl"), "openai", 16, seed=0)
    sharegpt = write_conversations(str(d / "sharegpt.jsonl"), "sharegpt", 12, seed=1)
    assert prepare.main(["--target", target, "--data", openai, "--out", str(d / "prep"),
                         "--val-fraction", "0.25"]) == 0
    assert rg.main(["--target", target, "--data", sharegpt, "--out", str(d / "regen"),
                    "--max-new-tokens", "12", "--batch-size", "8"]) == 0
    return {"dir": d, "target": target, "openai": openai}


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("block", marks=pytest.mark.slow)])
def test_prepare_regenerate_train_decode(recipe, kind, capsys):
    d, target = recipe["dir"], recipe["target"]
    prep, regen = d / "prep", d / "regen"
    sets = (["objective=ttt", "drafter.kind=eagle3"] if kind == "eagle3" else
            ["objective=block", "drafter.kind=block", "drafter.num_anchors=4"])
    sets += [f"data.tokens_npy=[{prep}/tokens.npy,{regen}/train.npy]",
             f"data.loss_mask_npy=[{prep}/loss_mask.npy,{regen}/train_loss_mask.npy]",
             f"data.val_tokens_npy={prep}/val_tokens.npy",
             f"data.val_loss_mask_npy={prep}/val_loss_mask.npy",
             "train.steps=3", "train.eval_every=3", "mesh.data=1"]
    run_dir = d / f"run-{kind}"
    argv = ["--config", TINY, "--target", target, "--run-dir", str(run_dir),
            "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    assert train_cli.main(argv) == 0
    drafter = run_dir / "drafter"
    assert (drafter / "config.json").is_file()
    summary = d / f"summary-{kind}.json"
    rc = decode.main(["--target", target, "--drafter", str(drafter), "--prompts",
                      recipe["openai"], "--max-new-tokens", "10", "--batch-size", "4",
                      "--summary", str(summary), "--show", "0", "--compile-cache", "none",
                      "--gamma", "fixed"])  # auto would send a 3-step drafter's batches to AR
    assert rc == 0, capsys.readouterr().err
    s = json.loads(summary.read_text())
    assert s["chat"] is True and s["prompts"] == 16
    assert s["ar_identical"] is True and s["new_tokens"] > 0
