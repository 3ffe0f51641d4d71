"""Code-completion prompts cut from corpus source files: the `def` sites worth asking for
(`def_sites`) and the prompt text of one (`prompt_text`).

Shared by the bundled held-out prompts (`specjax.decoding.prompts.held_out_prompts`,
VALIDATION files) and the regenerated training data (`specjax.data.regenerate`,
TRAINING files), which differ only in the files they read and how many sites they take.
"""

from __future__ import annotations

import re

_DEF = re.compile(r"^(\s*)(async\s+)?def\s+\w+\s*\(")


def def_sites(lines: list[str]) -> list[tuple[int, int]]:
    """[(def line index, index of the first body line after an optional docstring)] of
    the top-level or method `def`s of `lines` whose function body is at least 4 lines."""
    out = []
    for i, line in enumerate(lines):
        m = _DEF.match(line)
        if not m:
            continue
        indent = len(m.group(1))
        j = i
        while j < len(lines) and not lines[j].rstrip().endswith(":"):  # multi-line signature
            j += 1
        j += 1
        body_start = j
        if j < len(lines) and lines[j].strip().startswith(('"""', "'''")):
            quote = lines[j].strip()[:3]
            k = j if lines[j].strip().count(quote) >= 2 and len(lines[j].strip()) > 3 else j + 1
            while k < len(lines) and quote not in lines[k]:
                k += 1
            body_start = k + 1
        body = 0
        while (body_start + body < len(lines)
               and (not lines[body_start + body].strip()
                    or len(lines[body_start + body]) - len(lines[body_start + body].lstrip())
                    > indent)):
            body += 1
        if body >= 4:
            out.append((i, body_start))
    return out


def prompt_text(lines: list[str], i: int, body_start: int, context_lines: int,
                max_chars: int) -> str:
    """The prompt for the `def` at line i: at most `context_lines` lines before it through
    its docstring (lines[:body_start]), trimmed from the front at line boundaries to
    `max_chars` characters (a longer single line is kept whole)."""
    text = "".join(lines[max(0, i - context_lines):body_start])
    while len(text) > max_chars and "\n" in text:
        text = text[text.index("\n") + 1:]
    return text
