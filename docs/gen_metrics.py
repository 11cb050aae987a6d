"""Write the metric tables of docs/metrics.md from the metric catalogue (rlctl/policies/catalogue.py):
the keys of every row, then one table per section of the catalogue, each key with its meaning, around the
page's hand-written prose.

    .venv/bin/python docs/gen_metrics.py           # rewrite the tables of the page
    .venv/bin/python docs/gen_metrics.py --check   # exit 1 if the page differs from the catalogue

The tables between the page's markers are never edited by hand: change a meaning in the catalogue (the
one `rlctl policy check` tells) and run this again.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _generated import cell, check_main, fill

from rlctl.policies.catalogue import ROW_KEYS, SECTIONS

PAGE = Path(__file__).resolve().parent / "metrics.md"
SCRIPT, SOURCE = "gen_metrics.py", "rlctl/policies/catalogue.py"


def table(keys: dict[str, str]) -> str:
    """A block's table, between blank lines (so that the markers around it end no table)."""
    rows = [f"| `{key}` | {cell(meaning)} |" for key, meaning in keys.items()]
    return "\n".join(["", "| key | meaning |", "|---|---|", *rows, ""]) + "\n"


def render(page: str) -> str:
    """``page`` with each table written from the catalogue: ``the keys of every row``, then one block
    per section, named as the catalogue names it."""
    blocks = {"the keys of every row": table(ROW_KEYS)} | {title: table(keys) for title, keys in SECTIONS.items()}
    return fill(page, blocks, SCRIPT, SOURCE, PAGE.name)


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, __doc__, PAGE, render, "the catalogue", SCRIPT)


if __name__ == "__main__":
    sys.exit(main())
