"""Tiny random transformers models for the golden tests (torch is a test-only dependency)."""

from __future__ import annotations

import math

import torch
import transformers


def random_hf_model(config_kw: dict, seed: int = 0):
    """A transformers causal LM from `config_kw` ({"cls": "Qwen3Config", **fields}), in f32
    eval mode with eager attention and O(1)-scale weights (norm weights in [0.5, 1.5], so
    that every weight matters)."""
    kw = dict(config_kw)
    cfg = getattr(transformers, kw.pop("cls"))(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:  # [out, in] projections and the untied LM head
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model.eval()
