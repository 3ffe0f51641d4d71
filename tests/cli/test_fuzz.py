"""Property-based tests (hypothesis) of the readers of user input: decode.py's prompt
reader, the HF config.json loader, the training YAML loader and the drafter-directory
loader. On random and mutated inputs each either succeeds or raises SpecjaxError (which
the command lines print as one line with exit code 2); any other exception is a bug.
Beyond that, each asserts what its answer must be:

- prompts: a reading of the JSONL format written here from its documentation
  (`expected_prompts`, no specjax code) says which files are valid, and the reader must
  agree: the same (id, token ids) for a valid file; for an invalid one an error that
  starts with the file and the number of its first bad line, and decode.py on that file
  exits with code 2, one line on stderr, no traceback and no output file left;
- every error is one line naming the file (or flag) it is about;
- an unchanged input loads, equal to the loader's answer on the original;
- what the formats forbid is refused (HF config: integer fields that are not positive
  integers, an unsupported model_type; training YAML: an unknown key, a section that
  is not a mapping; drafter directory: a shape the stored weights do not have), and an
  accepted edit is what the loaded config holds (HF config: its integer fields;
  training YAML: the edited scalars; drafter directory: its config fields);
- bytes that no longer parse (JSON, YAML) are refused, and damaged bytes that still
  parse to the original load as the original.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.errors import SpecjaxError

pytestmark = pytest.mark.timeout(120)

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


def load_or_error(fn, *a, names=None, **k):
    """(fn(*a, **k), None), or (None, message) where fn raises SpecjaxError: the message
    is one line (the command lines print it as theirs) and names `names` (the file,
    directory or flag the input came from) when given."""
    try:
        return fn(*a, **k), None
    except SpecjaxError as e:
        msg = str(e)
        assert "\n" not in msg.strip(), msg
        assert names is None or str(names) in msg, (names, msg)
        return None, msg


def same_value(got, want) -> bool:
    """got == want for JSON scalars, NaN equal to NaN."""
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return got == want


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
# lines of a valid file (so that valid files, which the hostile lines above rarely make,
# are read too): text or ids (within the demo's V = 8192), an optional id of any kind
unicode_text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24)
valid_lines = st.one_of(
    st.fixed_dictionaries({"prompt": unicode_text}, optional={"id": json_values}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 8191), min_size=1,
                                                 max_size=6)},
                          optional={"id": unicode_text})).map(
    lambda o: json.dumps(o, ensure_ascii=bool(len(json.dumps(o)) % 2)).encode())


@pytest.fixture(scope="module")
def demo_tokenizer():
    """The demo's tokenizer, loaded as decode.py loads it (V = 8192)."""
    from specjax.models.checkpoint import load_tokenizer
    from specjax.models.config import ModelConfig

    tok = load_tokenizer(DEMO_TARGET)
    assert tok is not None
    return tok, ModelConfig.from_dir(DEMO_TARGET).vocab_size


def is_text(x) -> bool:
    """Unicode text: no lone surrogates (a JSON \\udXXX escape without its pair)."""
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in x)


def expected_prompts(data: bytes, tok, V: int):
    """What decode.py must make of a prompts file, from the format as decode.py and
    docs/decode.md describe it (written here, no specjax code): ("ok", [(id, ids)]) or
    ("error", the bad line's number, or None for "no prompts found"). Lines are split at
    \\n, \\r and \\r\\n (bytes.splitlines), blank lines skipped; each other line is UTF-8
    (a BOM allowed on line 1) holding one JSON object with "input_ids" (a list of ints,
    not bools) or else "prompt" (text, encoded with the tokenizer, which must exist), and
    an optional "id" (default: the prompt's index), all Unicode text; a conversation
    ("messages" / "conversations") needs a chat template, which the demo tokenizer has
    not. After every line is read, in order, each prompt must be non-empty and its ids
    in [0, V)."""
    items = []
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError:
            return "error", n
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            return "error", n
        if not isinstance(obj, dict) or "messages" in obj or "conversations" in obj:
            return "error", n
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not all(type(i) is int for i in ids):
                return "error", n
        elif "prompt" in obj:
            text = obj["prompt"]
            if not isinstance(text, str) or not is_text(text) or tok is None:
                return "error", n
            ids = list(tok.encode(text))
        else:
            return "error", n
        pid = str(obj.get("id", len(items)))
        if not is_text(pid):
            return "error", n
        items.append((pid, ids, n))
    if not items:
        return "error", None
    for _, ids, n in items:
        if not ids or not all(0 <= i < V for i in ids):
            return "error", n
    return "ok", [(pid, ids) for pid, ids, _ in items]


def error_start(path, n) -> str:
    return f"--prompts {path}: no prompts found" if n is None else f"{path} line {n}: "


