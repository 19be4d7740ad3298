"""Failure classes and the exit codes that carry them out of a job (DESIGN.md §4).

Every entry point in ``training/`` exits with one of these codes, so every backend (a local process, an
AWS Batch node, a Kubernetes pod) can classify the outcome the same way.
"""

from __future__ import annotations

import enum


class FailureClass(enum.StrEnum):
    """Why a job ended badly, and so what a retry can do about it."""

    INFRA = "INFRA"  # node lost, spot reclaimed, preflight failed, collective timeout, stall: retry + resume
    USER = "USER"  # exception in model code, NaN loss, bad config: fail now
    DATA = "DATA"  # validation failed, missing partition: fail now, nothing downstream runs
    OOM = "OOM"  # out of memory: fail with advice

    @property
    def retryable(self) -> bool:
        return self is FailureClass.INFRA


class ExitCode(enum.IntEnum):
    """Documented process exit codes of ``training`` entry points."""

    OK = 0
    USER = 1  # an uncaught exception is a bug in the model code or its config
    DATA = 65  # sysexits EX_DATAERR
    INFRA = 75  # sysexits EX_TEMPFAIL: try again
    NAN_LOSS = 76
    OOM = 137  # the kernel's OOM killer (SIGKILL) or torch.OutOfMemoryError


_EXIT_CLASS = {
    ExitCode.USER: FailureClass.USER,
    ExitCode.DATA: FailureClass.DATA,
    ExitCode.INFRA: FailureClass.INFRA,
    ExitCode.NAN_LOSS: FailureClass.USER,
    ExitCode.OOM: FailureClass.OOM,
}


def classify_exit_code(code: int) -> FailureClass | None:
    """The failure class of a process exit code; ``None`` for success.

    A negative code is a signal (Python's subprocess convention): SIGKILL is taken as OOM only through
    its shell form 137; other signals mean the process was killed from outside (node lost): INFRA.
    """
    if code == 0:
        return None
    if code < 0:
        return FailureClass.INFRA
    try:
        return _EXIT_CLASS[ExitCode(code)]
    except (ValueError, KeyError):
        return FailureClass.INFRA if code > 128 else FailureClass.USER


class TrainingError(Exception):
    """An error with a failure class; entry points turn it into the class's exit code."""

    exit_code: ExitCode = ExitCode.USER
    failure_class: FailureClass = FailureClass.USER


class DataError(TrainingError):
    exit_code = ExitCode.DATA
    failure_class = FailureClass.DATA


class InfraError(TrainingError):
    exit_code = ExitCode.INFRA
    failure_class = FailureClass.INFRA


class NanLossError(TrainingError):
    exit_code = ExitCode.NAN_LOSS
    failure_class = FailureClass.USER
