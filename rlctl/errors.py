"""Domain errors and their exit codes.

Every error a user can cause has its own class and exit code, listed once here and in the README, so
cron and Slurm scripts can branch on them. Commands raise these; ``rlctl.cli.main`` turns them into one
sentence on stderr and the exit code, never a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug in rlctl: the traceback is printed
    USAGE = 2  # bad command line (click's own convention)
    CONFIG = 3  # the run config is invalid: unknown key, wrong type, missing file
    INPUT = 4  # a model, dataset or reward function named by the config cannot be loaded
    NONFINITE_ABORT = 5  # training produced NaN/Inf and no policy is there to handle it


class RlctlError(Exception):
    """An error the user can act on: rendered as one sentence, exits with ``exit_code``."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(RlctlError):
    exit_code = ExitCode.CONFIG


class InputError(RlctlError):
    exit_code = ExitCode.INPUT
