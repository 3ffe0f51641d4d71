"""decode.py: outputs, summary, determinism, and one-line errors with exit code 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import decode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args, capsys):
    code = decode.main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def base_args(demo, tmp_path, *extra):
    """decode.py's flags for the tiny demo. --gamma fixed: with --gamma auto (the default,
    tests/decoding/test_adaptive.py runs it end to end) a tiny drafter's batches would go to
    the autoregressive fallback, so that nothing speculative were tested, and the adaptive
    program would double each run's compile time. A later --gamma in extra wins."""
    return ["--target", demo / "target", "--drafter", demo / "draft", "--prompts",
            demo / "prompts.jsonl", "--max-new-tokens", 12, "--output", tmp_path / "o.jsonl",
            "--summary", tmp_path / "s.json", "--gamma", "fixed", *extra]


def test_outputs_summary_and_speedup(tiny_demo, tmp_path, capsys):
    code, out, err = run(base_args(tiny_demo, tmp_path, "--compare-ar", "--batch-size", 3),
                         capsys)
    assert code == 0, err
    lines = [json.loads(x) for x in open(tmp_path / "o.jsonl")]
    ids = [json.loads(x)["id"] for x in open(tiny_demo / "prompts.jsonl")]
    assert [r["id"] for r in lines] == ids  # input order
    assert all(set(r) == {"id", "prompt_ids", "output_ids", "text"} for r in lines)
    assert all(1 <= len(r["output_ids"]) <= 12 for r in lines)
    s = json.load(open(tmp_path / "s.json"))
    for k in ("new_tokens", "wall_s", "compile_s", "tokens_per_s", "tau", "alpha",
              "ar_tokens_per_s", "speedup"):
        assert k in s, k
    assert s["new_tokens"] == sum(len(r["output_ids"]) for r in lines)
    assert len(s["alpha"]) == 4 and 1 <= s["tau"] <= 5
    assert s["ar_identical"] is True
    assert "tokens/s" in out and "speedup" in out


@pytest.mark.parametrize("drafter", ["ngram", "none"])
def test_same_seed_same_output(tiny_demo, tmp_path, capsys, drafter):
    args = base_args(tiny_demo, tmp_path, "--temperature", 1.0, "--top-p", 0.9, "--seed", 7,
                     "--drafter", drafter, "--ignore-eos")
    assert run(args, capsys)[0] == 0
    first = open(tmp_path / "o.jsonl").read()
    assert run(args, capsys)[0] == 0
    assert open(tmp_path / "o.jsonl").read() == first
    assert all(len(json.loads(x)["output_ids"]) == 12 for x in first.splitlines())


def test_input_ids_prompts_need_no_tokenizer(tiny_demo, tmp_path, capsys):
    target = tmp_path / "notok"
    shutil.copytree(tiny_demo / "target", target)
    for f in os.listdir(target):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            os.remove(target / f)
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7]}\n{"id": "x", "input_ids": [9]}\n')
    code, _, err = run(["--target", target, "--drafter", "ngram", "--prompts",
                        tmp_path / "p.jsonl", "--max-new-tokens", 4, "--output",
                        tmp_path / "o.jsonl"], capsys)
    assert code == 0, err
    lines = [json.loads(x) for x in open(tmp_path / "o.jsonl")]
    assert [r["id"] for r in lines] == ["0", "x"] and "text" not in lines[0]


def _write(tmp_path, text):
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    return p