@FAST
@given(lines=st.lists(prompt_lines, max_size=5) | st.lists(valid_lines, min_size=1, max_size=4),
       bom=st.booleans(), with_tokenizer=st.booleans())
def test_prompt_reader(demo_tokenizer, lines, bom, with_tokenizer):
    import decode

    tok, V = demo_tokenizer
    tok = tok if with_tokenizer else None
    data = b"\xef\xbb\xbf" * bom + b"\n".join(lines) + b"\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.jsonl")
        with open(path, "wb") as f:
            f.write(data)
        got, err = load_or_error(decode.read_prompts, tok, V, path=path, target=d)
    verdict, want = expected_prompts(data, tok, V)
    if verdict == "ok":
        assert err is None, (err, want)
        assert got == want
        for pid, _ in got:
            json.dumps(pid, ensure_ascii=False).encode()  # printable and writable
    else:
        assert got is None, (got, want)
        assert err.startswith(error_start(path, want)), (err, want)


@FAST
@given(lines=st.lists(prompt_lines, max_size=5), bom=st.booleans())
def test_decode_cli_on_bad_prompts(demo_tokenizer, lines, bom):
    """decode.py on a prompts file that `expected_prompts` says is invalid: exit code 2,
    one line on stderr naming the file and its first bad line, no traceback, no output
    file, and no weights read (the prompts are read first)."""
    import contextlib
    import io

    import decode

    tok, V = demo_tokenizer
    data = b"\xef\xbb\xbf" * bom + b"\n".join(lines) + b"\n"
    verdict, want = expected_prompts(data, tok, V)
    if verdict == "ok":  # valid files would decode: test_prompt_reader covers them
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.jsonl")
        with open(path, "wb") as f:
            f.write(data)
        out, summary = os.path.join(d, "o.jsonl"), os.path.join(d, "s.json")
        stderr, stdout = io.StringIO(), io.StringIO()
        with mock.patch("specjax.models.checkpoint.load_model",
                        side_effect=AssertionError("weights read before the prompts")), \
                contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            code = decode.main(["--target", DEMO_TARGET, "--drafter", "none", "--prompts",
                                path, "--output", out, "--summary", summary])
        assert sorted(os.listdir(d)) == ["p.jsonl"]  # no output file, not even a partial one
    err = stderr.getvalue()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("decode.py: error: " + error_start(path, want)), (err, want)


@FAST
@given(text=hostile_text)
def test_prompt_flag(demo_tokenizer, text):
    import decode

    tok, V = demo_tokenizer
    got, err = load_or_error(decode.read_prompts, tok, V, prompt=text, target=DEMO_TARGET,
                             names="--prompt")
    if got is not None:
        assert got == [("0", tok.encode(text))] and all(0 <= i < V for i in got[0][1])
    else:
        assert not text or not is_text(text), err


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


# config.json's integer fields -> (ModelConfig's field, whether a falsy value means "derive
# it": num_key_value_heads = num_attention_heads, head_dim = hidden_size / heads); where
# the file holds a positive integer the loaded config holds it, anything else is refused
HF_INTS = {"hidden_size": ("hidden_size", False), "num_hidden_layers": ("num_layers", False),
           "num_attention_heads": ("num_heads", False), "vocab_size": ("vocab_size", False),
           "intermediate_size": ("intermediate_size", False),
           "num_key_value_heads": ("num_kv_heads", True), "head_dim": ("head_dim", True)}


def hf_original(hf_config):
    """ModelConfig of the unedited config.json."""
    from specjax.models.config import ModelConfig

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(hf_config, f)
        return ModelConfig.from_dir(d)


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
        got, err = load_or_error(ModelConfig.from_dir, d, names=d)
    if not edits and not drop:
        assert got == hf_original(hf_config), err
    if raw.get("model_type") not in ("qwen3", "llama"):
        assert got is None
    for key, (field, optional) in HF_INTS.items():  # what the file says is what loads
        if key not in raw or (optional and not raw[key]):  # absent, or derived
            continue
        if type(raw[key]) is not int or raw[key] < 1:
            assert got is None, (key, raw[key])
        elif got is not None:
            assert getattr(got, field) == raw[key], (key, raw[key], got)


@FAST
@given(ops=byte_ops)
def test_hf_config_loader_on_damaged_bytes(hf_config, ops):
    from specjax.models.config import ModelConfig

    data = mutate_bytes(json.dumps(hf_config).encode(), ops)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "wb") as f:
            f.write(data)
        got, err = load_or_error(ModelConfig.from_dir, d, names=d)
    try:
        parsed = json.loads(data)
    except ValueError:  # UnicodeDecodeError included
        parsed = None
    if parsed is None or not isinstance(parsed, dict):
        assert got is None
    elif parsed == hf_config:  # still the original (a flip to the same byte, ...)
        assert got == hf_original(hf_config), err


