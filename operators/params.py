"""Trigger-form params shared by several DAGs, built from the platform configuration at parse time.

A small module on purpose: the DAG files import it when they are parsed (``operators.quotas``, where the team
quotas live, imports SQLAlchemy and the job history).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.config import PlatformConfig


def team_param(cfg: PlatformConfig) -> Any:
    """The trigger forms' ``team`` param: an enum of the configured teams, the default team first."""
    from airflow.sdk import Param

    return Param(
        cfg.training.team, enum=sorted(cfg.teams),
        description="The team whose quota, Airflow pool, Batch fair share / Kueue queue and default instance type "
                    "the job uses (teams: in the platform configuration).",
    )
