"""Write the run directory's tree into docs/concepts.md from rlctl/rundir/layout.py, which names every
file of a run and says what it holds.

    .venv/bin/python docs/gen_run_dir.py           # rewrite the tree in the page
    .venv/bin/python docs/gen_run_dir.py --check   # exit 1 if the page's tree differs from the layout

The tree between the page's two markers is never edited by hand: change ``TREE`` in the layout and run
this again.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _generated import check_main, fill, markers

from rlctl.rundir.layout import tree

PAGE = Path(__file__).resolve().parent / "concepts.md"
WHAT, SCRIPT, SOURCE = "the run directory", "gen_run_dir.py", "rlctl/rundir/layout.py"
BEGIN, END = markers(WHAT, SCRIPT, SOURCE)


def render(page: str) -> str:
    """``page`` with the text between its markers replaced by the layout's tree."""
    return fill(page, {WHAT: f"```\n{tree()}```\n"}, SCRIPT, SOURCE, PAGE.name)


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, __doc__, PAGE, render, "the layout", SCRIPT)


if __name__ == "__main__":
    sys.exit(main())
