"""The policy expression language's tree: what a rule's ``when:`` says about a step's metrics, able to
evaluate itself on a metrics row, list the metrics it reads and write itself back as canonical text
(``expr_parser`` reads the text into it).

``actor/reward_kl_penalty / abs(actor/pg_loss) > 0.2``, ``actor/entropy < 0.05 and response/degenerate_frac > 0.5``.

Evaluation: a row missing a metric the expression reads (or holding something that is not a number) is
no observation at all (``evaluate`` answers None); a comparison that meets NaN makes the whole expression
not hold (NaN is the nonfinite trigger's job); ``x / 0`` is an infinity of x's sign, ``0 / 0`` NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

_NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def as_number(value: Any) -> float | None:
    """A metric value as a float: ints, floats and the strings "NaN"/"Infinity"/"-Infinity"; None for
    anything else (bools, other strings, lists, missing)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _NONFINITE_STRINGS.get(value)
    return None


def format_number(value: float) -> str:
    """A number as a person writes it (0.05, 1e-06, 10), exact: parsing it back gives the same float."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


# --------------------------------------------------------------------------------------------------
# The tree: each node evaluates itself on a mapping of metric -> float

# binding strength, for writing parentheses back only where they are needed
OR, AND, NOT, COMPARE, SUM, PRODUCT, UNARY, ATOM = range(1, 9)
Value = float | bool | None  # None: a comparison met NaN, so it neither holds nor fails


def _divide(a: float, b: float) -> float:
    """a / b, where x / 0 is an infinity with the sign of x times that of the zero, and 0 / 0 is NaN."""
    if b != 0:
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _extreme(pick: Callable[..., float]) -> Callable[..., float]:
    """min or max that answers NaN when any argument is NaN (Python's own depend on the order)."""
    return lambda *xs: math.nan if any(math.isnan(x) for x in xs) else pick(xs)


ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _divide,
}
COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
FUNCTIONS: dict[str, tuple[Callable[..., float], int]] = {  # name -> (function, fewest arguments)
    "abs": (abs, 1),
    "min": (_extreme(min), 2),
    "max": (_extreme(max), 2),
}


@dataclass(frozen=True)
class Node:
    """A piece of an expression; ``col`` is where it starts in the text (1-based)."""

    col: int

    boolean = False  # a comparison or a logical combination of them; else a number
    strength = ATOM
    height = 1  # levels of the tree from here down (the parser bounds it)

    def evaluate(self, values: Mapping[str, float]) -> Value:
        raise NotImplementedError

    def metrics(self) -> list[str]:
        """The metric names this node reads, in order of first appearance."""
        return []

    def describe(self) -> str:
        raise NotImplementedError

    def wrapped(self, weaker_than: int) -> str:
        """``describe()``, in parentheses when this node binds less tightly than ``weaker_than`` asks."""
        text = self.describe()
        return f"({text})" if self.strength < weaker_than else text


@dataclass(frozen=True)
class Number(Node):
    value: float

    def evaluate(self, values: Mapping[str, float]) -> Value:
        return self.value

    def describe(self) -> str:
        return format_number(self.value)


@dataclass(frozen=True)
class Metric(Node):
    name: str

    def evaluate(self, values: Mapping[str, float]) -> Value:
        return values[self.name]

    def metrics(self) -> list[str]:
        return [self.name]

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class Negate(Node):
    operand: Node
    strength = UNARY

    @cached_property
    def height(self) -> int:  # type: ignore[override]
        return self.operand.height + 1

    def evaluate(self, values: Mapping[str, float]) -> Value:
        return -self.operand.evaluate(values)  # type: ignore[operator]

    def metrics(self) -> list[str]:
        return self.operand.metrics()

    def describe(self) -> str:
        return "-" + self.operand.wrapped(UNARY)


@dataclass(frozen=True)
class Call(Node):
    function: str
    args: tuple[Node, ...]

    @cached_property
    def height(self) -> int:  # type: ignore[override]
        return max(a.height for a in self.args) + 1

    def evaluate(self, values: Mapping[str, float]) -> Value:
        return FUNCTIONS[self.function][0](*(a.evaluate(values) for a in self.args))

    def metrics(self) -> list[str]:
        return _union(self.args)

    def describe(self) -> str:
        return f"{self.function}({', '.join(a.describe() for a in self.args)})"


