"""Decoding is a library call: `specjax.load_target`, `specjax.load_drafter` and
`specjax.read_prompts` with `specjax.decoding.engine.Engine` give decode.py's tokens, change
none of their arguments, and no library, benchmark or notebook module imports decode.py.
"""

import ast
import copy
import json
import os
import types

import jax
import jax.numpy as jnp
import pytest

import decode
import specjax
from specjax.core.sampling import SamplingParams
from specjax.decoding.engine import Engine, prompt_width_for
from specjax.testing.tiny import save_random_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def library_outputs(target_dir, drafter, prompts_file, new_tokens, **drafter_kw):
    """decode.py's defaults (greedy, batch 1, seed 0, EOS on) through the library."""
    target = specjax.load_target(target_dir)
    prompts = specjax.read_prompts(target.tokenizer, target.cfg.vocab_size,
                                   path=prompts_file, target=target_dir)
    d = specjax.load_drafter(drafter, target, **drafter_kw)
    longest = max(len(ids) for _, ids in prompts)
    max_length = longest + new_tokens
    engine = Engine(target.model, drafter=d.drafter, drafter_params=d.params,
                    max_length=max_length, prompt_width=prompt_width_for(longest, max_length),
                    eos_token_ids=target.cfg.eos_token_ids)
    engine.compile()
    base = jax.random.key(0)
    outs = [engine.run([ids], new_tokens, jax.random.fold_in(base, i)).outputs[0]
            for i, (_, ids) in enumerate(prompts)]
    return [pid for pid, _ in prompts], outs, d


@pytest.mark.parametrize("kind", [pytest.param("draft", marks=pytest.mark.slow), "eagle3"])
def test_library_matches_cli(kind, tiny_demo, tmp_path, capsys):
    tgt = str(tiny_demo / "target")
    drafter = (str(tiny_demo / "draft") if kind == "draft"
               else save_random_drafter(tgt, str(tmp_path / "eagle3")))
    prompts = str(tiny_demo / "prompts.jsonl")
    out, summary = tmp_path / "o.jsonl", tmp_path / "s.json"
    code = decode.main(["--target", tgt, "--drafter", drafter, "--prompts", prompts,
                        "--max-new-tokens", "10", "--no-compare-ar", "--show", "0",
                        "--gamma", "fixed",  # the library's engine below drafts at G
                        "--output", str(out), "--summary", str(summary)])
    assert code == 0, capsys.readouterr().err
    cli = [json.loads(line) for line in out.read_text().splitlines()]
    ids, outs, d = library_outputs(tgt, drafter, prompts, 10)
    assert [r["id"] for r in cli] == ids
    assert [r["output_ids"] for r in cli] == outs
    s = json.loads(summary.read_text())
    assert (s["drafter"], s["gamma"]) == (d.name, d.gamma)
    assert d.gamma == (3 if kind == "eagle3" else decode.DEFAULT_GAMMA)


def test_read_prompts_is_decodes():
    assert decode.read_prompts is specjax.read_prompts
    assert decode.DEMO_DIR == specjax.DEMO_DIR


def test_load_drafter_changes_no_argument(tiny_demo, tmp_path):
    tgt = str(tiny_demo / "target")
    target = specjax.load_target(tgt, dtype="float32")
    learned = save_random_drafter(tgt, str(tmp_path / "eagle3"))
    sampling = SamplingParams(1.0, 5, 0.9)
    before = (copy.copy(target), sampling)
    leaves = jax.tree.leaves(target.model)
    for spec, gamma in ((learned, None), ("ngram", None), (str(tiny_demo / "draft"), 2),
                        ("none", 5)):
        d = specjax.load_drafter(spec, target, gamma=gamma, sampling=sampling,
                                 matmul_dtype="auto", draft_vocab="auto")
        assert d.name == spec
        assert d.gamma == (None if spec == "none" else gamma or (
            3 if spec == learned else decode.DEFAULT_GAMMA))
        assert (target, sampling) == before
        assert all(a is b for a, b in zip(jax.tree.leaves(target.model), leaves,
                                          strict=True))
    assert target.dtype == jnp.float32


