"""Markdown tables and the marked sections of README files that are generated, not edited."""

from __future__ import annotations

import math
from pathlib import Path


def gib(x) -> str:
    return "–" if x is None else f"{x / 2**30:.1f}"


def num(x, fmt) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def markdown_table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def update_readme(path: Path, section: str, begin: str, end: str) -> None:
    """Replace what is between the markers `begin` and `end` in `path` by `section` (the markers and
    section appended at the end if absent)."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    text = replace_section(text, section, begin, end)
    path.write_text(text)


def replace_section(text: str, section: str, begin: str, end: str) -> str:
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    return text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
