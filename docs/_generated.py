"""What the generators of docs/ share: the marked blocks they write inside a hand-written page, a table
cell, and the main that rewrites a page or, with ``--check``, says how it differs from its source.

A generated block sits between two markers, and the page's prose around it is never touched:

    <!-- WHAT: written by docs/SCRIPT from SOURCE -->
    ...
    <!-- end of WHAT -->
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from pathlib import Path


def markers(what: str, script: str, source: str) -> tuple[str, str]:
    """The lines that open and close the block ``what`` that ``script`` writes from ``source``."""
    return f"<!-- {what}: written by docs/{script} from {source} -->", f"<!-- end of {what} -->"


def fill(page: str, blocks: dict[str, str], script: str, source: str, name: str) -> str:
    """``page`` with the text inside each block ``what`` replaced by ``blocks[what]``. A block of
    ``blocks`` the page lacks, or a block of ``script`` in the page that ``blocks`` does not name (a
    command or a section since removed), is an error that names it."""
    found = re.findall(rf"^<!-- (.+?): written by docs/{re.escape(script)} from ", page, flags=re.M)
    if unknown := [what for what in found if what not in blocks]:
        raise SystemExit(f"{name} has blocks {script} does not write: {', '.join(unknown)}; remove their markers")
    for what, body in blocks.items():
        begin, end = markers(what, script, source)
        head, opened, rest = page.partition(begin)
        _, closed, tail = rest.partition(end)
        if not opened or not closed:
            raise SystemExit(f"{name} lacks the markers {begin} and {end}: add them where {what} belongs")
        page = f"{head}{begin}\n{body}{end}{tail}"
    return page


def cell(text: str) -> str:
    """``text`` as one cell of a Markdown table: one line, its pipes escaped, and outside code spans a
    ``<`` that would open an HTML tag (``runs/<name>``, which GitHub would drop) written as ``&lt;``."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else re.sub(r"<(?=[A-Za-z/!?])", "&lt;", part) for i, part in enumerate(parts))


def check_main(
    argv: list[str] | None, doc: str, page: Path, render: Callable[[str], str], source: str, script: str
) -> int:
    """A generator's main: write ``render(page's text)`` to ``page``; with ``--check``, write nothing and
    exit 1 with a diff when the page differs from it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help=f"exit 1 when the page differs from {source}")
    args = parser.parse_args(argv)
    current = page.read_text() if page.exists() else ""
    text = render(current)
    if not args.check:
        page.write_text(text)
        return 0
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(page), source)
    sys.stderr.writelines(diff)
    sys.stderr.write(f"{page.name} differs from {source}: run .venv/bin/python docs/{script}\n")
    return 1
