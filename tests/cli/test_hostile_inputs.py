"""Hostile input to decode.py and the weight loaders (issue 27): each case is ONE line on
stderr, exit code 2, no traceback, and no output file left behind; the output files are
written all or none (specjax.fileio.atomic_write_all); NaN or Inf weights are refused by
tensor name (specjax.models.checkpoint.check_finite)."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import decode
from specjax.errors import SpecjaxError


def run(args, capsys):
    code = decode.main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.err


def assert_one_line_exit_2(code, err, needle, tmp_path, *kept):
    """Exit 2, one line naming `needle`, and nothing in tmp_path but `kept`."""
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("decode.py: error:"), err
    assert "Traceback" not in err
    assert needle in err, err
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def outputs(tmp_path):
    return ["--output", tmp_path / "o.jsonl", "--summary", tmp_path / "s.json"]


def ngram(demo, *extra):
    return ["--target", demo / "target", "--drafter", "ngram", "--max-new-tokens", 4,
            "--no-compare-ar", "--show", 0, *extra]


# ----------------------------------------------------------------------------- prompts

@pytest.mark.parametrize("data,needle", [
    (b'{"prompt": "def f():"}\n{"prompt": "caf\xe9"}\n', "line 2: byte 0xe9 at column 16"),
    (b'\xff\xfe{\x00"\x00', "line 1: byte 0xff at column 1 is not UTF-8"),
    (b'{"prompt": "a\\udcff b"}\n', "line 1: the prompt holds a lone surrogate (U+DCFF"),
    (b'{"prompt": "ok", "id": "\\ud800"}\n', "line 1: the \"id\" holds a lone surrogate"),
])
def test_prompts_file_not_utf8_or_with_lone_surrogates(tiny_demo, tmp_path, capsys, data,
                                                      needle):
    (tmp_path / "p.jsonl").write_bytes(data)
    code, err = run(ngram(tiny_demo, "--prompts", tmp_path / "p.jsonl", *outputs(tmp_path)),
                    capsys)
    assert_one_line_exit_2(code, err, needle, tmp_path, "p.jsonl")


def test_prompts_file_with_a_bom_is_read(tiny_demo, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "def f():"}\n')
    code, err = run(ngram(tiny_demo, "--prompts", tmp_path / "p.jsonl", "--output",
                          tmp_path / "o.jsonl"), capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "o.jsonl").read_text())["id"] == "a"


@pytest.mark.parametrize("prompt", ["\udcff", "def f(x\udc80):"])
def test_prompt_flag_with_lone_surrogates(tiny_demo, tmp_path, capsys, prompt):
    """A --prompt argument holding bytes that are not UTF-8 reaches Python as lone
    surrogates (surrogateescape); the tokenizer used to raise a TypeError."""
    code, err = run(ngram(tiny_demo, "--prompt", prompt, *outputs(tmp_path)), capsys)
    assert_one_line_exit_2(code, err, "--prompt: the prompt holds a lone surrogate", tmp_path)


# ----------------------------------------------------------------------------- outputs

@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if decode.py reads any weights."""
    import specjax.models.checkpoint

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(specjax.models.checkpoint, "load_model", refuse)


@pytest.mark.parametrize("flag", ["--output", "--summary"])
def test_output_path_that_is_a_directory_is_refused_before_any_work(
        tiny_demo, tmp_path, capsys, no_model_loads, flag):
    (tmp_path / "dir").mkdir()
    paths = {"--output": tmp_path / "o.jsonl", "--summary": tmp_path / "s.json"}
    paths[flag] = tmp_path / "dir"
    args = ngram(tiny_demo, "--prompt", "def f():", "--output", paths["--output"],
                 "--summary", paths["--summary"])
    code, err = run(args, capsys)
    assert_one_line_exit_2(code, err, f"{flag} {tmp_path / 'dir'} is a directory", tmp_path,
                           "dir")
    assert os.listdir(tmp_path / "dir") == []


def test_output_and_summary_on_one_path(tiny_demo, tmp_path, capsys, no_model_loads):
    same = tmp_path / "x.json"
    code, err = run(ngram(tiny_demo, "--prompt", "x", "--output", same, "--summary", same),
                    capsys)
    assert_one_line_exit_2(code, err, "--output and --summary both name", tmp_path)


