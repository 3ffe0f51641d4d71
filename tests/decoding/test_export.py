"""python -m specjax.export: the decoding loops lower for TPU and GPU from config.json alone
(abstract shapes, no weights), with the Pallas kernels inside: the target's attention
into its KV cache (one call per target forward after the prefill under the scan over
layers, one per layer unrolled) in both loops, and verification and the learned
drafter's attention (`packed_attention`) in the speculative one."""

from __future__ import annotations

import json

import pytest

from specjax.drafters.config import DrafterConfig
from specjax.models.config import ModelConfig
from specjax.testing import hf_configs
from specjax.tools import export


def _run(capsys, *args):
    code = export.main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _drafter_dir(tmp_path, target_dir, kind, **kw):
    """A drafter directory holding only config.json (export reads nothing else)."""
    d = tmp_path / f"drafter-{kind}"
    d.mkdir()
    dcfg = DrafterConfig.for_target(ModelConfig.from_dir(str(target_dir)), kind, **kw)
    (d / "config.json").write_text(json.dumps(dcfg.to_json_dict()))
    return d


def test_qwen3_8b_ngram_sampled_lowers_for_tpu_and_gpu(tmp_path, capsys):
    cfg = hf_configs.write("Qwen3-8B", str(tmp_path / "qwen3-8b"))
    code, out, err = _run(capsys, "--config", f"{cfg}/config.json", "--drafter", "ngram",
                          "--gamma", 7, "--temperature", 1.0, "--verify", "block",
                          "--batch", 8, "--max-length", 4096)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 4, out
    # Autoregressive: the attention kernel in the decode forward. Speculative: attention in
    # the verify forward, plus block verification with sampling (stats and residual).
    for platform, kind in (("tpu", "Mosaic"), ("cuda", "Triton")):
        assert f"{platform:5s} autoregressive  lowered" in out
        assert f"{platform:5s} speculative     lowered" in out
        ar, sp = (ln for ln in lines if ln.startswith(platform))
        assert ar.endswith(f"1 {kind} custom calls") and sp.endswith(f"3 {kind} custom calls")


def test_exact_mode_lowers_at_8b_for_tpu_and_gpu(tmp_path, capsys):
    """The exact mode (batch-invariant forwards, jnp attention) at Qwen3-8B shapes."""
    cfg = hf_configs.write("Qwen3-8B", str(tmp_path / "qwen3-8b"))
    code, out, err = _run(capsys, "--config", f"{cfg}/config.json", "--drafter", "ngram",
                          "--gamma", 7, "--kernels", "reference", "--exact",
                          "--max-length", 4096)
    assert code == 0, err
    for platform in ("tpu", "cuda"):
        assert f"{platform:5s} autoregressive  lowered" in out
        assert f"{platform:5s} speculative     lowered" in out
    code, out, err = _run(capsys, "--config", f"{cfg}/config.json", "--exact")
    assert code == 2 and "--exact takes the jnp attention" in err


@pytest.mark.parametrize("name,kind,platform", [("Llama-3.1-8B", "eagle3", "tpu"),
                                                ("Qwen3-8B", "kv", "cuda")])
def test_learned_drafters_lower_at_8b(tmp_path, capsys, name, kind, platform):
    cfg = hf_configs.write(name, str(tmp_path / name))
    d = _drafter_dir(tmp_path, cfg, kind)
    code, out, err = _run(capsys, "--config", cfg, "--drafter", d, "--platforms", platform,
                          "--max-length", 2048)
    assert code == 0, err
    assert f"{platform:5s} speculative" in out
    assert ("Mosaic" if platform == "tpu" else "Triton") in out


def test_demo_target_block_drafter_greedy(tmp_path, capsys, tiny_demo):
    d = _drafter_dir(tmp_path, tiny_demo / "target", "block", gamma=4)
    code, out, err = _run(capsys, "--config", tiny_demo / "target", "--drafter", d,
                          "--platforms", "tpu,cuda", "--max-length", 256, "--dtype", "float32")
    assert code == 0, err
    # Greedy autoregressive: the target's attention (scan over layers) once. Speculative:
    # that, the verification kernel, and the block drafter's context attention
    # (packed_attention) once per drafter layer (a Python loop).
    n_spec = 2 + DrafterConfig.for_target(ModelConfig.from_dir(str(tiny_demo / "target")),
                                          "block", gamma=4).num_layers
    assert out.count("1 Mosaic custom calls") == 1 and out.count("1 Triton custom calls") == 1
    assert out.count(f"{n_spec} Mosaic custom calls") == 1, out
    assert out.count(f"{n_spec} Triton custom calls") == 1, out


def test_unrolled_layers_and_reference_kernels(tmp_path, capsys, tiny_demo):
    """--layer-loop unroll: one attention kernel per layer (the demo target has 4);
    --kernels reference: no Pallas kernel at all (the chunked jnp attention)."""
    L = ModelConfig.from_dir(str(tiny_demo / "target")).num_layers
    common = ["--config", tiny_demo / "target", "--drafter", "ngram", "--platforms", "tpu",
              "--max-length", 128, "--dtype", "float32"]
    code, out, err = _run(capsys, *common, "--layer-loop", "unroll")
    assert code == 0, err
    ar, sp = out.strip().splitlines()
    assert ar.endswith(f"{L} Mosaic custom calls") and sp.endswith(f"{L + 1} Mosaic custom calls")
    code, out, err = _run(capsys, *common, "--kernels", "reference")
    assert code == 0, err
    assert out.count("no Pallas kernels") == 2


@pytest.mark.parametrize("case", ["missing", "not_drafter", "platform", "batch"])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, tiny_demo, case):
    args = {"missing": ["--config", tmp_path / "nope" / "config.json"],
            "not_drafter": ["--config", tiny_demo / "target", "--drafter", tiny_demo / "draft"],
            "platform": ["--config", tiny_demo / "target", "--platforms", "tpu,metal"],
            "batch": ["--config", tiny_demo / "target", "--batch", 0]}[case]
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
