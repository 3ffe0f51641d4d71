"""What `kernel_policy.describe` reports: the path each part of the loop takes, and one line
per fallback from what --kernels asked for (issue 53: fallbacks that speak). Checked against
what the loop itself calls (`LoopConfig.fused_verify`, `target_attention`), not restated."""

import dataclasses

import pytest

from specjax.core.sampling import SamplingParams
from specjax.decoding.fly import FlyVerify
from specjax.decoding.kernel_policy import describe
from specjax.decoding.loop import LoopConfig
from specjax.decoding.rules import Custom

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass(frozen=True)
class Learned:  # a drafter with an attention kernel of its own (as LearnedDrafter)
    gamma: int = 3
    attention: object = None


class TreeDrafter:  # a drafter that proposes its own tree
    gamma = 3
    tree_nodes = 7

    def propose_tree(self, *a):
        raise NotImplementedError


def cfg(**kw):
    return LoopConfig(max_length=16, prompt_width=4, **kw)


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_fused_when_nothing_stops_it(kernels):
    c = cfg(kernels=kernels, sampling=SamplingParams(1.0), verify="token")
    paths, notes = describe(c, Learned())
    assert c.fused_verify() is not None and paths["verify"] == f"fused-{kernels}"
    attn = "pallas" if kernels == "pallas" else "jnp"
    assert (c.target_attention() is not None) == (attn == "pallas")
    assert paths["target_attention"] == paths["drafter_attention"] == attn
    assert notes == []


@pytest.mark.parametrize("kw,needle", [
    ({"sampling": SamplingParams(1.0, top_k=5)}, "top-k/top-p"),
    ({"sampling": SamplingParams(1.0, top_p=0.9)}, "top-k/top-p"),
    ({"sampling": SamplingParams(1.0), "verify": Custom(lambda *a: None)}, "custom"),
    ({"verify": FlyVerify()}, "fly"),
    ({"sampling": SamplingParams(1.0), "num_drafts": 2}, "draft trees"),
])
def test_each_fallback_is_one_line(kw, needle):
    c = cfg(kernels="pallas", **kw)
    paths, notes = describe(c, Learned())
    assert paths["verify"] == "unfused"
    if c.num_drafts == 1:
        assert c.fused_verify() is None  # what the loop does agrees
    assert len(notes) == 1 and needle in notes[0] and "\n" not in notes[0]
    assert paths["target_attention"] == "pallas"


def test_tree_drafter_and_off_and_autoregressive():
    paths, notes = describe(cfg(kernels="reference"), TreeDrafter())
    assert paths["verify"] == "unfused" and "draft trees" in notes[0]
    assert paths["drafter_attention"] is None  # no attention of its own
    paths, notes = describe(cfg(kernels="off", sampling=SamplingParams(1.0, top_k=5)),
                            Learned())
    assert paths == {"verify": "unfused", "target_attention": "jnp",
                     "drafter_attention": "jnp"} and notes == []  # nothing asked for
    paths, notes = describe(cfg(kernels="pallas"), None)
    assert paths["verify"] == "none" and notes == []


def test_mesh_drops_the_attention_kernels():
    c = cfg(kernels="pallas", cache_sharding=object())
    paths, notes = describe(c, Learned())
    assert c.target_attention() is None and c.drafter_attention() is None
    assert paths["target_attention"] == paths["drafter_attention"] == "jnp"
    assert paths["verify"] == "fused-pallas"
    assert len(notes) == 1 and "mesh" in notes[0]


def test_attention_setting_fuses_attention_not_verification():
    """kernels="attention" (the GPU's auto): the attention kernels of "pallas", the
    verification of "off", and nothing to note (nothing asked for was skipped)."""
    c = cfg(kernels="attention", sampling=SamplingParams(1.0), verify="token")
    paths, notes = describe(c, Learned())
    assert c.fused_verify() is None and paths["verify"] == "unfused"
    assert c.target_attention() is not None and c.drafter_attention() is not None
    assert paths["target_attention"] == paths["drafter_attention"] == "pallas"
    assert notes == []


@pytest.mark.parametrize("backend,want", [("cpu", "reference"), ("gpu", "attention"),
                                          ("tpu", "pallas")])
def test_auto_picks_per_backend(backend, want):
    from specjax.decoding.kernel_policy import resolve_kernels

    assert resolve_kernels("auto", backend) == want
    assert resolve_kernels("off", backend) == "off"


def test_auto_table_matches_the_device_rounds(tmp_path):
    """specjax/backend_choices.py's measured entries are what benchmarks/kernel_choice.py
    derives from the committed device rounds; a round that says otherwise fails --check."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "benchmarks", "kernel_choice.py")
    p = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "gpu attention: pallas" in p.stdout and "gpu verify: unfused" in p.stdout
    # a GPU round in which the fused verification wins in the loop: the table is wrong
    shutil.copytree(os.path.join(root, "benchmarks", "results", "device"), tmp_path / "d")
    fake = {"steps": {"environment": {"backend": "gpu"}, "decode_demo": {"runs": {
        "pallas": {"summary": {"tokens_per_s": 200.0}},
        "attention": {"summary": {"tokens_per_s": 100.0}}}}}}
    (tmp_path / "d" / "h100-2026-11-26" / "round9.json").write_text(json.dumps(fake))
    p = subprocess.run([sys.executable, script, "--check", "--results", str(tmp_path / "d")],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "gpu verify: measured fused" in p.stderr, p.stderr


def test_layer_loop_auto_follows_the_table(monkeypatch):
    from specjax import backend_choices
    from specjax.models import model

    monkeypatch.setitem(backend_choices.CHOICES, "cpu",
                        {**backend_choices.CHOICES["cpu"], "layer_loop": "scan"})
    state = {"x": 1}
    assert model.decoding_params(state, "auto") is state  # scan: the stacked layout as is
