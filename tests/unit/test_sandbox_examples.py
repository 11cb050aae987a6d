"""The sandbox's ready-made examples: examples/gsm8k-python-gpu.yaml and examples/coding-gpu.yaml load
(every key of the schema), the maths one with the stateful python tool (its metrics found, the jail
started as the preflight does) and the agentic policy, and the coding example's problems score right:
a right solution of every problem, written here, passes all its tests under tests_passed with the
example's own reward kwargs, and a wrong one scores what its tests say."""

import json
from pathlib import Path

import pytest

from rlctl.config.load import load_config
from rlctl.engine.reward import code as code_reward
from rlctl.sandbox import Limits, SandboxUnavailable, check

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
try:
    check(Limits(), "sandbox")
    problem = None
except SandboxUnavailable as exc:
    problem = str(exc)
needs_jail = pytest.mark.skipif(problem is not None, reason=f"no bubblewrap jail on this machine: {problem}")


def block(code: str) -> str:
    return f"Here is my solution.\n```python\n{code.strip()}\n```\n"


RIGHT = {
    "sum-of-two": "a, b = map(int, input().split())\nprint(a + b)",
    "max-of-list": "input()\nprint(max(map(int, input().split())))",
    "reverse-words": "print(' '.join(input().split()[::-1]))",
    "count-vowels": "print(sum(c in 'aeiou' for c in input()))",
    "fizzbuzz": "for i in range(1, int(input()) + 1):\n"
    "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)",
    "digit-sum": "print(sum(map(int, input().strip())))",
    "is-palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]",
    "fibonacci": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "gcd": "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
    "flatten": "def flatten(xs):\n    out = []\n    for x in xs:\n        out += flatten(x) if isinstance(x, list) else [x]\n"
    "    return out",
    "run-length": "import itertools\ndef encode(s):\n    return ''.join(f'{len(list(g))}{c}' for c, g in itertools.groupby(s))",
    "two-sum": "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n"
    "        if target - x in seen:\n            return (seen[target - x], j)\n        seen[x] = j",
    "primes-below": "n = int(input())\nsieve = [True] * n\ncount = 0\nfor i in range(2, n):\n    if sieve[i]:\n"
    "        count += 1\n        for k in range(i * i, n, i):\n            sieve[k] = False\nprint(count)",
    "anagrams": "print('YES' if sorted(input().strip()) == sorted(input().strip()) else 'NO')",
    "balanced": "def balanced(s):\n    stack, pairs = [], {')': '(', ']': '[', '}': '{'}\n    for c in s:\n"
    "        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n"
    "            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack",
    "roman": "def to_roman(n):\n    out = ''\n    for v, s in [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),"
    " (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]:\n        while n >= v:\n"
    "            out += s\n            n -= v\n    return out",
}
# Wrong solutions and the share of their problem's 3 tests (fizzbuzz: 2) each still passes.
WRONG = {
    "sum-of-two": ("a, b = map(int, input().split())\nprint(a - b)", 0 / 3),
    "max-of-list": ("input()\nprint(max(map(abs, map(int, input().split()))))", 1 / 3),  # -5 -> 5, -1..-4 -> 4
    "reverse-words": ("print(input()[::-1])", 1 / 3),  # letters reversed: only "a" survives
    "count-vowels": ("print(sum(c in 'aeio' for c in input()))", 2 / 3),  # no u: aeiou gives 4
    "fizzbuzz": ("for i in range(1, int(input()) + 1):\n    print('Fizz' if i % 3 == 0 else i)", 0 / 2),
    "digit-sum": ("print(int(input()) % 9)", 1 / 3),  # 0 is right; 15 -> 6, 180 -> 0
    "is-palindrome": ("def is_palindrome(s):\n    return s == s[::-1]", 2 / 3),  # the Panama one fails
    "fibonacci": ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)", 2 / 3),  # fib(90) hangs
    "gcd": ("def gcd(a, b):\n    return min(a, b)", 0 / 3),  # gcd(0, 7) gives 0
    "flatten": ("def flatten(xs):\n    return [y for x in xs for y in (x if isinstance(x, list) else [x])]", 1 / 3),
    "run-length": ("def encode(s)\n    return s", 0 / 3),  # does not compile
    "two-sum": ("def two_sum(nums, target):\n    return (0, 1)", 1 / 3),
    "primes-below": ("print(int(input()) // 2)", 0 / 3),  # 10 -> 5, 2 -> 1, 100000 -> 50000
    "anagrams": ("print('YES' if set(input()) == set(input()) else 'NO')", 2 / 3),  # aab ~ ab wrongly
    "balanced": ("def balanced(s):\n    return s.count('(') == s.count(')')", 2 / 3),  # ([)] passes wrongly
    "roman": ("def to_roman(n):\n    return 'I' * n", 0 / 3),
}


def rows() -> list[dict]:
    out = []
    for name in ("coding_train.jsonl", "coding_val.jsonl"):
        out += [json.loads(line) for line in (EXAMPLES / "data" / name).read_text().splitlines()]
    return out


def test_the_examples_load_with_their_tools_reward_and_policies():
    maths = load_config(EXAMPLES / "gsm8k-python-gpu.yaml", ["model.path=/models/elsewhere"])
    mt = maths.rollout.multi_turn
    assert maths.device == "cuda" and maths.rollout.backend == "hf" and maths.model.path == "/models/elsewhere"
    assert [t.spec for t in mt.tools] == ["rlctl.tools.python:Python"] and mt.sandbox.wall_time_s < mt.tool_timeout_s
    rules = {rule["name"] for policy in maths.policies for rule in policy["rules"]}
    assert {"tool-outage", "invalid-call-surge", "kl-drift"} <= rules  # agentic's beside default's
    coding = load_config(EXAMPLES / "coding-gpu.yaml")
    assert coding.device == "cuda" and coding.rollout.backend == "hf"
    assert coding.reward.function == "rlctl.engine.reward.code:tests_passed"
    assert (EXAMPLES.parent / coding.data.path).exists() and (EXAMPLES.parent / coding.data.val_path).exists()
    assert {r["problem"] for r in rows()} == set(RIGHT) == set(WRONG) and len(rows()) == 16


@needs_jail
def test_the_maths_examples_python_tool_passes_the_preflight_with_its_metrics():
    from rlctl.engine.tool_workers.loader import load_tools

    tools = load_tools(load_config(EXAMPLES / "gsm8k-python-gpu.yaml").rollout.multi_turn)  # the jail started
    assert "python" in tools.stateful and "tool/python/limit/memory" in tools.call_metrics["python"].reductions


@pytest.mark.slow
@needs_jail
def test_the_coding_examples_problems_score_right_and_wrong_solutions_as_their_tests_say():
    kwargs = load_config(EXAMPLES / "coding-gpu.yaml").reward.kwargs
    data = rows()
    names = [r["problem"] for r in data]
    completions = [block(RIGHT[n]) for n in names] + [block(WRONG[n][0]) for n in names]
    tests = [r["tests"] for r in data] * 2
    scores = code_reward.tests_passed([r["prompt"] for r in data] * 2, completions, tests, **{**kwargs, "workers": 2})
    right, wrong = scores[: len(names)], scores[len(names) :]
    assert dict(zip(names, right, strict=True)) == dict.fromkeys(names, 1.0)
    assert dict(zip(names, wrong, strict=True)) == {n: pytest.approx(WRONG[n][1]) for n in names}
