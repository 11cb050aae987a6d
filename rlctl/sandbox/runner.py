"""The program run inside the jail: its source text is passed to the jailed interpreter (``python -I -c``),
so it imports nothing of rlctl's and only the standard library.

It reads a job as JSON from the file descriptor its first argument names: ``{"cells": [code, ...],
"code": code, "chars": n}``. The earlier ``cells`` run first, silently (their output to /dev/null,
what they raise ignored), to rebuild the variables a stateful conversation had; then ``code`` runs with
the job's standard input and output. When the last statement of ``code`` is an expression, its value's
``repr`` is the call's value. The result goes to the file descriptor of its second argument as JSON: ``{"value": str | None,
"error": str | None, "limit": "memory" | None}``, the error a short traceback (the model's own frames
only, at most ``chars`` characters). ``random`` is seeded, so that cells run again draw the same numbers.
"""

import ast
import json
import os
import random
import sys
import traceback


def _split(code):
    """The code compiled as statements and, when it ends in an expression, that expression apart."""
    tree = ast.parse(code, "<cell>")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, "<cell>", "exec")
    return body, compile(last, "<cell>", "eval") if last is not None else None


def _short_traceback(exc, chars):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<cell>"]
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(frames[-3:])
    lines += traceback.format_exception_only(type(exc), exc)
    text = "".join(lines)
    return text if len(text) <= chars else "..." + text[-chars:]


def _silently(namespace, cell):
    """Run an earlier cell for its effect on the variables only."""
    out, err = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        body, last = _split(cell)
        exec(body, namespace)
        if last is not None:
            eval(last, namespace)
    except BaseException:
        pass
    finally:
        sys.stdout.flush()
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(null)


def main():
    with os.fdopen(int(sys.argv[1]), "r", encoding="utf-8") as f:
        job = json.load(f)
    answer = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")
    random.seed(0)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for cell in job.get("cells", []):
        _silently(namespace, cell)
    result = {"value": None, "error": None, "limit": None}
    try:
        body, last = _split(job["code"])
        exec(body, namespace)
        if last is not None:
            value = eval(last, namespace)
            if value is not None:
                result["value"] = repr(value)[: job.get("chars", 2000)]
    except MemoryError:
        result["limit"] = "memory"
    except SystemExit as exc:
        if exc.code not in (None, 0):
            result["error"] = f"SystemExit: {exc.code}"
    except BaseException as exc:
        result["error"] = _short_traceback(exc, job.get("chars", 2000))
    sys.stdout.flush()
    sys.stderr.flush()
    json.dump(result, answer)
    answer.close()


main()
