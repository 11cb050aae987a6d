"""Write the run directory's tree into docs/concepts.md from rlctl/rundir/layout.py, which names every
file of a run and says what it holds.

    .venv/bin/python docs/gen_run_dir.py           # rewrite the tree in the page
    .venv/bin/python docs/gen_run_dir.py --check   # exit 1 if the page's tree differs from the layout

The tree between the page's two markers is never edited by hand: change ``TREE`` in the layout and run
this again.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from rlctl.rundir.layout import tree

PAGE = Path(__file__).resolve().parent / "concepts.md"
BEGIN = "<!-- the run directory: written by docs/gen_run_dir.py from rlctl/rundir/layout.py -->"
END = "<!-- end of the run directory -->"


def render(page: str) -> str:
    """``page`` with the text between its markers replaced by the layout's tree."""
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{PAGE.name} lacks the markers {BEGIN} and {END}")
    return f"{head}{BEGIN}\n```\n{tree()}```\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page's tree differs from the layout")
    args = parser.parse_args(argv)
    current = PAGE.read_text()
    text = render(current)
    if not args.check:
        PAGE.write_text(text)
        return 0
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(PAGE), "the layout")
    sys.stderr.writelines(diff)
    sys.stderr.write(f"{PAGE.name}'s run directory differs from the layout: run .venv/bin/python docs/gen_run_dir.py\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
