"""Writing what a benchmark measured: results JSON (atomically), the marked sections of
the documents that quote it, and number formatting for its tables."""

from __future__ import annotations

import json
import math
import os


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    """`x` formatted, "-" for None or a non-finite float."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec) + suffix


def write_json(path: str, obj, indent: int = 1) -> None:
    """`obj` as JSON (with a final newline) at `path`, atomically; the directory is
    created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
    os.replace(path + ".tmp", path)


def replace_doc_section(doc: str, tag: str, body: str, heading: str = "") -> None:
    """Replaces the text between `<!-- tag -->` and `<!-- /tag -->` in the markdown file
    `doc` with `body` (the section is appended, after `heading` for a new file, where
    it is missing); written atomically."""
    begin, end = f"<!-- {tag} -->", f"<!-- /{tag} -->"
    text = open(doc).read() if os.path.exists(doc) else heading
    block = f"{begin}\n{body}{end}"
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc + ".tmp", "w") as f:
        f.write(text)
    os.replace(doc + ".tmp", doc)


def save_results(path: str, res: dict, committed: str, write_doc) -> None:
    """Writes the results record `res` to `path` as JSON (atomically); when `path` is the
    committed results file `committed`, `write_doc(res)` brings the doc's table along."""
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    if os.path.abspath(path) == committed:  # the committed figures: the doc follows
        write_doc(res)
