"""The drafter registry (docs/design.md section 11, issue 28): every built-in kind's
declared facts agree with the behaviour before the registry, and a kind defined in ONE
file (specjax/testing/drafter_kind_example.py, "toy") trains through train.py and decodes
losslessly with no edit anywhere else."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import specjax.testing.drafter_kind_example  # noqa: F401  (registers the "toy" kind)
import train as train_cli
from specjax.drafters import DrafterConfig, registry
from specjax.errors import SpecjaxError
from specjax.testing.tiny import tiny_config
from tests.train.test_train_drafters import TINY, setup  # noqa: F401  (the tiny target and data)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(ROOT, "checkpoints", "demo", "drafters")

# DrafterConfig.for_target(tiny target of L layers, kind, context=, num_layers=,
# num_kv_layers=3) before the registry, recorded from the code at 84d1949:
# (L, kind, context, num_layers) -> (num_layers, capture, kv_layers, context,
# mask_token_id, uses_hidden, uses_kv, num_memories)
FOR_TARGET = {
    (2, "block", None, 1): (1, (2,), (), 'hidden', 1, True, False, 0),
    (2, "block", None, 3): (3, (2, 2, 2), (), 'hidden', 1, True, False, 0),
    (2, "block", None, None): (2, (2, 2), (), 'hidden', 1, True, False, 0),
    (2, "block", 'both', 1): (1, (2,), (1,), 'both', 1, True, True, 1),
    (2, "block", 'both', 3): (3, (2, 2, 2), (1,), 'both', 1, True, True, 3),
    (2, "block", 'both', None): (2, (2, 2), (1,), 'both', 1, True, True, 2),
    (2, "block", 'hidden', 1): (1, (2,), (), 'hidden', 1, True, False, 0),
    (2, "block", 'hidden', 3): (3, (2, 2, 2), (), 'hidden', 1, True, False, 0),
    (2, "block", 'hidden', None): (2, (2, 2), (), 'hidden', 1, True, False, 0),
    (2, "block", 'kv', 1): (1, (), (1,), 'kv', 1, False, True, 1),
    (2, "block", 'kv', 3): (3, (), (1,), 'kv', 1, False, True, 3),
    (2, "block", 'kv', None): (2, (), (1,), 'kv', 1, False, True, 2),
    (2, "eagle3", None, 1): (1, (0, 1, 2), (), None, None, True, False, 0),
    (2, "eagle3", None, None): (1, (0, 1, 2), (), None, None, True, False, 0),
    (2, "hybrid", None, 1): (1, (0, 1, 2), (1,), None, None, True, True, 1),
    (2, "hybrid", None, None): (1, (0, 1, 2), (1,), None, None, True, True, 1),
    (2, "kv", None, 1): (1, (), (1,), None, None, False, True, 1),
    (2, "kv", None, 3): (3, (), (1,), None, None, False, True, 3),
    (2, "kv", None, None): (2, (), (1,), None, None, False, True, 2),
    (28, "block", None, 1): (1, (14,), (), 'hidden', 1, True, False, 0),
    (28, "block", None, 3): (3, (2, 14, 26), (), 'hidden', 1, True, False, 0),
    (28, "block", None, None): (2, (2, 26), (), 'hidden', 1, True, False, 0),
    (28, "block", 'both', 1): (1, (14,), (1, 13, 25), 'both', 1, True, True, 1),
    (28, "block", 'both', 3): (3, (2, 14, 26), (1, 13, 25), 'both', 1, True, True, 3),
    (28, "block", 'both', None): (2, (2, 26), (1, 13, 25), 'both', 1, True, True, 2),
    (28, "block", 'hidden', 1): (1, (14,), (), 'hidden', 1, True, False, 0),
    (28, "block", 'hidden', 3): (3, (2, 14, 26), (), 'hidden', 1, True, False, 0),
    (28, "block", 'hidden', None): (2, (2, 26), (), 'hidden', 1, True, False, 0),
    (28, "block", 'kv', 1): (1, (), (1, 13, 25), 'kv', 1, False, True, 1),
    (28, "block", 'kv', 3): (3, (), (1, 13, 25), 'kv', 1, False, True, 3),
    (28, "block", 'kv', None): (2, (), (1, 13, 25), 'kv', 1, False, True, 2),
    (28, "eagle3", None, 1): (1, (2, 14, 25), (), None, None, True, False, 0),
    (28, "eagle3", None, None): (1, (2, 14, 25), (), None, None, True, False, 0),
    (28, "hybrid", None, 1): (1, (2, 14, 25), (1, 13, 25), None, None, True, True, 1),
    (28, "hybrid", None, None): (1, (2, 14, 25), (1, 13, 25), None, None, True, True, 1),
    (28, "kv", None, 1): (1, (), (1, 13, 25), None, None, False, True, 1),
    (28, "kv", None, 3): (3, (), (1, 13, 25), None, None, False, True, 3),
    (28, "kv", None, None): (2, (), (1, 13, 25), None, None, False, True, 2),
}
# decode_plan's "drafter state" ([layers,B,K,S,H] caches) per kind before the registry:
# L 8 target, batch 2, max length 64, G 7 -> layers x 18432 bytes.
STATE_LAYERS = {("eagle3", None, None): 1, ("kv", None, None): 2, ("kv", None, 3): 3,
                ("hybrid", None, None): 2, ("block", "hidden", None): 2,
                ("block", "hidden", 3): 3, ("block", "kv", None): 2, ("block", "kv", 3): 3,
                ("block", "both", None): 4, ("block", "both", 3): 6}
# The shipped demo drafters: (kind, uses_hidden, uses_kv, num_memories).
SHIPPED_FACTS = {"block": ("block", True, False, 0), "eagle3": ("eagle3", True, False, 0),
                 "hybrid": ("hybrid", True, True, 1), "kv1": ("kv", False, True, 1)}


def target_cfg(L):
    return tiny_config(320, hidden_size=32, num_layers=L, num_heads=4, num_kv_heads=2,
                       head_dim=8, intermediate_size=64)


def test_builtin_kinds_and_their_declared_facts():
    assert registry.kinds()[:5] == ("eagle3", "kv", "hybrid", "block", "medc")
    assert "toy" in registry.kinds()
    assert registry.objective_kinds("block") == ("block",)
    assert registry.objective_kinds("ttt")[:3] == ("eagle3", "kv", "hybrid")
    assert registry.early_stop_kinds() == ("eagle3", "hybrid", "medc")
    assert registry.setting_kinds("context") == ("block",)
    names = {k: (registry.get(k).network.__name__, registry.get(k).adapter.__name__)
             for k in ("eagle3", "kv", "hybrid", "block", "medc")}
    assert names == {"eagle3": ("Eagle3", "Eagle3Drafter"), "kv": ("KVOnly", "KVDrafter"),
                     "hybrid": ("Hybrid", "Eagle3Drafter"),
                     "block": ("BlockNet", "BlockDrafter"), "medc": ("Medc", "Eagle3Drafter")}
    with pytest.raises(SpecjaxError, match="drafter kind 'nope'"):
        registry.get("nope")


@pytest.mark.parametrize("key", sorted(FOR_TARGET, key=str))
def test_for_target_matches_the_old_code(key):
    L, kind, context, num_layers = key
    c = DrafterConfig.for_target(target_cfg(L), kind, context=context, num_layers=num_layers,
                                 num_kv_layers=3)
    got = (c.num_layers, c.capture, c.kv_layers, c.context, c.mask_token_id, c.uses_hidden,
           c.uses_kv, c.num_memories)
    assert got == FOR_TARGET[key]


@pytest.mark.parametrize("key", sorted(STATE_LAYERS, key=str))
def test_plan_state_matches_the_old_code(key):
    from specjax import plan

    kind, context, num_layers = key
    t = target_cfg(8)
    c = DrafterConfig.for_target(t, kind, context=context, num_layers=num_layers)
    out = plan.decode_plan(t, plan.parse_mesh("data=1,model=1"), 2, 64, np.float32, dcfg=c)
    assert out["drafter state"] == STATE_LAYERS[key] * 18432


@pytest.mark.parametrize("name", sorted(SHIPPED_FACTS))
def test_shipped_drafter_configs_load_unchanged(name):
    path = os.path.join(SHIPPED, name, "config.json")
    raw = json.load(open(path))
    c = DrafterConfig.from_json_dict(raw)
    assert (c.kind, c.uses_hidden, c.uses_kv, c.num_memories) == SHIPPED_FACTS[name]
    back = c.to_json_dict()
    assert back == {k: v for k, v in raw.items() if k not in ("target", "train")}


def test_validation_messages_are_unchanged():
    t = target_cfg(4)
    c = DrafterConfig.for_target(t, "eagle3")
    import dataclasses

    with pytest.raises(SpecjaxError, match="eagle3 drafters have one layer"):
        dataclasses.replace(c, num_layers=2)
    with pytest.raises(SpecjaxError, match="context='kv' is a block drafter setting"):
        dataclasses.replace(c, context="kv")
    with pytest.raises(SpecjaxError, match="block drafter context 'x'"):
        DrafterConfig.for_target(t, "block", context="x")
    from specjax.train.config import DrafterTrainConfig

    with pytest.raises(SpecjaxError, match="drafter.mask_token_id is a block drafter setting"):
        DrafterTrainConfig(kind="kv", mask_token_id=3)
    with pytest.raises(SpecjaxError, match="drafter.context='x' is unknown"):
        DrafterTrainConfig(kind="block", context="x")


def test_draft_stop_only_for_kinds_that_stop(setup):  # noqa: F811
    from flax import nnx

    from specjax.decoding.loading import load_target
    from specjax.drafters import build_network, make_drafter

    target = load_target(setup["target"], dtype="float32").model
    for kind, ok in (("toy", False), ("eagle3", True)):
        dcfg = DrafterConfig.for_target(target.cfg, kind, gamma=3)
        net = build_network(dcfg, rngs=nnx.Rngs(0))
        if ok:
            make_drafter(dcfg, net, target, stop_below=0.5)
        else:
            with pytest.raises(SpecjaxError, match="only eagle3, hybrid and medc drafters stop"):
                make_drafter(dcfg, net, target, stop_below=0.5)


# ----------------------------------------------------------------------------- the toy kind

def test_toy_kind_trains_and_decodes_losslessly(setup, tmp_path, capsys):  # noqa: F811
    """train.py's entry point trains the toy drafter two steps and exports it; loaded like
    any drafter directory, it decodes greedily to the autoregressive tokens (Engine)."""
    from specjax.decoding.engine import Engine
    from specjax.decoding.loading import load_drafter, load_target

    run = tmp_path / "run"
    code = train_cli.main(["--config", TINY, "--no-progress", "--run-dir", str(run),
                           "--set", "drafter.kind=toy", "--set", "train.steps=2",
                           "--set", f"target={setup['target']}",
                           "--set", f"data.tokens_npy={setup['tokens']}",
                           "--set", f"data.val_tokens_npy={setup['val']}",
                           "--set", "mesh.data=1"])
    assert code == 0, capsys.readouterr().err
    out = run / "drafter"
    raw = json.load(open(out / "config.json"))
    assert raw["kind"] == "toy" and raw["capture"] == [2]
    losses = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2]

    target = load_target(setup["target"], dtype="float32")
    d = load_drafter(str(out), target, matmul_dtype="float32")
    assert type(d.drafter).__name__ == "ToyDrafter" and d.gamma == 3
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    kw = dict(max_length=24, prompt_width=8, batch_size=3)
    spec = Engine(target.model, drafter=d.drafter, drafter_params=d.params, **kw)
    ar = Engine(target.model, **kw)
    key = jax.random.key(0)
    got, want = spec.run(prompts, 12, key), ar.run(prompts, 12, key)
    assert got.outputs == want.outputs
    assert all(len(o) == 12 for o in want.outputs)


def test_capture_and_kv_layers_override_the_kind_defaults():
    from specjax.train.config import DrafterTrainConfig

    target = tiny_config(num_layers=6)
    got = DrafterTrainConfig(kind="hybrid", capture=(4, 2), kv_layers=(1, 3)).for_target(target)
    assert got.capture == (2, 4) and got.kv_layers == (1, 3)
    default = DrafterTrainConfig(kind="kv").for_target(target)
    assert DrafterTrainConfig(kind="kv").for_target(target) == default
    for kw, match in [(dict(kind="kv", capture=(2,)), "reads no hidden states"),
                      (dict(kind="eagle3", kv_layers=(2,)), "reads no KV cache"),
                      (dict(kind="eagle3", capture=(2, 2)), "distinct"),
                      (dict(kind="kv", kv_layers=(9,)), "outside")]:
        with pytest.raises(SpecjaxError, match=match):
            DrafterTrainConfig(**kw).for_target(target)