# ----------------------------------------------------------------------------- train YAML

TRAIN_KEYS = ["objective", "run_dir", "target", "model", "model.hidden_size",
              "model.vocab_size", "data", "data.seq_len", "data.corpus", "mesh", "mesh.data",
              "optim.lr", "optim.warmup_steps", "train.steps", "train.batch_size",
              "train.dtype", "train.init_from", "drafter", "drafter.kind", "drafter.gamma",
              "drafter.context", "export.dtype", "nonsense.key"]
TRAIN_SECTIONS = ("model", "data", "mesh", "optim", "train", "drafter", "export")


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
        got, err = load_or_error(load_config, path, names=path)
    if not edits:
        assert got == load_config(os.path.join(ROOT, "configs", config)), err
    if "nonsense" in raw:  # an unknown key (or section)
        assert got is None and "nonsense" in err, err
    if any(raw.get(k) is not None and not isinstance(raw[k], dict) for k in TRAIN_SECTIONS):
        assert got is None, raw
    if got is not None:  # every edited scalar is what the config holds
        for key, _ in edits:
            node, *rest = key.split(".")
            value = raw[node][rest[0]] if rest else raw[node]
            if value is None or isinstance(value, (dict, list)):
                continue  # null: the default; containers: no scalar to compare
            held = getattr(got, node)
            held = getattr(held, rest[0]) if rest else held
            assert same_value(held, value), (key, value, held)


@FAST
@given(ops=byte_ops)
def test_train_config_loader_on_damaged_bytes(ops):
    import yaml

    from specjax.train import load_config

    original = os.path.join(ROOT, "configs", "drafters", "kv.yaml")
    data = mutate_bytes(open(original, "rb").read(), ops)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.yaml")
        with open(path, "wb") as f:
            f.write(data)
        got, err = load_or_error(load_config, path, names=path)
    try:
        parsed = yaml.safe_load(data.decode("utf-8"))
    except (yaml.YAMLError, ValueError):  # ValueError: not UTF-8
        parsed = None
    if parsed is None or not isinstance(parsed, dict):
        assert got is None
    elif parsed == yaml.safe_load(open(original)):  # still the original's mapping
        # (run_dir defaults to runs/<file stem>: the copy's stem is "c")
        want = load_config(original, run_dir=parsed.get("run_dir", os.path.join("runs", "c")))
        assert got == want, err


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


# config.json keys that fix the shapes of the stored weights, and those that are
# DrafterConfig fields
DRAFTER_SHAPES = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                  "num_layers", "capture", "kv_layers")
DRAFTER_FIELDS = ("kind", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "gamma", "num_layers", "capture", "kv_layers", "context",
                  "mask_token_id", "target_num_layers", "rms_norm_eps")


@FAST
@given(edits=st.dictionaries(st.sampled_from(
    ["kind", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "gamma",
     "num_layers", "capture", "kv_layers", "context", "mask_token_id", "target",
     "target_num_layers", "format", "rms_norm_eps"]), json_values, max_size=3),
    ops=byte_ops, damage_weights=st.booleans())
def test_drafter_dir_loader(drafter_dir, edits, ops, damage_weights):
    from flax import nnx

    from specjax.drafters.io import load_drafter

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "drafter")
        shutil.copytree(drafter_dir, path)
        raw = json.load(open(os.path.join(path, "config.json")))
        raw.update(edits)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)
        weights = os.path.join(path, "model.safetensors")
        original = open(weights, "rb").read()
        data = mutate_bytes(original, ops) if damage_weights else original
        with open(weights, "wb") as f:
            f.write(data)
        got, err = load_or_error(load_drafter, path, names=path)
    if got is None:
        return
    flat = dict(nnx.to_flat_state(got[1]))
    assert all(np.isfinite(np.asarray(v.get_value())).all() for v in flat.values())
    if not edits and data == original:  # unchanged: the saved drafter exactly
        want_cfg, want_params, _ = load_drafter(str(drafter_dir))
        assert got[0] == want_cfg
        want = dict(nnx.to_flat_state(want_params))
        assert flat.keys() == want.keys()
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(flat[k].get_value()),
                                          np.asarray(v.get_value()))
    saved = json.load(open(os.path.join(drafter_dir, "config.json")))
    for key, value in edits.items():  # what was accepted is what the config holds
        if key in DRAFTER_SHAPES:  # the stored weights fit one value only
            assert same_value(value, saved[key]), (key, value, saved[key])
        if key in DRAFTER_FIELDS and value is not None and not isinstance(value, dict):
            held = getattr(got[0], key)
            want = tuple(value) if isinstance(value, list) else value
            assert same_value(held, want), (key, value, held)