BAD = {
    "missing_target": (lambda d, t: ["--target", t / "nope"], "does not exist"),
    "unsupported_arch": (None, "unsupported architecture"),
    "vocab_mismatch": (None, "vocabulary"),
    "malformed_json": (lambda d, t: ["--prompts", _write(t, '{"prompt": "a"}\n{oops\n')],
                       "line 2"),
    "no_field": (lambda d, t: ["--prompts", _write(t, '{"id": 3}\n')], "line 1"),
    "token_out_of_vocab": (lambda d, t: ["--prompts", _write(t, '{"input_ids": [1, 99999]}\n')],
                           "99999"),
    "too_long": (lambda d, t: ["--max-length", 5], "--max-length"),
    "gamma": (lambda d, t: ["--gamma", 0], "--gamma"),
    "temperature": (lambda d, t: ["--temperature", -1], "--temperature"),
    "top_p_zero": (lambda d, t: ["--top-p", 0], "--top-p"),
    "top_p_big": (lambda d, t: ["--top-p", 1.5], "--top-p"),
    "top_k": (lambda d, t: ["--top-k", -2], "--top-k"),
    "missing_prompts": (lambda d, t: ["--prompts", t / "none.jsonl"], "none.jsonl"),
    "beyond_positions": (lambda d, t: ["--max-length", 100_000], "max_position_embeddings"),
    "cache_too_big": (lambda d, t: ["--max-length", 10**10, "--allow-long-context"],
                      "decoding needs about"),
    "absurd_config": (None, "decoding needs about"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line(tiny_demo, tmp_path, capsys, case):
    make, expect = BAD[case]
    if case == "unsupported_arch":
        bad = tmp_path / "gpt2"
        shutil.copytree(tiny_demo / "target", bad)
        cfg = json.load(open(bad / "config.json"))
        cfg["model_type"] = "gpt2"
        json.dump(cfg, open(bad / "config.json", "w"))
        extra = ["--target", bad]
    elif case == "absurd_config":  # refused from config.json alone: no weights are read
        bad = tmp_path / "huge"
        bad.mkdir()
        cfg = json.load(open(tiny_demo / "target" / "config.json"))
        cfg.update(hidden_size=10**9, intermediate_size=10**9)
        json.dump(cfg, open(bad / "config.json", "w"))
        for f in os.listdir(tiny_demo / "target"):
            if f.startswith("tokenizer") or f == "special_tokens_map.json":
                shutil.copy(tiny_demo / "target" / f, bad / f)
        extra = ["--target", bad, "--drafter", "ngram"]
    elif case == "vocab_mismatch":
        from specjax.models.checkpoint import load_model, save_model
        from specjax.models.model import Transformer
        from specjax.testing.tiny import tiny_config

        small = Transformer(tiny_config(vocab_size=100, hidden_size=32, num_layers=1,
                                        intermediate_size=32))
        save_model(small, str(tmp_path / "small"))
        assert load_model(str(tmp_path / "small")).cfg.vocab_size == 100
        extra = ["--drafter", tmp_path / "small"]
    else:
        extra = make(tiny_demo, tmp_path)
    code, _, err = run(base_args(tiny_demo, tmp_path, *extra), capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("decode.py: error:"), err
    assert expect in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "s.json").exists()


def test_subprocess_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "decode.py"), "--target",
                           str(tmp_path / "missing"), "--prompt", "x", "--output",
                           str(tmp_path / "o.jsonl")], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_compile_cache_is_written_then_loaded(tiny_demo, tmp_path):
    """--compile-cache DIR: the first run writes the compiled loops there, a second run
    loads them (no new entries) and prints the same completions; "none" writes nothing,
    not even to the JAX_COMPILATION_CACHE_DIR of the environment; a default directory
    that cannot be created turns the cache off without a warning."""
    cache, env_cache = tmp_path / "cache", tmp_path / "env_cache"
    env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_COMPILATION_CACHE_DIR=str(env_cache))

    def decode_run(i, *flags, env=env):
        args = base_args(tiny_demo, tmp_path, "--drafter", "ngram", *flags)
        args[args.index("--output") + 1] = tmp_path / f"o{i}.jsonl"
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "decode.py"),
                               *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "compilation cache" not in proc.stderr, proc.stderr[-2000:]
        return (tmp_path / f"o{i}.jsonl").read_text()

    def compiled():
        return sorted(os.listdir(cache))

    first = decode_run(1, "--compile-cache", cache)
    entries = compiled()
    assert any("speculative_loop" in e for e in entries), entries
    assert any("autoregressive_loop" in e for e in entries), entries
    assert decode_run(2, "--compile-cache", cache) == first
    assert compiled() == entries
    assert decode_run(3, "--compile-cache", "none") == first
    assert not env_cache.exists() or not os.listdir(env_cache)
    # the default directory under an unwritable XDG_CACHE_HOME: the cache is off, quietly
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    bare = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    assert decode_run(4, env=dict(bare, XDG_CACHE_HOME=str(blocker))) == first


