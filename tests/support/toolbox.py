"""Tools the multi-turn tests call, in worker processes: real functions, each showing one outcome."""

import os
import time
from typing import Literal

from rlctl.tools import ToolUnavailable

CAPITALS = {"france": "paris", "peru": "lima", "italy": "rome", "japan": "tokyo"}


def lookup(country: str) -> str:
    """The capital of a country.

    Args:
        country: The country's name, in lower case.
    """
    return CAPITALS.get(country.strip().lower(), "unknown")


def add(a: int, b: float = 0.0, mode: Literal["plain", "abs"] = "plain") -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number,
            which may be a fraction.
        mode: plain, or abs for the absolute value.
    """
    return abs(a + b) if mode == "abs" else a + b


def spin(seconds: float) -> str:
    """Burn CPU for a while (pure Python: no sleep, no I/O), then say when it started."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return f"spun {n}"


def span(seconds: float) -> str:
    """Burn CPU for a while; the monotonic clock (one for every process) when it began and ended."""
    start = time.monotonic()
    spin(seconds)
    return f"{start} {time.monotonic()}"


def check(answer: str, expected: str) -> str:
    """Check an answer.

    Args:
        answer: The answer to check.
        expected: The right answer (filled from the prompt's row, hidden from the model).
    """
    return "correct" if answer.strip().lower() == expected.strip().lower() else "wrong"


def tick() -> str:
    """A different answer at every call, as a clock or a live service gives."""
    return f"now {time.time_ns()}"


def fail(x: int) -> str:
    """Always raises, as a buggy tool would."""
    raise ValueError(f"bad x {x}")


def down() -> str:
    """A service that is down."""
    raise ToolUnavailable("the lookup service is down")


def crash() -> str:
    """Kills its own process, as a segfault would."""
    os._exit(3)


def words(n: int) -> str:
    """n words."""
    return " ".join(f"word{i}" for i in range(n))


def pid() -> int:
    """The worker's process id."""
    return os.getpid()


RELEASED = "RLCTL_TEST_RELEASED"  # a file each object's release() / close() appends a line to, when set


class Counter:
    """A counter kept for one conversation."""

    def create(self, start: int = 0) -> None:
        self.total = start

    def call(self, by: int) -> str:
        """Add to the counter and say its total.

        Args:
            by: How much to add.
        """
        if by == 13:
            raise ValueError("13 is unlucky")
        self.total += by
        if by == 99:
            spin(30)
        return f"total {self.total} in {os.getpid()}"

    def release(self) -> None:
        if os.environ.get(RELEASED):
            with open(os.environ[RELEASED], "a") as f:
                f.write(f"counter {self.total}\n")


class Guess:
    """A guessing game: the secret number is in the prompt's row (env_args); each turn the model guesses,
    the environment says higher or lower and rewards a right guess with 1 (and 0.1 for every guess)."""

    def reset(self, secret: int = 7) -> None:
        self.secret, self.guesses = secret, 0

    def step(self, action: str):
        self.guesses += 1
        digits = "".join(ch for ch in action if ch.isdigit())
        if not digits:
            return "say a number", 0.0, False
        if int(digits) == self.secret:
            return f"right after {self.guesses}", 1.0, True
        return ("higher" if int(digits) < self.secret else "lower") + f" ({self.guesses})", 0.1, False

    def close(self) -> None:
        if os.environ.get(RELEASED):
            with open(os.environ[RELEASED], "a") as f:
                f.write(f"guess {self.guesses}\n")


class BadStep:
    """An environment whose step answers the wrong shape."""

    def step(self, action: str):
        return "only an observation"
