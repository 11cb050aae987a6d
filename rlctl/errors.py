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
    LEASE_HELD = 10  # another live process is writing this run
    SNAPSHOT = 11  # no usable snapshot: not found, corrupt, incomplete, or from another topology
    STORAGE = 12  # the run directory or snapshot storage failed in a way that may pass (unreachable, 5xx, full)
    STORAGE_REFUSED = 13  # the store refused: no such bucket, access denied, bad credentials (no requeue mends it)
    HALTED = 20  # a rollback policy halted the run; the last good snapshot is there to resume from
    PREEMPTED = 75  # SIGTERM/SIGUSR1 at any moment, or tools down past tool_retry_budget: resume me (EX_TEMPFAIL)
    NODE_LOST = 76  # a Ray node that held ranks was lost: the others were stopped; resume me on healthy nodes
    INTERRUPTED = 130  # Ctrl-C (SIGINT)


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


class LeaseError(RlctlError):
    exit_code = ExitCode.LEASE_HELD


class SnapshotError(RlctlError):
    exit_code = ExitCode.SNAPSHOT


class StorageError(RlctlError):
    """Storage that cannot be reached, read or written (any backend), after its retries: one sentence
    naming the URL and the cause."""

    exit_code = ExitCode.STORAGE


class StorageRefused(StorageError):
    """The store answered and refused (its bucket does not exist, access is denied, the credentials are
    bad): not an outage, so no retry or requeue mends it; a person must. A StorageError, so that every
    writer that stops on storage failures stops on it too."""

    exit_code = ExitCode.STORAGE_REFUSED


class Preempted(RlctlError):
    exit_code = ExitCode.PREEMPTED


class Halted(RlctlError):
    exit_code = ExitCode.HALTED


class NodeLost(RlctlError):
    """A node of the Ray cluster that held ranks of the run was lost (Ray declared it dead, or it did not
    answer for cluster.node_loss_timeout); ``nodes``: [{"id", "ip", "ranks", "cause"}] for the event."""

    exit_code = ExitCode.NODE_LOST

    def __init__(self, message: str, nodes: list[dict]):
        super().__init__(message)
        self.nodes = nodes


class Stopped(BaseException):
    """A stop signal that (SIGTERM/SIGUSR1) that came before a trainer could take it (a BaseException, like KeyboardInterrupt,
    so that no ``except Exception`` on the way swallows it)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class RankFailed(RlctlError):
    """A rank of a multi-rank run ended with an error; carries that rank's exit code and message."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = ExitCode(code) if code in ExitCode._value2member_map_ else ExitCode.INTERNAL
