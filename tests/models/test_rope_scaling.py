"""RoPE scalings read from HF configs and train configs: llama3 and YaRN (issue 33).

The frequencies and the attention factor are checked against transformers in
tests/models/test_model_golden.py (config qwen3_yarn, every forward); here: the parsing, the
round trips and the errors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.models.config import ModelConfig, rope_scaling_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = dict(family="qwen3", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
            num_kv_heads=1, head_dim=16, intermediate_size=32)


def test_yarn_and_llama3_round_trip_through_transformers():
    transformers = pytest.importorskip("transformers")
    del transformers
    for rope in ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                  "beta_fast": 16.0, "attention_factor": 1.5, "truncate": False},
                 {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}):
        cfg = ModelConfig(**BASE, max_position_embeddings=2048,
                          rope_scaling=rope_scaling_pairs(rope, default="llama3"))
        back = ModelConfig.from_hf_config(cfg.to_hf_config())
        assert back == cfg
        assert back.rope_type == rope.get("rope_type", "llama3")
    assert cfg.attention_scaling == 1.0  # llama3 has no temperature


def test_yarn_attention_factor_rules():
    def cfg(**rope):
        return ModelConfig(**BASE, rope_scaling=rope_scaling_pairs(
            {"rope_type": "yarn", "original_max_position_embeddings": 64, **rope}))

    assert cfg(factor=16.0).attention_scaling == pytest.approx(0.1 * np.log(16) + 1)
    assert cfg(factor=16.0, attention_factor=1.1).attention_scaling == 1.1
    both = cfg(factor=16.0, mscale=1.0, mscale_all_dim=0.5).attention_scaling
    assert both == pytest.approx((0.1 * np.log(16) + 1) / (0.05 * np.log(16) + 1))
    assert cfg(factor=1.0).attention_scaling == 1.0


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_type 'dynamic'"),
    ({"rope_type": "yarn", "factor": 4.0}, "yarn RoPE scaling needs original_max"),
    ({"rope_type": "yarn", "factor": "big", "original_max_position_embeddings": 8},
     "factor='big' must be a number"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
      "truncate": 1}, "truncate=1 must be true or false"),
    ({"factor": 8.0}, "llama3 RoPE scaling needs low_freq_factor"),
])
def test_bad_rope_scaling_is_one_clear_error(rope, match):
    with pytest.raises(SpecjaxError, match=match):
        rope_scaling_pairs(rope, default="llama3")


def test_train_config_reads_a_yarn_model_section(tmp_path):
    """configs/long_target_yarn.yaml: rope_type yarn in the model section, and the
    config's YAML form (to_dict) reads back equal."""
    from specjax.train.config import TrainConfig, from_dict, load_config

    cfg = load_config(os.path.join(ROOT, "configs", "long_target_yarn.yaml"))
    assert cfg.model.rope_type == "yarn" and cfg.train.pose
    assert cfg.model.attention_scaling == pytest.approx(0.1 * np.log(16) + 1)
    assert from_dict(TrainConfig, cfg.to_dict()) == cfg
    old = load_config(os.path.join(ROOT, "configs", "long_target.yaml"))  # no rope_type
    assert old.model.rope_type == "llama3"


def test_drafter_export_refuses_a_yarn_target():
    from specjax.drafters.convert import _rope_json

    cfg = ModelConfig(**BASE, rope_scaling=rope_scaling_pairs(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    with pytest.raises(SpecjaxError, match="YaRN-scaled target"):
        _rope_json(cfg)
