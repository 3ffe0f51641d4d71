"""The package's layering (issue 28): decoding never imports training code.

Read from the source with `ast` (every import statement, those inside functions too), so
the test sees lazy imports that an import-time check of sys.modules would miss."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Everything `python decode.py` can run: the library outside specjax/train (and the corpus,
# packing and regeneration of specjax/data/, and the command line of the training curves,
# specjax/tools/plot.py), the kernels.
TRAINING = ("specjax/train/", "specjax/plan.py", "specjax/testing/", "specjax/data/",
            "specjax/tools/plot.py")


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


def test_the_loop_imports_no_drafter_implementation():
    """The loop (specjax/decoding/loop/ and the adaptive schedule's branches) reaches drafters
    through the protocol of specjax/core/drafter.py only; the kernel choice comes from
    specjax/decoding/kernel_policy.py, passed explicitly (issues 28, 51)."""
    files = [f for f, _ in _package_imports("decoding/loop")] + [
        "specjax/decoding/adaptive/loop.py"]
    assert "specjax/decoding/loop/step.py" in files
    bad = [(f, m) for f in files for m in _imports(os.path.join(ROOT, f))
           if m.startswith("specjax.drafters")]
    assert not bad, bad


def test_shared_layers_import_no_model_or_drafter():
    """specjax/models/layers.py is the one decoder layer under the target and the drafters: it
    imports neither of them."""
    bad = [m for m in _imports(os.path.join(ROOT, "specjax", "models", "layers.py"))
           if m.startswith(("specjax.models.model", "specjax.drafters"))]
    assert not bad, bad


# The command-line tools (issue 51): every `main` lives in specjax/tools/, above the library;
# a library module reaches its tool only from its `if __name__ == "__main__":` block (the
# documented `python -m specjax.X` paths).

def _library_files():
    for dirpath, _, names in os.walk(os.path.join(ROOT, "specjax")):
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if name.endswith(".py") and not rel.startswith("specjax/tools/"):
                yield path


def _top_level_mains(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    return [n.lineno for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "main"]


def _is_main_guard(node):
    """`if __name__ == "__main__":`"""
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
            and t.left.id == "__name__" and len(t.comparators) == 1
            and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")


def _tool_imports_outside_main_guard(path):
    """Imports of specjax.tools outside the module's top-level `__main__` block."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    guarded = {id(n) for top in tree.body if _is_main_guard(top) for n in ast.walk(top)}
    bad = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        bad += [m for m in names if m == "specjax.tools" or m.startswith("specjax.tools.")]
    return bad


def test_no_library_module_defines_main():
    bad = [(os.path.relpath(p, ROOT), line) for p in _library_files()
           for line in _top_level_mains(p)]
    assert not bad, f"command-line entry points belong in specjax/tools/: {bad}"


def test_library_reaches_tools_only_from_its_main_block():
    bad = [(os.path.relpath(p, ROOT), m) for p in _library_files()
           for m in _tool_imports_outside_main_guard(p)]
    assert not bad, bad


def test_every_tool_has_a_main():
    tools = os.path.join(ROOT, "specjax", "tools")
    names = sorted(n for n in os.listdir(tools) if n.endswith(".py") and n != "__init__.py")
    assert names and all(_top_level_mains(os.path.join(tools, n)) for n in names), names


def test_the_main_scans_can_fail(tmp_path):
    """A top-level `def main` is found (a nested one, or a method, is not), and so is a
    tool import outside the `__main__` block."""
    f = tmp_path / "m.py"
    f.write_text("def helper():\n    def main():\n        pass\n\n\n"
                 "class C:\n    def main(self):\n        pass\n\n\n"
                 "def main(argv=None):\n    return 0\n")
    assert _top_level_mains(str(f)) == [11]
    g = tmp_path / "g.py"
    g.write_text("import sys\n\n\ndef f():\n    from specjax.tools.plan import main\n\n\n"
                 "if __name__ == '__main__':\n    from specjax.tools.prepare import main\n\n"
                 "    sys.exit(main())\n")
    assert _tool_imports_outside_main_guard(str(g)) == ["specjax.tools.plan",
                                                        "specjax.tools.plan.main"]
