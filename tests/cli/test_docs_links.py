"""The documents point at files that exist: every relative markdown link and every
`configs/...yaml`, `benchmarks/...py` and `docs/...md` path named in README.md,
docs/*.md and configs/README.md. Fast, no jax."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = sorted(["README.md", "configs/README.md",
               *(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))])
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:configs/[\w./-]+?\.yaml)|(?:benchmarks/[\w./-]+?\.py)"
                  r"|(?:docs/[\w./-]+?\.md))(?![\w-])")
# paths a document names as what a command writes or takes, not as files in the repository
PLACEHOLDERS = ("<", "*", "NAME", "{")


def _links(text: str) -> list[str]:
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, in-page anchors
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_exist(doc):
    text = open(os.path.join(ROOT, doc)).read()
    base = os.path.dirname(os.path.join(ROOT, doc))
    missing = [t for t in _links(text) if t and not os.path.exists(os.path.join(base, t))]
    assert not missing, f"{doc}: links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_exist(doc):
    text = open(os.path.join(ROOT, doc)).read()
    base = os.path.dirname(os.path.join(ROOT, doc))
    missing = []
    for path in sorted(set(PATH.findall(text))):
        if any(p in path for p in PLACEHOLDERS):
            continue
        # a path is relative to the repository root, or (configs/README.md) to the document
        if not (os.path.exists(os.path.join(ROOT, path)) or os.path.exists(os.path.join(base, path))):
            missing.append(path)
    assert not missing, f"{doc}: names missing files: {missing}"


def test_the_documents_are_found():
    assert {"README.md", "docs/decode.md", "docs/train.md", "docs/benchmarks.md",
            "docs/kernels.md", "docs/design.md", "docs/kvshot.md"} <= set(DOCS)


def test_the_checker_catches_a_missing_file(tmp_path):
    text = "see [x](nope.md) and `configs/drafters/nope.yaml`"
    assert _links(text) == ["nope.md"]
    assert PATH.findall(text) == ["configs/drafters/nope.yaml"]


def test_configs_readme_lists_every_config_and_only_those():
    text = open(os.path.join(ROOT, "configs", "README.md")).read()
    named = set(re.findall(r"`([\w/]+\.yaml)`", text))
    on_disk = {os.path.relpath(p, os.path.join(ROOT, "configs")) for p in
               glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)}
    assert on_disk - named == set(), f"configs not listed in configs/README.md: {on_disk - named}"
    assert named - on_disk == set(), f"configs/README.md names missing files: {named - on_disk}"
