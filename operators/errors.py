"""Typed task errors, one per failure class, and the retry policy that acts on them.

Airflow's retry machinery does the retrying: ``INFRA`` errors are retried with backoff (the job resumes
from its last checkpoint), every other class fails the task at once with its reason.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule

from training.failures import FailureClass


class PinflowTaskError(Exception):
    failure_class: FailureClass = FailureClass.USER


class InfraFailure(PinflowTaskError):
    """Lost node, preflight failure, stall: retried, resuming from the last checkpoint."""

    failure_class = FailureClass.INFRA


class UserFailure(PinflowTaskError):
    """A bug in model code or a bad config: retrying cannot help."""

    failure_class = FailureClass.USER


class DataFailure(PinflowTaskError):
    """Validation failed or a partition is missing: nothing downstream may run."""

    failure_class = FailureClass.DATA


class OOMFailure(PinflowTaskError):
    failure_class = FailureClass.OOM


ERROR_FOR_CLASS: dict[FailureClass, type[PinflowTaskError]] = {
    FailureClass.INFRA: InfraFailure,
    FailureClass.USER: UserFailure,
    FailureClass.DATA: DataFailure,
    FailureClass.OOM: OOMFailure,
}


def retry_policy(infra_delay: timedelta | None = None) -> ExceptionRetryPolicy:
    """Retry INFRA; fail USER, DATA and OOM now. Other errors: Airflow's default.

    ``infra_delay`` None: the task's own ``retry_delay`` and ``retry_exponential_backoff`` apply.
    """
    return ExceptionRetryPolicy(
        rules=[
            RetryRule(InfraFailure, RetryAction.RETRY, retry_delay=infra_delay, reason="infrastructure failure: retry and resume"),
            RetryRule(DataFailure, RetryAction.FAIL, reason="data failure: fix the partition, then clear the task"),
            RetryRule(OOMFailure, RetryAction.FAIL, reason="out of memory: lower batch_size or add memory per node"),
            RetryRule(UserFailure, RetryAction.FAIL, reason="user error in model code or config: retrying cannot help"),
        ]
    )