def test_drafter_sources_match_in_order_and_read_config_once(tiny_demo, tmp_path,
                                                            monkeypatch):
    """`load_drafter` picks the first drafter source that matches (`loading.sources()`:
    none, ngram, logitspec, a learned drafter, a head trained elsewhere, then any
    directory as a draft LM) from config.json read once, and a learned drafter's
    loading reads it no second time; a registered source is asked before the draft LM."""
    import builtins

    from specjax.decoding import loading

    tgt = str(tiny_demo / "target")
    target = specjax.load_target(tgt, dtype="float32")
    learned = save_random_drafter(tgt, str(tmp_path / "eagle3"))
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    draft = str(tiny_demo / "draft")
    found = {spec: loading.find_source(spec, loading.directory_config(spec)).name
             for spec in ("none", "ngram", "logitspec", learned, str(head), draft)}
    assert list(found.values()) == ["none", "ngram", "logitspec", "learned drafter",
                                    "external head", "draft LM"]
    assert loading.directory_config(str(tmp_path / "nope")) is None
    config = os.path.join(learned, "config.json")
    reads = []
    real_open = builtins.open

    def counting_open(file, *a, **kw):
        if os.path.abspath(str(file)) == os.path.abspath(config):
            reads.append(file)
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting_open)
    d = specjax.load_drafter(learned, target)
    monkeypatch.setattr(builtins, "open", real_open)
    assert len(reads) == 1 and d.gamma == 3

    class Fixed(loading.DrafterSource):
        name = "fixed"

        def matches(self, spec, config):
            return spec == draft

        def load(self, spec, config, target, opts):
            return loading.LoadedDrafter(None, None, spec, None)

    monkeypatch.setattr(loading, "_SOURCES", list(loading._SOURCES))
    loading.register_source(Fixed())
    assert specjax.load_drafter(draft, target) == (None, None, draft, None)
    with pytest.raises(ValueError):
        loading.register_source(Fixed())


def test_cli_defaults_give_ngram_the_default_gamma(tiny_demo):
    """decode.py's flags passed to `specjax.load_drafter` as they are: --gamma's default
    None gives the n-gram drafter DEFAULT_GAMMA, and the namespace is not changed."""
    tgt = str(tiny_demo / "target")
    target = specjax.load_target(tgt, dtype="float32")
    args = decode.build_parser().parse_args(["--target", tgt, "--drafter", "ngram"])
    frozen = types.SimpleNamespace(**vars(args))
    d = specjax.load_drafter(args.drafter, target, gamma=args.gamma, sampling=SamplingParams(),
                             matmul_dtype=args.drafter_dtype, draft_vocab=args.draft_vocab,
                             draft_stop=args.draft_stop)
    assert vars(args) == vars(frozen) and args.gamma is None
    assert d.name == "ngram" and d.drafter.gamma == decode.DEFAULT_GAMMA


def _imports_decode(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "decode" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "decode" and not node.level:
            return True
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) == "import_module" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "decode"):
            return True
    return False


def _notebook_code_imports_decode(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            try:
                tree = ast.parse(src)
            except SyntaxError:  # IPython magics
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import) and any(a.name == "decode" for a in node.names):
                    return True
                if isinstance(node, ast.ImportFrom) and node.module == "decode":
                    return True
    return False


def test_no_module_imports_decode():
    offenders, scanned = [], 0
    for top in ("specjax", "benchmarks", "notebooks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py"):
                    scanned += 1
                    if _imports_decode(path):
                        offenders.append(os.path.relpath(path, ROOT))
                elif name.endswith(".ipynb"):
                    scanned += 1
                    if _notebook_code_imports_decode(path):
                        offenders.append(os.path.relpath(path, ROOT))
    assert scanned > 20
    assert offenders == []
    # and the notebook's build script writes no `import decode` into a cell either
    with open(os.path.join(ROOT, "notebooks", "build_colab_tpu.py"), encoding="utf-8") as f:
        assert "import decode" not in f.read()
