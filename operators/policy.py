"""Airflow cluster policy (registered through the ``airflow.policy`` entry point in pyproject.toml): each training
task and HPO trial runs in its team's pool, so the scheduler runs at most ``quota.jobs`` of a team's training tasks at once.

The team is the run's ``team`` param (``dag_run.conf`` of a run triggered from the form or the API), else the
platform's ``training.team``. A pool that does not exist (``python -m operators.quotas sync-pools`` not run on
this metadata database) is not routed to: Airflow would never schedule the task; the operator's own quota check
still holds. This module is imported while Airflow initialises: nothing heavy at the top.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.policies import hookimpl

log = logging.getLogger(__name__)

# Operators whose tasks run a team's compute job (task_type as Airflow records it).
TEAM_OPERATORS = frozenset({"DistributedTrainingOperator", "HpoTrialOperator"})


def _pools(dag_run: Any) -> set[str] | None:
    """The pools in the metadata database, read through the scheduler's own session (no new session, no commit)."""
    from airflow.models.pool import Pool
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    session = object_session(dag_run)
    if session is None:
        return None
    with session.no_autoflush:
        return set(session.scalars(select(Pool.pool)))


@hookimpl
def task_instance_mutation_hook(task_instance: Any, dag_run: Any) -> None:
    if dag_run is None or getattr(task_instance, "operator", None) not in TEAM_OPERATORS:
        return
    try:
        from core import config
        from operators.quotas import team_pool

        conf = getattr(dag_run, "conf", None) or {}
        team = str(conf.get("team") or config.load().training.team)
        pool = team_pool(team)
        pools = _pools(dag_run)
        if pools is None:
            return  # cannot tell whether it exists: leave the task where it is
        if pool not in pools:
            log.warning("pool %s of team %s does not exist: %s.%s stays in pool %s (run: python -m operators.quotas "
                        "sync-pools)", pool, team, task_instance.dag_id, task_instance.task_id, task_instance.pool)
            return
        task_instance.pool = pool
    except Exception as err:  # noqa: BLE001 - a policy must never break the scheduler's loop
        log.warning("could not route %s to its team's pool: %s", getattr(task_instance, "task_id", "?"), err)
