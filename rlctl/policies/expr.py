"""The policy expression language: what a rule's ``when:`` may say about a step's metrics.

``actor/reward_kl_penalty / abs(actor/pg_loss) > 0.2``, ``actor/entropy < 0.05 and response/degenerate_frac > 0.5``.
A small recursive-descent parser (never Python's ``eval`` or ``ast``) turns the text into a tree that can
evaluate itself on a metrics row, list the metrics it reads and write itself back as canonical text.

Grammar, loosest first::

    expr       := or
    or         := and ('or' and)*
    and        := not ('and' not)*
    not        := 'not' not | comparison
    comparison := sum [('>' | '>=' | '<' | '<=' | '==' | '!=') sum]      (no chains: a < b < c is an error)
    sum        := product (('+' | '-') product)*
    product    := unary (('*' | '/') unary)*
    unary      := '-' unary | atom
    atom       := NUMBER | METRIC | ('abs' | 'min' | 'max') '(' sum (',' sum)* ')' | '(' expr ')'

A metric is a run of ``[A-Za-z0-9_./@:-]`` starting with a letter, so ``/`` and ``-`` between two metrics
need spaces (``a / b``; ``a/b`` is one metric). Numbers: ``10``, ``0.5``, ``.5``, ``1e-3``.

Evaluation: a row missing a metric the expression reads (or holding something that is not a number) is
no observation at all (``evaluate`` answers None); a comparison that meets NaN makes the whole expression
not hold (NaN is the nonfinite trigger's job); ``x / 0`` is an infinity of x's sign, ``0 / 0`` NaN.
Mistakes are ValueErrors naming the column, with the text and a caret under the spot; so is nesting
deeper than MAX_DEPTH (64) levels of parentheses, calls, ``not``, ``-`` or operators (the parser and the
tree recurse: far deeper would overflow Python's stack at policy load).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from rlctl.yamlsrc import did_you_mean

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
KEYWORDS = ("and", "or", "not")
MAX_DEPTH = 64  # levels of parentheses, calls, 'not', '-' and operators: deeper would exhaust Python's stack
TOO_DEEP = f"expression nested too deeply (more than {MAX_DEPTH} levels of parentheses, calls, 'not', '-' or operators)"


@dataclass(frozen=True)
class Node:
    """A piece of an expression; ``col`` is where it starts in the text (1-based)."""

    col: int

    boolean = False  # a comparison or a logical combination of them; else a number
    strength = ATOM
    height = 1  # levels of the tree from here down (the parser bounds it by MAX_DEPTH)

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


@lru_cache(maxsize=1024)
def parse_expression(text: str) -> Expression:
    """Parse a ``when`` expression; ValueError with the column and a caret line when it is malformed,
    does not compare (a bare number is no condition) or reads no metric."""
    parser = _Parser(text)
    root = parser.parse()
    if not root.boolean:
        parser.fail(1, "a 'when' expression must compare, e.g. 'actor/ppo_kl > 0.2', but this one is a number")
    if not root.metrics():
        parser.fail(1, "the expression reads no metric, so it would always or never hold")
    return Expression(text, root)


# --------------------------------------------------------------------------------------------------
# Tokens and the parser

_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<name>[A-Za-z][A-Za-z0-9_./@:-]*)"
    r"|(?P<op>>=|<=|==|!=|[-+*/()<>,]))"
)
_MISTAKES = {
    "=": "; did you mean '=='?",
    "!": "; did you mean 'not'?",
    "&": "; did you mean 'and'?",
    "|": "; did you mean 'or'?",
    "^": "; there is no power operator: multiply",
}


@dataclass(frozen=True)
class Token:
    kind: str  # number, name, op, end
    text: str
    col: int

    def shown(self) -> str:
        return "the end" if self.kind == "end" else f"'{self.text}'"


def tokenize(text: str) -> list[Token]:
    """The tokens of ``text`` and a final ``end``; ValueError at the first character that starts none."""
    tokens, pos = [], 0
    while True:
        match = _TOKEN.match(text, pos)
        if match is None or match.lastgroup is None:
            rest = len(text) - len(text[pos:].lstrip())
            if rest == len(text):
                return [*tokens, Token("end", "", len(text) + 1)]
            char = text[rest]
            raise ValueError(_located(text, rest + 1, f"unexpected character '{char}'{_MISTAKES.get(char, '')}"))
        kind, start = match.lastgroup, match.start(match.lastgroup)
        if kind == "number" and re.match(r"[A-Za-z0-9_.]", text[match.end() :]):
            end = re.match(r"[A-Za-z0-9_.+-]*", text[start:])
            raise ValueError(_located(text, start + 1, f"'{end[0] if end else ''}' is not a number"))
        tokens.append(Token(kind, match[kind], start + 1))
        pos = match.end()


def _located(text: str, col: int, message: str) -> str:
    """'at column N: MESSAGE', then the text and a caret under column N."""
    return f"at column {col}: {message}\n    {text}\n    {' ' * (col - 1)}^ here"


class _Parser:
    """Recursive descent over the tokens, one method per level of the grammar."""

    def __init__(self, text: str):
        self.text = text
        self.tokens = tokenize(text)
        self.pos = 0
        self.depth = 0  # how many parentheses, calls, 'not's and '-'s the parser is inside

    @contextmanager
    def nested(self, col: int) -> Iterator[None]:
        """One level deeper (a '(', a call, a 'not' or a '-' at ``col``); a ValueError past MAX_DEPTH."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(col, TOO_DEEP)
        try:
            yield
        finally:
            self.depth -= 1

    def built(self, node: Node, col: int) -> Node:
        """``node``, made by the operator at ``col``, unless its tree is deeper than MAX_DEPTH."""
        if node.height > MAX_DEPTH:
            self.fail(col, TOO_DEEP)
        return node

    @property
    def token(self) -> Token:
        return self.tokens[self.pos]

    def fail(self, col: int, message: str) -> None:
        raise ValueError(_located(self.text, col, message))

    def take(self, *texts: str) -> Token | None:
        """The current token, consumed, when it is one of ``texts`` (an operator or keyword)."""
        token = self.token
        if token.kind in ("op", "name") and token.text in texts:
            self.pos += 1
            return token
        return None

    def expect(self, text: str) -> None:
        if self.take(text) is None:
            self.fail(self.token.col, f"expected '{text}' but found {self.token.shown()}")

    def parse(self) -> Node:
        node = self.logic(0)
        token = self.token
        if token.kind != "end":
            hint = ""
            if token.text.lower() in KEYWORDS:
                hint = f"; operators are lowercase: '{token.text.lower()}'"
            self.fail(token.col, f"expected an operator, 'and', 'or' or the end but found {token.shown()}{hint}")
        return node

    def logic(self, level: int) -> Node:
        """``or`` (level 0) over ``and`` (level 1) over ``not`` and comparisons."""
        if level == 2:
            return self.negation()
        word = ("or", "and")[level]
        node = self.logic(level + 1)
        while (token := self.take(word)) is not None:
            right = self.logic(level + 1)
            for side in (node, right):
                self.need(side, True, f"'{word}' joins comparisons")
            node = self.built(Binary(node.col, word, node, right), token.col)
        return node

    def negation(self) -> Node:
        token = self.take("not")
        if token is None:
            return self.comparison()
        with self.nested(token.col):
            operand = self.negation()
        self.need(operand, True, "'not' takes a comparison")
        return self.built(Not(token.col, operand), token.col)

    def comparison(self) -> Node:
        left = self.arithmetic(0)
        token = self.take(*COMPARISONS)
        if token is None:
            return left
        right = self.arithmetic(0)
        for side in (left, right):
            self.need(side, False, f"'{token.text}' compares numbers")
        chained = self.take(*COMPARISONS)
        if chained is not None:
            a, b, c = left.describe(), right.describe(), self.arithmetic(0).describe()
            self.fail(chained.col, f"comparisons do not chain; write '{a} {token.text} {b} and {b} {chained.text} {c}'")
        return self.built(Binary(left.col, token.text, left, right), token.col)

    def arithmetic(self, level: int) -> Node:
        """Sums (level 0) of products (level 1) of signed atoms."""
        if level == 2:
            return self.unary()
        ops = (("+", "-"), ("*", "/"))[level]
        node = self.arithmetic(level + 1)
        while (token := self.take(*ops)) is not None:
            right = self.arithmetic(level + 1)
            for side in (node, right):
                self.need(side, False, f"'{token.text}' works on numbers")
            node = self.built(Binary(node.col, token.text, node, right), token.col)
        return node

    def unary(self) -> Node:
        token = self.take("-")
        if token is None:
            return self.atom()
        with self.nested(token.col):
            operand = self.unary()
        self.need(operand, False, "'-' works on numbers")
        return self.built(Negate(token.col, operand), token.col)

    def atom(self) -> Node:
        token = self.token
        if token.kind == "number":
            self.pos += 1
            value = float(token.text)
            if math.isinf(value):
                self.fail(token.col, f"{token.text} is too large a number")
            return Number(token.col, value)
        if token.kind == "name" and token.text not in KEYWORDS:
            self.pos += 1
            if self.token.text == "(":
                return self.call(token)
            return Metric(token.col, token.text)
        if self.take("(") is not None:
            with self.nested(token.col):
                node = self.logic(0)
            self.expect(")")
            return node
        self.fail(token.col, f"expected a number, a metric or '(' but found {token.shown()}")
        raise AssertionError  # fail always raises

    def call(self, name: Token) -> Node:
        if name.text not in FUNCTIONS:
            names = ", ".join(FUNCTIONS)
            self.fail(name.col, f"unknown function '{name.text}' (one of {names}){did_you_mean(name.text, FUNCTIONS)}")
        self.expect("(")
        with self.nested(name.col):
            args = [self.arithmetic(0)]
            while self.take(",") is not None:
                args.append(self.arithmetic(0))
        self.expect(")")
        for arg in args:
            self.need(arg, False, f"{name.text}() works on numbers")
        if FUNCTIONS[name.text][1] == 1 and len(args) > 1:
            self.fail(args[1].col, f"{name.text}() takes one argument")
        if len(args) < FUNCTIONS[name.text][1]:
            self.fail(name.col, f"{name.text}() takes at least two arguments")
        return self.built(Call(name.col, name.text, tuple(args)), name.col)

    def need(self, node: Node, boolean: bool, why: str) -> None:
        """A ValueError at ``node`` unless it is a condition (``boolean``) or a number as ``why`` needs."""
        if node.boolean == boolean:
            return
        text = node.describe()
        found = f"'{text}' is a number (compare it, e.g. '{text} > 0')" if boolean else f"'{text}' is a condition"
        self.fail(node.col, f"{why}, but {found}")
