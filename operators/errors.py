"""The retry policy that acts on the failure classes of ``core.failures``.

Airflow's retry machinery does the retrying: ``INFRA`` errors are retried with backoff (the job resumes from
its last checkpoint), every other class fails the task at once with its reason. The typed errors themselves
(``InfraError``, ``UserError``, ``DataError``, ``OOMError``) live in ``core.failures``, shared with the jobs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule

from core.failures import DataError, InfraError, OOMError, UserError


def retry_policy(infra_delay: timedelta | None = None) -> ExceptionRetryPolicy:
    """Retry INFRA; fail USER, DATA and OOM now. Other errors: Airflow's default.

    ``infra_delay`` None: the task's own ``retry_delay`` and ``retry_exponential_backoff`` apply.
    """
    return ExceptionRetryPolicy(
        rules=[
            RetryRule(InfraError, RetryAction.RETRY, retry_delay=infra_delay, reason="infrastructure failure: retry and resume"),
            RetryRule(DataError, RetryAction.FAIL, reason="data failure: fix the partition, then clear the task"),
            RetryRule(OOMError, RetryAction.FAIL, reason="out of memory: lower batch_size or add memory per node"),
            RetryRule(UserError, RetryAction.FAIL, reason="user error in model code or config: retrying cannot help"),
        ]
    )


def default_args(owner: str, retry_delay: timedelta = timedelta(minutes=1)) -> dict[str, Any]:
    """Every pinflow DAG's task defaults: two retries with exponential backoff from ``retry_delay``, and the
    failure-class policy above (only INFRA is retried)."""
    return {
        "owner": owner,
        "retries": 2,
        "retry_delay": retry_delay,
        "retry_exponential_backoff": 2.0,
        "retry_policy": retry_policy(),
    }
