"""Property-based tests (hypothesis) of the readers of user input: decode.py's prompt
reader, the HF config.json loader, the training YAML loader and the drafter-directory
loader. On random and mutated inputs each either succeeds or raises SpecjaxError (which
the command lines print as one line with exit code 2); any other exception is a bug."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.errors import SpecjaxError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# JSON values of every kind, small
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)


def only_specjax_errors(fn, *a, **k):
    try:
        return fn(*a, **k)
    except SpecjaxError as e:
        assert "\n" not in str(e).strip(), str(e)  # printed as one line
        return None


def mutate_bytes(data: bytes, draw_ops) -> bytes:
    """Applies (kind, position, value) operations: flip a byte, truncate, insert."""
    out = bytearray(data)
    for kind, pos, val in draw_ops:
        if not out:
            break
        i = pos % len(out)
        if kind == "flip":
            out[i] = val
        elif kind == "cut":
            del out[i:]
        else:
            out[i:i] = bytes([val])
    return bytes(out)


byte_ops = st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert"]),
                              st.integers(0, 10**6), st.integers(0, 255)), max_size=4)


# ----------------------------------------------------------------------------- prompts

DEMO_TARGET = os.path.join(ROOT, "checkpoints", "demo", "target")

# text with lone surrogates among ordinary characters: what a JSON "\\udXXX" escape
# without its pair, or a --prompt argument holding bytes that are not UTF-8, gives Python
hostile_text = st.text(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr),
                                 st.sampled_from("\x00\t\r\u2028\ufeff")), max_size=24)
hostile_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | hostile_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner,
                                                                max_size=4),
    max_leaves=8)
json_objects = st.one_of(
    hostile_values,
    st.fixed_dictionaries({"prompt": hostile_text}, optional={"id": hostile_values}),
    st.fixed_dictionaries({"prompt": hostile_values}),
    st.fixed_dictionaries({"input_ids": hostile_values}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(-5, 9000), max_size=6),
                           "id": hostile_values}))
# one line of the file, as bytes: JSON (escaped, or raw with surrogates written as the
# invalid UTF-8 that surrogatepass gives), or any bytes at all
prompt_lines = st.one_of(
    json_objects.map(lambda o: json.dumps(o).encode()),
    json_objects.map(lambda o: json.dumps(o, ensure_ascii=False).encode("utf-8",
                                                                        "surrogatepass")),
    hostile_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=24))


@pytest.fixture(scope="module")
def demo_tokenizer():
    """The demo's tokenizer, loaded as decode.py loads it (V = 8192)."""
    from specjax.models.checkpoint import load_tokenizer
    from specjax.models.config import ModelConfig

    tok = load_tokenizer(DEMO_TARGET)
    assert tok is not None
    return tok, ModelConfig.from_dir(DEMO_TARGET).vocab_size


@FAST
@given(lines=st.lists(prompt_lines, max_size=5), bom=st.booleans(),
       with_tokenizer=st.booleans())
def test_prompt_reader(demo_tokenizer, lines, bom, with_tokenizer):
    import decode

    tok, V = demo_tokenizer
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.jsonl")
        with open(path, "wb") as f:
            f.write(b"\xef\xbb\xbf" * bom + b"\n".join(lines) + b"\n")
        got = only_specjax_errors(decode.read_prompts, tok if with_tokenizer else None, V,
                                  path=path, target=d)
    if got is not None:
        assert got and all(ids and all(0 <= i < V for i in ids) for _, ids in got)
        for pid, _ in got:
            json.dumps(pid, ensure_ascii=False).encode()  # printable and writable


@FAST
@given(text=hostile_text)
def test_prompt_flag(demo_tokenizer, text):
    import decode

    tok, V = demo_tokenizer
    got = only_specjax_errors(decode.read_prompts, tok, V, prompt=text, target=DEMO_TARGET)
    if got is not None:
        assert got == [("0", tok.encode(text))] and all(0 <= i < V for i in got[0][1])
    else:
        assert not text or any(0xD800 <= ord(c) <= 0xDFFF for c in text)


# ----------------------------------------------------------------------------- HF config

@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config

    d = tmp_path_factory.mktemp("hf")
    save_model(Transformer(tiny_config(64, hidden_size=16, num_layers=1, num_heads=2,
                                       num_kv_heads=1, head_dim=8, intermediate_size=16)),
               str(d / "m"))
    return json.load(open(d / "m" / "config.json"))