def test_output_files_are_written_all_or_none(tmp_path):
    from specjax.fileio import atomic_write_all

    (tmp_path / "old.txt").write_bytes(b"old")

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write_all([(tmp_path / "old.txt", lambda f: f.write(b"new")),
                          (tmp_path / "b.txt", fail)])
    assert sorted(os.listdir(tmp_path)) == ["old.txt"]  # no temporary left either
    assert (tmp_path / "old.txt").read_bytes() == b"old"
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_all([(tmp_path / "a.txt", lambda f: f.write(b"a")),
                          (tmp_path / "d", lambda f: f.write(b"d"))])
    assert sorted(os.listdir(tmp_path)) == ["d", "old.txt"]
    atomic_write_all([(tmp_path / "a.txt", lambda f: f.write(b"a")),
                      (tmp_path / "old.txt", lambda f: f.write(b"new"))])
    assert (tmp_path / "a.txt").read_bytes() == b"a"
    assert (tmp_path / "old.txt").read_bytes() == b"new"


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flag,value", [("--max-new-tokens", 0), ("--max-new-tokens", -3),
                                        ("--batch-size", 0), ("--batch-size", -1)])
def test_zero_or_negative_counts(tiny_demo, tmp_path, capsys, no_model_loads, flag, value):
    code, err = run(ngram(tiny_demo, "--prompt", "def f():", *outputs(tmp_path), flag, value),
                    capsys)
    assert_one_line_exit_2(code, err, f"{flag}={value} must be >= 1", tmp_path)


# ----------------------------------------------------------------------------- weights

def test_check_finite():
    import specjax.models.checkpoint as ckpt

    ckpt.check_finite("w", np.ones((4, 3), np.float32), "f")
    ckpt.check_finite("ids", np.arange(10, dtype=np.int64), "f")
    ckpt.check_finite("mask", np.ones(5, bool), "f")
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        for bad in (np.nan, np.inf, -np.inf):
            x = np.ones((3, 7), dtype)
            x[2, 6] = bad  # the last element: past the first chunk below
            with pytest.raises(SpecjaxError, match=r"^f: tensor w has NaN or Inf values"):
                ckpt.check_finite("w", x, "f")
    x = np.ones(100, np.float32)
    x[-1] = np.nan
    old, ckpt.FINITE_CHUNK = ckpt.FINITE_CHUNK, 7  # chunked: every element is seen
    try:
        with pytest.raises(SpecjaxError):
            ckpt.check_finite("w", x, "f")
        with pytest.raises(SpecjaxError):
            ckpt.check_finite("w", x.reshape(10, 10).T, "f")  # not contiguous
    finally:
        ckpt.FINITE_CHUNK = old


