"""HF checkpoint I/O: loading variants, export round trips through transformers, errors.

Tiny random Qwen3 (tied, H != D/N) and Llama-3 (untied, llama3 RoPE) models are written
with transformers' `save_pretrained`; specjax must load them (single file, sharded,
old-style config.json), write them back so that transformers reads the same model, and
refuse broken directories with a one-line SpecjaxError naming the file / tensor / shape.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from specjax.errors import SpecjaxError  # noqa: E402
from specjax.models.checkpoint import load_model, save_model  # noqa: E402
from specjax.testing.hf_models import random_hf_model  # noqa: E402

VOCAB = 128
SEQ = 40

CONFIGS = {
    "qwen3": dict(
        cls="Qwen3Config",
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ),
    "llama": dict(
        cls="LlamaConfig",
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=96, rms_norm_eps=1e-5,  # H = D/N = 16
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        tie_word_embeddings=False, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    ),
}
# EOS ids written into generation_config.json (a list and a single id).
EOS = {"qwen3": [5, 7], "llama": 2}


def make_hf_model(family: str, seed: int = 0):
    """A tiny random transformers model in f32 eval mode with O(1)-scale weights."""
    model = random_hf_model(CONFIGS[family], seed)
    model.generation_config.eos_token_id = EOS[family]
    return model



def hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def load_hf(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", local_files_only=True, **kw).eval()


def specjax_logits(model, tokens) -> np.ndarray:
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache).logits

    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = fwd(state, jnp.asarray(tokens, jnp.int32), positions, model.init_cache(B, T))
    return np.asarray(out.astype(jnp.float32))


def max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def safetensors_dtypes(file) -> dict[str, str]:
    """Tensor name -> dtype string, read from the safetensors header."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    """(family, HF model, directory written by save_pretrained, HF reference logits)."""
    family = request.param
    hf = make_hf_model(family)
    path = tmp_path_factory.mktemp(f"hf-{family}")
    hf.save_pretrained(path)
    return family, hf, path, hf_logits(hf, TOKENS)


@pytest.fixture
def qwen3_dir(tmp_path_factory, tmp_path):
    """A writable copy of a saved tiny Qwen3 directory, for the error tests."""
    src = tmp_path_factory.getbasetemp() / "qwen3-src"
    if not src.exists():
        make_hf_model("qwen3").save_pretrained(src)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ loading + export


def test_load_matches_hf(saved):
    family, hf, path, ref = saved
    model = load_model(str(path))
    assert model.cfg.family == family
    assert model.cfg.eos_token_ids == tuple(np.atleast_1d(EOS[family]).tolist())
    assert max_err(specjax_logits(model, TOKENS), ref) <= 1e-4


def test_export_roundtrip_f32(saved, tmp_path):
    family, hf, path, ref = saved
    model = load_model(str(path))
    out = tmp_path / "export"
    save_model(model, str(out))
    names = sorted(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(names)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]  # temp dir renamed
    with open(out / "config.json") as f:
        raw = json.load(f)
    assert raw["model_type"] == family
    assert raw.get("dtype", raw.get("torch_dtype")) == "float32"
    # Same tensor names and bit-identical values as transformers wrote.
    orig, new = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(orig) == sorted(new)
    assert ("lm_head.weight" in new) == (family == "llama")
    for k in orig:
        np.testing.assert_array_equal(new[k], orig[k], err_msg=k)
    # transformers reads the export as the same model.
    hf2 = load_hf(out)
    assert next(hf2.parameters()).dtype == torch.float32
    assert max_err(hf_logits(hf2, TOKENS), ref) <= 1e-5
    # EOS ids survive the round trip, in transformers and in specjax.
    gen = transformers.GenerationConfig.from_pretrained(str(out), local_files_only=True)
    assert gen.eos_token_id == EOS[family]
    assert load_model(str(out)).cfg == model.cfg


def test_export_bf16(saved, tmp_path):
    family, hf, path, ref = saved
    model = load_model(str(path))
    out = tmp_path / "export-bf16"
    save_model(model, str(out), dtype=jnp.bfloat16)
    with open(out / "config.json") as f:
        raw = json.load(f)
    assert raw["dtype"] == "bfloat16"
    assert set(safetensors_dtypes(out / "model.safetensors").values()) == {"BF16"}
    # transformers loads it in bf16 by default; loosely the same model.
    hf_bf16 = load_hf(out)
    assert next(hf_bf16.parameters()).dtype == torch.bfloat16
    got = hf_logits(hf_bf16, TOKENS)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-2
    # The stored weights are exactly the f32 weights rounded to bf16 ...
    orig = load_file(path / "model.safetensors")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for k in orig:
            stored = f.get_tensor(k).float().numpy()
            rounded = orig[k].astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(stored, rounded, err_msg=k)
    # ... so specjax and transformers agree tightly on them in f32 compute,
    hf_f32 = load_hf(out, dtype=torch.float32)
    reloaded = load_model(str(out), dtype=jnp.float32)
    assert max_err(specjax_logits(reloaded, TOKENS), hf_logits(hf_f32, TOKENS)) <= 1e-4
    # and a bf16 specjax model stays near the bf16 transformers one.
    bf16 = load_model(str(out), dtype=jnp.bfloat16)
    assert bf16.embed[...].dtype == jnp.bfloat16
    got = specjax_logits(bf16, TOKENS)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-2


def test_sharded_checkpoint(saved, tmp_path):
    family, hf, _, ref = saved
    path = tmp_path / "sharded"
    hf.save_pretrained(path, max_shard_size="20KB")
    shards = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert (path / "model.safetensors.index.json").exists() and len(shards) > 2
    assert not (path / "model.safetensors").exists()
    model = load_model(str(path))
    assert max_err(specjax_logits(model, TOKENS), ref) <= 1e-4


def test_sharded_export(saved, tmp_path):
    """save_model(max_shard_bytes=) writes HF shards + index; transformers and specjax load
    them as the same model, bit for bit the unsharded tensors."""
    family, hf, path, ref = saved
    out = tmp_path / "export-sharded"
    save_model(load_model(str(path)), str(out), max_shard_bytes=20_000)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == shards
    orig = load_file(path / "model.safetensors")
    new = {}
    for n in shards:
        new.update(load_file(out / n))
    assert sorted(orig) == sorted(new)
    for k in orig:
        np.testing.assert_array_equal(new[k], orig[k], err_msg=k)
    assert max_err(hf_logits(load_hf(out), TOKENS), ref) <= 1e-5
    assert max_err(specjax_logits(load_model(str(out)), TOKENS), ref) <= 1e-4


def test_old_style_config(saved, tmp_path):
    """Top-level rope_theta / rope_scaling, torch_dtype, no head_dim (where H = D/N)."""
    family, hf, src, ref = saved
    path = tmp_path / "old"
    shutil.copytree(src, path)
    with open(path / "config.json") as f:
        raw = json.load(f)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] == "llama3":
        raw["rope_scaling"] = rope
    else:
        raw["rope_scaling"] = None
    raw["torch_dtype"] = raw.pop("dtype")
    D, N = raw["hidden_size"], raw["num_attention_heads"]
    if raw["head_dim"] == D // N:
        del raw["head_dim"]
    assert ("head_dim" in raw) == (family == "qwen3")
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)
    os.remove(path / "generation_config.json")
    model = load_model(str(path))
    c = model.cfg
    assert c.head_dim == CONFIGS[family].get("head_dim", D // N)
    assert c.rope_theta == CONFIGS[family]["rope_parameters"]["rope_theta"]
    assert (c.rope_scaling is not None) == (family == "llama")
    assert max_err(specjax_logits(model, TOKENS), ref) <= 1e-4


def test_tied_checkpoint_with_stored_lm_head(qwen3_dir):
    """Some tied checkpoints still store lm_head.weight (a copy of the embedding)."""
    file = qwen3_dir / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_model(str(qwen3_dir))
    assert model.lm_head is None


# ------------------------------------------------------------------ errors


def load_error(path) -> str:
    with pytest.raises(SpecjaxError) as info:
        load_model(str(path))
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


def edit_tensors(path, fn):
    file = path / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_error_unknown_architecture(qwen3_dir):
    with open(qwen3_dir / "config.json") as f:
        raw = json.load(f)
    raw["model_type"], raw["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    with open(qwen3_dir / "config.json", "w") as f:
        json.dump(raw, f)
    msg = load_error(qwen3_dir)
    assert "gpt2" in msg and "config.json" in msg


def test_error_unsupported_rope_type(qwen3_dir):
    with open(qwen3_dir / "config.json") as f:
        raw = json.load(f)
    raw["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    with open(qwen3_dir / "config.json", "w") as f:
        json.dump(raw, f)
    assert "linear" in load_error(qwen3_dir)


def edit_config(path, fn):
    with open(path / "config.json") as f:
        raw = json.load(f)
    fn(raw)
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)


def test_error_sliding_window(qwen3_dir):
    edit_config(qwen3_dir, lambda raw: raw.update(use_sliding_window=True, sliding_window=4,
                                                  max_window_layers=0))
    assert "sliding-window" in load_error(qwen3_dir)


def test_error_incomplete_rope_parameters(qwen3_dir):
    def drop_llama3_fields(raw):
        raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0}

    edit_config(qwen3_dir, drop_llama3_fields)
    msg = load_error(qwen3_dir)
    assert "config.json" in msg and "invalid config" in msg


def test_error_missing_directory(tmp_path):
    path = tmp_path / "does-not-exist"
    assert str(path) in load_error(path)


def test_error_missing_config(qwen3_dir):
    os.remove(qwen3_dir / "config.json")
    msg = load_error(qwen3_dir)
    assert "config.json" in msg and str(qwen3_dir) in msg


def test_error_unreadable_config(qwen3_dir):
    (qwen3_dir / "config.json").write_text("{not json")
    assert "config.json" in load_error(qwen3_dir)


def test_error_missing_tensor(qwen3_dir):
    edit_tensors(qwen3_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    msg = load_error(qwen3_dir)
    assert "model.layers.1.mlp.up_proj.weight" in msg
    assert "(96, 48)" in msg  # expected shape [F, D]


def test_error_missing_tensors_counted(qwen3_dir):
    def drop(t):
        for i in range(2):
            t.pop(f"model.layers.{i}.self_attn.q_norm.weight")
    edit_tensors(qwen3_dir, drop)
    msg = load_error(qwen3_dir)
    assert "model.layers.0.self_attn.q_norm.weight" in msg and "1 more" in msg
    assert "(16,)" in msg


def test_error_extra_tensor(qwen3_dir):
    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    edit_tensors(qwen3_dir, add)
    msg = load_error(qwen3_dir)
    assert "model.layers.0.self_attn.q_proj.bias" in msg and "model.safetensors" in msg


def test_error_extra_layer(qwen3_dir):
    def add(t):
        t["model.layers.2.input_layernorm.weight"] = np.ones(48, np.float32)
    edit_tensors(qwen3_dir, add)
    assert "model.layers.2.input_layernorm.weight" in load_error(qwen3_dir)


def test_error_shape_mismatch(qwen3_dir):
    def bad(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 48), np.float32)
    edit_tensors(qwen3_dir, bad)
    msg = load_error(qwen3_dir)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "(48, 48)" in msg and "(32, 48)" in msg  # found, expected [K*H, D]


def test_error_no_safetensors(qwen3_dir):
    os.remove(qwen3_dir / "model.safetensors")
    (qwen3_dir / "pytorch_model.bin").write_bytes(b"not loaded: pickles are never read")
    msg = load_error(qwen3_dir)
    assert "model.safetensors" in msg and str(qwen3_dir) in msg


def test_error_corrupt_safetensors(qwen3_dir):
    (qwen3_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "model.safetensors" in load_error(qwen3_dir)


def test_error_missing_shard(tmp_path):
    path = tmp_path / "sharded"
    make_hf_model("qwen3").save_pretrained(path, max_shard_size="20KB")
    with open(path / "model.safetensors.index.json") as f:
        victim = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(path / victim)
    assert victim in load_error(path)
