"""Reading the policy expression language: a small recursive-descent parser (never Python's ``eval`` or
``ast``) that turns a rule's ``when:`` text into the tree of ``rlctl.policies.expr``.

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
need spaces (``a / b``; ``a/b`` is one metric). Numbers: ``10``, ``0.5``, ``.5``, ``1e-3``. Every number
is finite: ``nan``, ``inf`` and ``infinity`` (any case) are neither metrics nor numbers, and a part without
metrics that comes to NaN or an infinity (``1 / 0``, ``1e308 * 10``) is an error where it starts; a limit
that could never be crossed would make a rule that never fires (NaN and Inf are the nonfinite trigger's).

Mistakes are ValueErrors naming the column, with the text and a caret under the spot; so is nesting
deeper than MAX_DEPTH (64) levels of parentheses, calls, ``not``, ``-`` or operators (the parser and the
tree recurse: far deeper would overflow Python's stack at policy load).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from rlctl.policies.expr import COMPARISONS, FUNCTIONS, Binary, Call, Expression, Metric, Negate, Node, Not, Number
from rlctl.yamlsrc import did_you_mean

KEYWORDS = ("and", "or", "not")
NONFINITE_WORDS = ("nan", "inf", "infinity")  # in any case: what a person writes for NaN and Inf
NOT_FINITE = "a limit must be a finite number (a NaN or Inf metric is what a rule of kind: nonfinite watches)"
MAX_DEPTH = 64  # levels of parentheses, calls, 'not', '-' and operators: deeper would exhaust Python's stack
TOO_DEEP = f"expression nested too deeply (more than {MAX_DEPTH} levels of parentheses, calls, 'not', '-' or operators)"


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
        """``node``, made by the operator at ``col``, unless its tree is deeper than MAX_DEPTH, or it is
        a number without metrics that is NaN or an infinity (``1 / 0``)."""
        if node.height > MAX_DEPTH:
            self.fail(col, TOO_DEEP)
        if not node.boolean and not node.metrics() and not math.isfinite(node.evaluate({})):  # type: ignore[arg-type]
            self.fail(node.col, f"'{node.describe()}' comes to {node.evaluate({})}; {NOT_FINITE}")
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
        if token.kind == "name" and token.text.lower() in NONFINITE_WORDS:
            self.fail(token.col, f"'{token.text}' is not a metric, and {NOT_FINITE}")
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