@dataclass(frozen=True)
class Binary(Node):
    """Arithmetic (+ - * /), a comparison, or and / or: ``left OP right``."""

    op: str
    left: Node
    right: Node

    @cached_property
    def height(self) -> int:  # type: ignore[override]
        return max(self.left.height, self.right.height) + 1

    @property
    def boolean(self) -> bool:  # type: ignore[override]
        return self.op not in ARITHMETIC

    @property
    def strength(self) -> int:  # type: ignore[override]
        if self.op in COMPARISONS:
            return COMPARE
        return {"or": OR, "and": AND, "+": SUM, "-": SUM, "*": PRODUCT, "/": PRODUCT}[self.op]

    def evaluate(self, values: Mapping[str, float]) -> Value:
        a, b = self.left.evaluate(values), self.right.evaluate(values)
        if self.op in ARITHMETIC:
            return ARITHMETIC[self.op](a, b)  # type: ignore[arg-type]
        if self.op in COMPARISONS:
            return None if math.isnan(a) or math.isnan(b) else COMPARISONS[self.op](a, b)  # type: ignore[arg-type]
        if a is None or b is None:
            return None
        return (a and b) if self.op == "and" else (a or b)

    def metrics(self) -> list[str]:
        return _union((self.left, self.right))

    def describe(self) -> str:
        # the parser groups to the left, so a right operand as strong as this node was in parentheses
        return f"{self.left.wrapped(self.strength)} {self.op} {self.right.wrapped(self.strength + 1)}"


@dataclass(frozen=True)
class Not(Node):
    operand: Node
    boolean = True
    strength = NOT

    @cached_property
    def height(self) -> int:  # type: ignore[override]
        return self.operand.height + 1

    def evaluate(self, values: Mapping[str, float]) -> Value:
        held = self.operand.evaluate(values)
        return None if held is None else not held

    def metrics(self) -> list[str]:
        return self.operand.metrics()

    def describe(self) -> str:
        return "not " + self.operand.wrapped(NOT)


def _union(nodes: tuple[Node, ...]) -> list[str]:
    return list(dict.fromkeys(m for n in nodes for m in n.metrics()))


# --------------------------------------------------------------------------------------------------
# The whole expression


@dataclass(frozen=True)
class Reading:
    """What an expression saw on one row: whether it held, and for a comparison at the top the values
    of its two sides (``value`` the left, ``limit`` the right); None for a combination of comparisons."""

    held: bool
    value: float | None = None
    limit: float | None = None


@dataclass(frozen=True)
class Expression:
    """A parsed ``when`` expression: the text as written and its tree."""

    text: str
    root: Node

    def metrics(self) -> list[str]:
        """The metric names it reads, in order of first appearance."""
        return self.root.metrics()

    def describe(self) -> str:
        """The canonical text: single spaces around operators, parentheses only where needed."""
        return self.root.describe()

    @property
    def subject(self) -> str:
        """What an event names as the metric: the left side of a comparison at the top, else the whole."""
        root = self.root
        return root.left.describe() if isinstance(root, Binary) and root.op in COMPARISONS else self.describe()

    def evaluate(self, row: Mapping[str, Any]) -> Reading | None:
        """The reading on ``row``; None when the row lacks a metric it reads (or holds a non-number there)."""
        values = {m: as_number(row.get(m)) for m in self.metrics()}
        if any(v is None for v in values.values()):
            return None
        root = self.root
        if isinstance(root, Binary) and root.op in COMPARISONS:
            left, right = root.left.evaluate(values), root.right.evaluate(values)  # type: ignore[arg-type]
            held = not (math.isnan(left) or math.isnan(right)) and COMPARISONS[root.op](left, right)  # type: ignore[arg-type]
            return Reading(held, left, right)  # type: ignore[arg-type]
        return Reading(root.evaluate(values) is True)  # type: ignore[arg-type]
