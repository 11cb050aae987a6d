"""GSM8K-style exact match: the final number of the completion against the answer's.

The answer column may be a bare number or GSM8K's worked solution ending in ``#### 42``. The
completion's final number is the one after its last ``####`` if there is one, else its last number
(verl's "flexible" extraction). Commas and a trailing period are ignored; 1.0 on a numeric match, else
``format_score`` if a number was found at all, else 0.0.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_final_number(text: str) -> str | None:
    if "####" in text:
        text = text.rsplit("####", 1)[1]
        found = _NUMBER.findall(text)
        return _normalise(found[0]) if found else None
    found = _NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def _normalise(num: str) -> str:
    num = num.replace(",", "").rstrip(".")
    try:
        value = float(num)
    except ValueError:
        return num
    return str(int(value)) if value.is_integer() else repr(value)


def exact_match(
    prompts: list[str], completions: list[str], answer: list[str], format_score: float = 0.0, **_
) -> list[float]:
    scores = []
    for completion, ans in zip(completions, answer):
        want = extract_final_number(str(ans))
        got = extract_final_number(completion)
        scores.append(1.0 if got is not None and got == want else (format_score if got is not None else 0.0))
    return scores
