"""The one renderer of command output: rows as an aligned table, JSON, JSONL or CSV, on stdout.

Non-finite floats are spelled "NaN", "Infinity", "-Infinity" everywhere (JSON has none); nested values
are JSON in a table or CSV cell. Logs and warnings never come here: they go to stderr.
"""

from __future__ import annotations

import csv
import math
import sys
from typing import Any

import orjson

from rlctl.metrics import encode_row, encode_value

FORMATS = ["table", "json", "jsonl", "csv"]


def cell(value: Any) -> str:
    """One value as the text of a table or CSV cell."""
    if value is None:
        return ""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return orjson.dumps(value).decode()
    return str(encode_value(value))


def emit(columns: list[str], rows: list[dict[str, Any]], fmt: str, header: bool = True) -> None:
    """Rows in ``fmt`` (one of FORMATS) on stdout; ``header`` off continues a table or CSV."""
    out = sys.stdout
    if fmt == "json":
        out.write(orjson.dumps([encode_row(r) for r in rows], option=orjson.OPT_INDENT_2).decode() + "\n")
    elif fmt == "jsonl":
        for r in rows:
            out.write(orjson.dumps(encode_row(r)).decode() + "\n")
    elif fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        if header:
            writer.writerow(columns)
        writer.writerows([[cell(r.get(c)) for c in columns] for r in rows])
    else:
        _table(columns, rows, header, out)
    out.flush()


def emit_document(doc: Any, fmt: str) -> None:
    """One JSON document (a summary, a list of records): indented for json, one line for jsonl."""
    sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 if fmt == "json" else 0).decode() + "\n")
    sys.stdout.flush()


def _table(columns: list[str], rows: list[dict[str, Any]], header: bool, out) -> None:
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    if header:
        out.write("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")