def test_compile_cache_not_writable(tmp_path, capsys):
    """An explicit --compile-cache that cannot be created: one line, exit 2, no output
    file (checked before any model loads)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(["--compile-cache", blocker / "sub", "--prompt", "x", "--output",
                        tmp_path / "o.jsonl"], capsys)
    assert code == 2 and "--compile-cache" in err and err.count("\n") == 1
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_flag_value_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        decode.main(["--gamma", "three"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gamma" in err


def test_no_pytorch_advisory_without_torch(tiny_demo, tmp_path):
    """A user without torch (decode.py never needs it) sees no transformers advisory."""
    code = ("import sys, runpy; sys.modules['torch'] = None; "  # as if torch were absent
            f"sys.argv = ['decode.py', *{[str(a) for a in base_args(tiny_demo, tmp_path)]!r}, "
            "'--drafter', 'ngram', '--no-compare-ar']; runpy.run_path('decode.py', "
            "run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PyTorch was not found" not in proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def learned_drafter(tiny_demo, tmp_path_factory):
    """A random-init eagle3 drafter (G=3) exported for the tiny demo target."""
    from specjax.testing.tiny import save_random_drafter

    d = tmp_path_factory.mktemp("drafter") / "eagle3"
    save_random_drafter(str(tiny_demo / "target"), str(d))
    return d


def test_learned_drafter_dir_uses_its_gamma_and_equals_ar(tiny_demo, learned_drafter,
                                                         tmp_path, capsys):
    args = base_args(tiny_demo, tmp_path, "--drafter", learned_drafter, "--batch-size", 2)
    code, out, err = run(args, capsys)
    assert code == 0, err
    s = json.load(open(tmp_path / "s.json"))
    assert s["gamma"] == 3 and len(s["alpha"]) == 3  # G from the drafter's config.json
    assert s["ar_identical"] is True
    code, _, err = run(args + ["--gamma", 5], capsys)
    assert code == 0, err
    assert json.load(open(tmp_path / "s.json"))["gamma"] == 5


def test_drafter_for_another_target_is_one_line_exit_2(tiny_demo, learned_drafter, tmp_path,
                                                       capsys):
    from specjax.models.checkpoint import load_model, save_model

    other = tmp_path / "other_target"  # same shapes, other weights
    model = load_model(str(tiny_demo / "target"))
    model.final_norm.set_value(model.final_norm[...] * 1.5)
    save_model(model, str(other))
    shutil.copy(tiny_demo / "target" / "tokenizer.json", other)
    args = base_args(tiny_demo, tmp_path, "--drafter", learned_drafter, "--target", other)
    code, _, err = run(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(learned_drafter) in err and str(other) in err and "trained against" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_allow_long_context_runs_past_max_position_embeddings(tiny_demo, tmp_path, capsys):
    target = tmp_path / "short"
    shutil.copytree(tiny_demo / "target", target)
    cfg = json.load(open(target / "config.json"))
    cfg["max_position_embeddings"] = 8
    json.dump(cfg, open(target / "config.json", "w"))
    args = base_args(tiny_demo, tmp_path, "--target", target, "--drafter", "ngram")
    code, _, err = run(args, capsys)
    assert code == 2 and "max_position_embeddings 8" in err and "--allow-long-context" in err
    code, _, err = run(args + ["--allow-long-context"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("drafter,temperature", [  # the default run: each drafter at one T
    ("draft", 0.0), pytest.param("draft", 1.0, marks=pytest.mark.slow),
    pytest.param("ngram", 0.0, marks=pytest.mark.slow), ("ngram", 1.0),
    ("learned", 0.0), ("learned", 1.0)])
def test_kernels_pallas_equals_reference(tiny_demo, learned_drafter, tmp_path, capsys,
                                         drafter, temperature):
    """--kernels pallas (the verification kernel, interpret mode on CPU) and --kernels
    reference (its jnp twin) give identical output_ids for the same seed."""
    d = {"draft": tiny_demo / "draft", "ngram": "ngram", "learned": learned_drafter}[drafter]
    outs = {}
    for kernels in ("reference", "pallas"):
        args = base_args(tiny_demo, tmp_path, "--drafter", d, "--temperature", temperature,
                         "--seed", 3, "--kernels", kernels, "--no-compare-ar",
                         "--batch-size", 2, "--gamma", "fixed")  # T > 0 samples follow
        # the draft lengths, and --gamma auto's depend on each setting's measured costs
        code, _, err = run(args, capsys)
        assert code == 0, err
        assert json.load(open(tmp_path / "s.json"))["kernels"] == kernels
        outs[kernels] = [json.loads(x)["output_ids"] for x in open(tmp_path / "o.jsonl")]
    assert outs["pallas"] == outs["reference"]