def poison(file, name=None, value=np.nan):
    """Sets one element of tensor `name` (default: the first float one) in a safetensors
    file to `value`, keeping its dtype; returns the tensor's name."""
    tensors = load_file(str(file))
    name = name or next(k for k, v in tensors.items() if v.dtype.kind not in "biu")
    arr = np.array(tensors[name])
    arr.reshape(-1)[arr.size // 2] = value
    tensors[name] = arr
    save_file(tensors, str(file), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value,dtype", [(np.nan, "float32"), (np.inf, "bfloat16")])
def test_target_with_nan_or_inf_is_refused(tiny_demo, tmp_path, capsys, value, dtype):
    target = tmp_path / "target"
    if dtype == "float32":
        shutil.copytree(tiny_demo / "target", target)
    else:
        from specjax.models.checkpoint import load_model, load_tokenizer, parse_dtype, save_model

        src = str(tiny_demo / "target")
        save_model(load_model(src), str(target), dtype=parse_dtype(dtype),
                   tokenizer=load_tokenizer(src))
    name = poison(target / "model.safetensors", "model.layers.1.mlp.up_proj.weight", value)
    out = tmp_path / "out"
    out.mkdir()
    code, err = run(ngram(tiny_demo, "--target", target, "--prompt", "def f():",
                          *outputs(out)), capsys)
    assert_one_line_exit_2(code, err, f"tensor {name} has NaN or Inf values", out)


def test_drafter_dir_with_nan_is_refused(tiny_demo, tmp_path, capsys):
    from specjax.testing.tiny import save_random_drafter

    drafter = tmp_path / "eagle3"
    save_random_drafter(str(tiny_demo / "target"), str(drafter))
    name = poison(drafter / "model.safetensors", value=-np.inf)
    out = tmp_path / "out"
    out.mkdir()
    code, err = run(ngram(tiny_demo, "--drafter", drafter, "--prompt", "def f():",
                          *outputs(out)), capsys)
    assert_one_line_exit_2(code, err, f"tensor {name} has NaN or Inf values", out)


@pytest.mark.parametrize("keep", [0, 9, 1000, -1])
def test_truncated_target_safetensors(tiny_demo, tmp_path, capsys, keep):
    target = tmp_path / "target"
    shutil.copytree(tiny_demo / "target", target)
    w = target / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[:keep])
    out = tmp_path / "out"
    out.mkdir()
    code, err = run(ngram(tiny_demo, "--target", target, "--prompt", "def f():",
                          *outputs(out)), capsys)
    assert_one_line_exit_2(code, err, "model.safetensors is not a readable safetensors file",
                           out)


# ----------------------------------------------------------------------------- external head

V, D, N, K, H, F, L = 48, 32, 4, 2, 16, 40, 4


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config

    d = tmp_path_factory.mktemp("small") / "target"
    save_model(Transformer(tiny_config(V, hidden_size=D, num_layers=L, num_heads=N,
                                       num_kv_heads=K, head_dim=H, intermediate_size=64)),
               str(d))
    return d


def eagle3_head(path, vocab, hot, config_vocab="same", d2t=True):
    """An EAGLE-3 head directory (SpecForge names) for a target of `vocab` tokens with a
    draft vocabulary of `hot`; config_vocab: the config.json vocab_size ("same": vocab,
    None: left out)."""
    rs = np.random.RandomState(0)

    def r(*s):
        return (0.3 * rs.standard_normal(s)).astype(np.float32)

    def n(k):
        return (1 + 0.2 * rs.standard_normal(k)).astype(np.float32)

    used = np.sort(rs.choice(vocab, hot, replace=False))
    t = {"fc.weight": r(D, 3 * D), "midlayer.input_layernorm.weight": n(D),
         "midlayer.hidden_norm.weight": n(D),
         "midlayer.self_attn.q_proj.weight": r(N * H, 2 * D),
         "midlayer.self_attn.k_proj.weight": r(K * H, 2 * D),
         "midlayer.self_attn.v_proj.weight": r(K * H, 2 * D),
         "midlayer.self_attn.o_proj.weight": r(D, N * H),
         "midlayer.post_attention_layernorm.weight": n(D),
         "midlayer.mlp.gate_proj.weight": r(F, D), "midlayer.mlp.up_proj.weight": r(F, D),
         "midlayer.mlp.down_proj.weight": r(D, F), "norm.weight": n(D),
         "lm_head.weight": r(hot, D)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
              "num_key_value_heads": K, "head_dim": H, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-5, "rope_theta": 500.0, "tie_word_embeddings": False}
    if d2t:
        t["d2t"] = (used - np.arange(hot)).astype(np.int64)
        t["t2d"] = np.isin(np.arange(vocab), used)
        config["draft_vocab_size"] = hot
    if config_vocab is not None:
        config["vocab_size"] = vocab if config_vocab == "same" else config_vocab
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(t, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("vocab,hot,config_vocab,d2t,needle", [
    (64, 20, "same", True, "vocab_size 64 != the target's 48"),
    (64, 60, V, True, "tensor d2t"),
    (32, 20, V, True, "tensor t2d"),
    (64, 20, None, True, "tensor d2t"),
    (64, 64, None, False, "tensor lm_head.weight has shape (64, 32)"),
    (32, 32, V, False, "tensor lm_head.weight has shape (32, 32)"),
])
def test_external_head_for_another_vocabulary(small_target, tmp_path, capsys, vocab, hot,
                                              config_vocab, d2t, needle):
    head = eagle3_head(tmp_path / "head", vocab, hot, config_vocab, d2t)
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7]}\n')
    out = tmp_path / "out"
    out.mkdir()
    code, err = run(["--target", small_target, "--drafter", head, "--prompts",
                     tmp_path / "p.jsonl", "--max-new-tokens", 4, *outputs(out)], capsys)
    assert_one_line_exit_2(code, err, needle, out)


def test_external_head_for_this_vocabulary_runs(small_target, tmp_path, capsys):
    """The control for the test above: the same head built for the target's vocabulary."""
    head = eagle3_head(tmp_path / "head", V, 20)
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7]}\n')
    code, err = run(["--target", small_target, "--drafter", head, "--prompts",
                     tmp_path / "p.jsonl", "--max-new-tokens", 4, "--no-compare-ar",
                     "--drafter-dtype", "float32", *outputs(tmp_path)], capsys)
    assert code == 0, err
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 1
