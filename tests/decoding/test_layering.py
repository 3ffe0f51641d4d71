"""The package's layering (issue 28): decoding never imports training code.

Read from the source with `ast` (every import statement, those inside functions too), so
the test sees lazy imports that an import-time check of sys.modules would miss."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Everything `python decode.py` can run: the library outside specjax/train (and the corpus,
# packing and regeneration of specjax/data/), the kernels.
TRAINING = ("specjax/train/", "specjax/plan.py", "specjax/testing/", "specjax/data/")


def _decoding_files():
    yield os.path.join(ROOT, "decode.py")
    for top in ("specjax", "pallas_kernels"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                if name.endswith(".py") and not rel.startswith(TRAINING):
                    yield path


def _imports(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_decoding_imports_no_training_code():
    bad = [(os.path.relpath(p, ROOT), m) for p in _decoding_files() for m in _imports(p)
           if m == "specjax.train" or m.startswith("specjax.train.")]
    assert not bad, bad


def test_the_scan_sees_lazy_imports(tmp_path):
    """The scan must be able to fail: an import inside a function is found."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from specjax.train.config import TrainLoopConfig\n")
    assert "specjax.train.config" in set(_imports(str(f)))


def _package_imports(package):
    """(file, imported module) for every import in specjax/<package>/, lazy ones too."""
    for dirpath, _, names in os.walk(os.path.join(ROOT, "specjax", package)):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield from ((os.path.relpath(path, ROOT), m) for m in _imports(path))


# The floor (issue 51): what drafters and decoding both need lives in specjax.core, so a
# drafter never imports the loop that calls it, and data never imports decoding.
@pytest.mark.parametrize("package, forbidden", [
    ("core", ("specjax.decoding", "specjax.drafters", "specjax.data", "specjax.train")),
    ("drafters", ("specjax.decoding",)),
    ("data", ("specjax.decoding",)),
    ("models", ("specjax.decoding", "specjax.drafters", "specjax.data", "specjax.train")),
])
def test_layers_import_only_below(package, forbidden):
    bad = [(f, m) for f, m in _package_imports(package)
           if any(m == x or m.startswith(x + ".") for x in forbidden)]
    assert not bad, bad


def test_the_layer_scan_can_fail():
    """Every package the layering test names exists and has imports to check."""
    for package in ("core", "drafters", "data", "models"):
        assert any(True for _ in _package_imports(package)), package


def test_generate_imports_no_drafter_implementation():
    """The loop reaches drafters through the protocol of specjax/core/drafter.py only; the
    kernel choice comes from specjax/decoding/kernel_policy.py, passed explicitly (issue 28)."""
    path = os.path.join(ROOT, "specjax", "decoding", "generate.py")
    bad = [m for m in _imports(path)
           if m.startswith("specjax.drafters") and not m.startswith("specjax.core.drafter")]
    assert not bad, bad


def test_shared_layers_import_no_model_or_drafter():
    """specjax/models/layers.py is the one decoder layer under the target and the drafters: it
    imports neither of them."""
    bad = [m for m in _imports(os.path.join(ROOT, "specjax", "models", "layers.py"))
           if m.startswith(("specjax.models.model", "specjax.drafters"))]
    assert not bad, bad