@FAST
@given(edits=st.dictionaries(st.sampled_from(
    ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
     "head_dim", "vocab_size", "intermediate_size", "rope_parameters", "model_type",
     "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
     "rope_scaling", "architectures"]), json_values, max_size=3),
    drop=st.lists(st.sampled_from(["hidden_size", "vocab_size", "model_type",
                                   "num_hidden_layers"]), max_size=2))
def test_hf_config_loader(hf_config, edits, drop):
    from specjax.models.config import ModelConfig

    raw = dict(hf_config, **edits)
    for k in drop:
        raw.pop(k, None)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(raw, f)
        only_specjax_errors(ModelConfig.from_dir, d)


@FAST
@given(ops=byte_ops)
def test_hf_config_loader_on_damaged_bytes(hf_config, ops):
    from specjax.models.config import ModelConfig

    data = mutate_bytes(json.dumps(hf_config).encode(), ops)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "wb") as f:
            f.write(data)
        only_specjax_errors(ModelConfig.from_dir, d)


# ----------------------------------------------------------------------------- train YAML

TRAIN_KEYS = ["objective", "run_dir", "target", "model", "model.hidden_size",
              "model.vocab_size", "data", "data.seq_len", "data.corpus", "mesh", "mesh.data",
              "optim.lr", "optim.warmup_steps", "train.steps", "train.batch_size",
              "train.dtype", "train.init_from", "drafter", "drafter.kind", "drafter.gamma",
              "drafter.context", "export.dtype", "nonsense.key"]


@FAST
@given(config=st.sampled_from(["test_tiny.yaml", "drafters/eagle3.yaml", "drafters/block.yaml",
                               "study/kv4.yaml"]),
       edits=st.lists(st.tuples(st.sampled_from(TRAIN_KEYS), json_values), max_size=3))
def test_train_config_loader(config, edits):
    import yaml

    from specjax.train import load_config

    raw = yaml.safe_load(open(os.path.join(ROOT, "configs", config)))
    for key, value in edits:
        node, *rest = key.split(".")
        if rest:
            if not isinstance(raw.get(node), dict):
                raw[node] = {}
            raw[node][rest[0]] = value
        else:
            raw[node] = value
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(raw, f)
        only_specjax_errors(load_config, path)


@FAST
@given(ops=byte_ops)
def test_train_config_loader_on_damaged_bytes(ops):
    from specjax.train import load_config

    data = mutate_bytes(open(os.path.join(ROOT, "configs", "drafters", "kv.yaml"), "rb").read(),
                        ops)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.yaml")
        with open(path, "wb") as f:
            f.write(data)
        only_specjax_errors(load_config, path)


# ----------------------------------------------------------------------------- drafter dir

@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    import jax.numpy as jnp
    from flax import nnx

    from specjax.drafters import DrafterConfig, build_network
    from specjax.drafters.io import save_drafter
    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config

    d = tmp_path_factory.mktemp("drafter")
    tcfg = tiny_config(64, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1,
                       head_dim=8, intermediate_size=16)
    save_model(Transformer(tcfg), str(d / "target"))
    dcfg = DrafterConfig.for_target(tcfg, "hybrid", gamma=3)
    _, params, _ = nnx.split(build_network(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(0)),
                             nnx.Param, ...)
    save_drafter(str(d / "drafter"), dcfg, params, str(d / "target"))
    return d / "drafter"


@FAST
@given(edits=st.dictionaries(st.sampled_from(
    ["kind", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "gamma",
     "num_layers", "capture", "kv_layers", "context", "mask_token_id", "target",
     "target_num_layers", "format", "rms_norm_eps"]), json_values, max_size=3),
    ops=byte_ops, damage_weights=st.booleans())
def test_drafter_dir_loader(drafter_dir, edits, ops, damage_weights):
    from specjax.drafters.io import load_drafter

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "drafter")
        shutil.copytree(drafter_dir, path)
        raw = json.load(open(os.path.join(path, "config.json")))
        raw.update(edits)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)
        if damage_weights:
            w = os.path.join(path, "model.safetensors")
            data = mutate_bytes(open(w, "rb").read(), ops)
            with open(w, "wb") as f:
                f.write(data)
        got = only_specjax_errors(load_drafter, path)
    if got is not None and not edits and not damage_weights:
        assert np.isfinite(sum(float(np.abs(np.asarray(v.get_value())).sum())
                               for _, v in __import__("flax").nnx.to_flat_state(got[1])))
