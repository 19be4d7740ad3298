"""Team quotas: what a team's jobs may hold at once, checked before every submission; each team's Airflow pool.

A team's quota (``teams.<team>.quota`` in the platform configuration: ``jobs``, ``nodes``, ``gpus``; empty: no
limit) is compared with the jobs the job history says the team holds (admitted, submitted or running) plus the
job that asks. If it does not fit, the training operator defers to :class:`QuotaTrigger`, which re-checks every
``training.quota_poll_seconds`` in the triggerer (no worker slot is held), logging who holds the room; when there
is room the task resumes and admits its job atomically (one transaction holding the team's lock row, so two
tasks never both take the last slot), then submits. The wait is the job history's ``quota_wait_s``. A job that
can never fit (more nodes than the whole quota) fails at once with the setting to change.

Rows of jobs that ended without anyone recording it (a killed worker) are reconciled with their backend before
each check, so a lost task never holds its team's quota for ever.

Each team is also an Airflow pool, ``team-<name>``, with ``quota.jobs`` slots (unlimited without) that count
deferred tasks, so that the scheduler itself runs at most that many of the team's training tasks;
:mod:`operators.policy` routes each training task to its run's team's pool. Create or update the pools from the
configuration (``make install`` does)::

    python -m operators.quotas sync-pools      # create or update team-<name> for every team
    python -m operators.quotas show            # each team's usage against its quota now
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import sqlalchemy as sa
from airflow.triggers.base import BaseTrigger, TriggerEvent

from core.config import PlatformConfig, QuotaConfig, TeamConfig
from core.failures import ConfigError
from operators.params import team_param as team_param  # the forms' team param, also here for its callers
from operators.triggers import not_before
from services import job_history as history

log = logging.getLogger(__name__)

POOL_PREFIX = "team-"
# An admitted job whose submission was never recorded this long after: its task died in between.
ABANDON_AFTER_S = 600.0


def team_pool(team: str) -> str:
    """The Airflow pool of a team."""
    return f"{POOL_PREFIX}{team}"


@dataclasses.dataclass(frozen=True)
class Amount:
    """Jobs, nodes and GPUs: what a job needs, or what a team holds."""

    jobs: int = 0
    nodes: int = 0
    gpus: int = 0

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.jobs + other.jobs, self.nodes + other.nodes, self.gpus + other.gpus)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def need_of(nodes: int, gpus_per_node: int) -> Amount:
    return Amount(jobs=1, nodes=nodes, gpus=nodes * gpus_per_node)


def limits(quota: QuotaConfig) -> dict[str, int | None]:
    return {"jobs": quota.jobs, "nodes": quota.nodes, "gpus": quota.gpus}


def shortfall(quota: QuotaConfig, held: Amount, need: Amount) -> list[str]:
    """What would go over the quota if ``need`` were added to ``held``: one phrase per resource, or nothing."""
    problems = []
    for key, limit in limits(quota).items():
        if limit is None:
            continue
        after = getattr(held, key) + getattr(need, key)
        if after > limit:
            problems.append(f"{key} {getattr(held, key)} held + {getattr(need, key)} asked > quota {limit}")
    return problems


def never_fits(team: str, quota: QuotaConfig, need: Amount) -> str | None:
    """Why a job can never run under its team's quota (it asks more than the whole quota), or None."""
    over = [f"{key}={getattr(need, key)} > quota {limit}" for key, limit in limits(quota).items()
            if limit is not None and getattr(need, key) > limit]
    if not over:
        return None
    return (f"the job asks for more than team {team}'s whole quota ({', '.join(over)}): it could never run; ask for "
            f"fewer nodes (param nodes) or another instance type, or raise teams.{team}.quota in config/platform.yaml")


def held(conn: sa.Connection, team: str, exclude: str | None = None) -> tuple[Amount, list[dict[str, Any]]]:
    """What the team's admitted, submitted and running jobs hold (but ``exclude``), and those rows."""
    jobs = history.jobs
    query = sa.select(jobs).where(jobs.c.team == team, jobs.c.state.in_(history.ACTIVE))
    if exclude:
        query = query.where(jobs.c.job_name != exclude)
    rows = [dict(r) for r in conn.execute(query).mappings()]
    total = Amount()
    for row in rows:
        total = total + Amount(1, int(row["nodes"] or 0), int(row["gpus"] or 0))
    return total, rows


def describe_holders(rows: list[dict[str, Any]], limit: int = 5) -> str:
    parts = [f"{r['job_id'] or r['job_name']} ({r['state'].lower()}, {r['nodes']} node(s), {r['gpus']} GPU(s), "
             f"{r['dag_id']} {r['run_id']})" for r in rows[:limit]]
    return "; ".join(parts) + (f"; and {len(rows) - limit} more" if len(rows) > limit else "")


# --- reconciling rows with their backends ----------------------------------------------------------------


def unwatched_s(row: Mapping[str, Any]) -> float | None:
    """Seconds since a task last watched the row's job (a task waiting for its job, the operator polling or its
    trigger, marks it every ``job_history.WATCH_EVERY_S``); None for rows from before that column."""
    watched = history.aware(row.get("watched_at"))
    return None if watched is None else (history.now() - watched).total_seconds()


def reconcile(team: str, url: str | None = None, backends: Mapping[str, Any] | None = None,
              orphan_after_s: float | None = None) -> int:
    """Close the team's active rows whose job has ended (or vanished) without its end being recorded, and cancel
    the running jobs that no task has watched for ``orphan_after_s`` (:func:`unwatched_s`; 0: never): their row
    says CANCELLED and why.

    Asks each row's backend for its job's status; an admitted row never submitted for ``ABANDON_AFTER_S`` is
    abandoned. Returns how many rows changed. Errors are logged: a backend that does not answer keeps its rows.
    """
    from core import config
    from operators.backends import get_backend
    from operators.jobs import failure_messages

    if orphan_after_s is None:
        orphan_after_s = config.load().job_history.orphan_after_s

    cache: dict[str, Any] = dict(backends or {})
    changed = 0
    for row in history.rows(url=url, team=team, states=history.ACTIVE):
        try:
            if not row["job_id"]:
                age = (history.now() - (row["updated_at"] or history.now())).total_seconds()
                if row["state"] == history.ADMITTED and age > ABANDON_AFTER_S:
                    history.upsert(row["job_name"], url, state=history.ABANDONED, outcome=history.ABANDONED,
                                   ended_at=history.now(), reason=f"admitted {age:.0f}s ago and never submitted")
                    changed += 1
                continue
            backend = cache.get(row["backend"]) or cache.setdefault(row["backend"], get_backend(row["backend"]))
            try:
                status = backend.status(row["job_id"])
            except LookupError as err:
                history.mark_ended(row["backend"], row["job_id"], history.LOST, failure_class="INFRA",
                                   reason=f"the backend no longer knows the job: {err}", url=url)
                changed += 1
                continue
            if status.state.terminal:
                # A job that ended with no task watching says why itself (a lease that expired: its task was gone).
                said = failure_messages(row.get("output_dir")) if status.failure_class else ""
                history.mark_ended(
                    row["backend"], row["job_id"], status.state.value,
                    failure_class=status.failure_class.value if status.failure_class else None,
                    reason=f"{status.reason}: {said}" if said else status.reason, started_at=status.started_at,
                    queued_s=status.queued_s,
                    ended_at=status.ended_at, url=url,
                )
                changed += 1
            elif orphan_after_s and (unwatched := unwatched_s(row)) is not None and unwatched > orphan_after_s:
                log.warning("job %s (%s) has not been watched by its task for %.0f s: cancelling it as orphaned",
                            row["job_id"], row["job_name"], unwatched)
                history.mark_ended(row["backend"], row["job_id"], history.CANCELLED, url=url, reason=(
                    f"orphaned: no task watched it for {unwatched / 60:.0f} min (its task was killed with no retry "
                    f"left, or the process running it died), so it was cancelled; run the task again to resume from "
                    f"its last checkpoint"))
                backend.cancel(row["job_id"])
                changed += 1
        except Exception as err:  # noqa: BLE001 - one row that cannot be checked must not block the others
            log.warning("could not reconcile job %s of team %s: %s", row["job_name"], team, err)
    return changed


# --- admission ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
    admitted: bool
    held: Amount
    need: Amount
    shortfall: list[str]
    holders: str
    waited_s: float = 0.0

    def message(self, team: str, quota: QuotaConfig) -> str:
        lim = limits(quota)
        usage = ", ".join(f"{key} {getattr(self.held, key)}/{'∞' if lim[key] is None else lim[key]}" for key in lim)
        if self.admitted:
            return f"team {team} has room (held before this job: {usage}); admitted after {self.waited_s:.0f}s waiting"
        return (f"team {team} is at its quota ({'; '.join(self.shortfall)}; held: {usage}) — held by "
                f"{self.holders or 'nobody recorded'}")


def try_admit(job_name: str, team: str, quota: QuotaConfig, need: Amount, url: str | None = None) -> Verdict:
    """Admit ``job_name`` if the team has room: one transaction, serialised per team by its lock row.

    The lock row's update comes first: it takes SQLite's write lock (waited for) or PostgreSQL's row lock, so
    the count that follows cannot be overtaken by another admission of the team.
    """
    with history.locked(team, url) as conn:
        holding, rows = held(conn, team, exclude=job_name)
        short = shortfall(quota, holding, need)
        row = conn.execute(sa.select(history.jobs.c.requested_at).where(history.jobs.c.job_name == job_name)).first()
        requested = history.aware(row[0]) if row and row[0] else history.now()
        waited = max(0.0, (history.now() - requested).total_seconds())
        if not short:
            history.upsert(job_name, conn=conn, state=history.ADMITTED, quota_wait_s=waited, team=team,
                           nodes=need.nodes, gpus=need.gpus, requested_at=requested)
        return Verdict(not short, holding, need, short, describe_holders(rows), waited)


def check_room(job_name: str, team: str, quota: QuotaConfig, need: Amount, url: str | None = None) -> Verdict:
    """Read-only: would ``need`` fit now (after reconciling the team's rows)?"""
    reconcile(team, url)
    with history.engine(url).connect() as conn:
        holding, rows = held(conn, team, exclude=job_name)
    short = shortfall(quota, holding, need)
    return Verdict(not short, holding, need, short, describe_holders(rows))


def request(job_name: str, fields: dict[str, Any], url: str | None = None) -> None:
    """Record that ``job_name`` asks for room (WAITING, requested now unless it asked before)."""
    mine = history.get(job_name, url)
    if mine is not None and mine["state"] == history.WAITING:
        history.upsert(job_name, url, **fields)  # asked before (the task resumes from its wait): keep its start
        return
    history.upsert(job_name, url, **fields, state=history.WAITING, requested_at=history.now())


def wait_for_room(
    operator: Any, *, job_name: str, team: str, team_config: TeamConfig, need: Amount, fields: dict[str, Any],
    deferrable: bool, poll_seconds: float, resume_method: str, url: str | None = None,
) -> Verdict:
    """Admit the job, or wait until the team has room: deferred to :class:`QuotaTrigger` (the task resumes at
    ``resume_method`` and calls this again) or, on the synchronous path, polling on the worker."""
    from airflow.sdk.exceptions import TaskDeferred

    quota = team_config.quota
    why_not = never_fits(team, quota, need)
    if why_not:
        raise ConfigError(why_not)
    request(job_name, fields, url)
    reconcile(team, url)
    logged = 0.0
    while True:
        verdict = try_admit(job_name, team, quota, need, url)
        if verdict.admitted:
            if verdict.waited_s >= 1:
                operator.log.info("%s", verdict.message(team, quota))
            return verdict
        if deferrable:
            operator.log.info(
                "%s. Job %s (%d node(s), %d GPU(s)) waits for room: deferring, re-checked every %.0fs",
                verdict.message(team, quota), job_name, need.nodes, need.gpus, poll_seconds,
            )
            trigger = QuotaTrigger(team=team, job_name=job_name, need=need.as_dict(), poll_seconds=poll_seconds,
                                   url=url)
            raise TaskDeferred(trigger=trigger, method_name=resume_method)
        if time.monotonic() - logged > 60:
            logged = time.monotonic()
            operator.log.info("%s. Job %s waits for room (checked every %.0fs)", verdict.message(team, quota),
                              job_name, poll_seconds)
        time.sleep(poll_seconds)
        reconcile(team, url)


def admit_job(operator: Any, context: Any, spec: Any, *, backend: str, family: str | None, output_dir: str | None,
              checkpoint_dir: str | None, resume_method: str = "execute_after_quota") -> Verdict:
    """The training operator's gate before it submits ``spec``: record the job in the history, then admit it or
    wait for room (:func:`wait_for_room`). Its size is its nodes x its instance type's GPUs (or the spec's); a job of
    the local backend is recorded on this machine with the GPUs it has (none on a CPU machine)."""
    from core import config
    from core.config import LOCAL_MACHINE
    from operators.backends.resources import Catalog, instance_type_of, local_gpus

    cfg = config.load()
    if backend == "local":  # the job runs here, whatever the team's node type: count this machine's GPUs
        itype, gpus = LOCAL_MACHINE, local_gpus() if spec.gpus_per_node is None else int(spec.gpus_per_node)
    else:
        itype = instance_type_of(spec, cfg.teams, Catalog.from_config(cfg))
        gpus = cfg.instance_types[itype].gpus if spec.gpus_per_node is None else int(spec.gpus_per_node)
    fields = history.job_fields(
        team=spec.team, family=family, ti=context["ti"], backend=backend, instance_type=itype, nodes=spec.nodes,
        procs_per_node=spec.procs_per_node, gpus_per_node=gpus, output_dir=output_dir, checkpoint_dir=checkpoint_dir,
    )
    return wait_for_room(
        operator, job_name=spec.name, team=spec.team, team_config=cfg.teams[spec.team], need=need_of(spec.nodes, gpus),
        fields=fields, deferrable=bool(getattr(operator, "deferrable", False)),
        poll_seconds=cfg.training.quota_poll_seconds, resume_method=resume_method,
    )


class QuotaTrigger(BaseTrigger):
    """Wait in the triggerer until a team has room in its quota for a job; fires ``{"team", "job_name", "room":
    True, "waited_s"}``. Serialises the team, the job's name and needs, and the poll; reads the quota from the
    platform configuration each time (a raised quota takes effect at the next check)."""

    def __init__(self, *, team: str, job_name: str, need: dict[str, int], poll_seconds: float = 30.0,
                 url: str | None = None) -> None:
        super().__init__()
        self.team = team
        self.job_name = job_name
        self.need = dict(need)
        self.poll_seconds = float(poll_seconds)
        self.url = url

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"team": self.team, "job_name": self.job_name, "need": self.need, "poll_seconds": self.poll_seconds,
                 "url": self.url})

    def _check(self) -> Verdict:
        from core import config

        teams = config.read().teams
        quota = teams[self.team].quota if self.team in teams else QuotaConfig()
        return check_room(self.job_name, self.team, quota, Amount(**self.need), self.url)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        last_log = 0.0
        while True:
            verdict = await asyncio.to_thread(self._check)
            if verdict.admitted:
                waited = time.monotonic() - started
                self.log.info("team %s has room for job %s after %.0fs", self.team, self.job_name, waited)
                await not_before(self, started)
                yield TriggerEvent({"team": self.team, "job_name": self.job_name, "room": True, "waited_s": waited})
                return
            if time.monotonic() - last_log > 60:
                last_log = time.monotonic()
                self.log.info("job %s still waits for room in team %s's quota: %s", self.job_name, self.team,
                              "; ".join(verdict.shortfall))
            await asyncio.sleep(self.poll_seconds)


# --- pools -------------------------------------------------------------------------------------------------


def pool_slots(team: TeamConfig) -> int:
    return team.quota.jobs if team.quota.jobs is not None else -1  # -1: Airflow's unlimited pool


def sync_pools(cfg: PlatformConfig) -> list[str]:
    """Create or update ``team-<name>`` for every team (slots: ``quota.jobs``; deferred tasks count); return
    what was done, one line each. Pools of teams no longer configured are named, not deleted."""
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    lines = []
    with create_session() as session:
        existing = {str(p.pool): p for p in session.scalars(sa.select(Pool))}
        for name, team in sorted(cfg.teams.items()):
            pool, slots = team_pool(name), pool_slots(team)
            before = existing.get(pool)
            description = f"pinflow team {name}: at most quota.jobs training jobs at once (operators.quotas)"
            Pool.create_or_update_pool(pool, slots, description, True, session=session)
            if before is None:
                lines.append(f"created pool {pool}: {slots if slots >= 0 else 'unlimited'} slot(s)")
            else:
                lines.append(f"updated pool {pool}: {slots if slots >= 0 else 'unlimited'} slot(s)")
        for stale in sorted(set(existing) - {team_pool(n) for n in cfg.teams}):
            if stale.startswith(POOL_PREFIX):
                lines.append(f"pool {stale} has no team under teams: any more (left as it is: airflow pools delete {stale})")
    return lines


def usage_by_team(cfg: PlatformConfig, url: str | None = None, reconcile_first: bool = True) -> list[dict[str, Any]]:
    """Each team's holding now against its quota, and how many jobs wait for room."""
    out = []
    for name, team in sorted(cfg.teams.items()):
        if reconcile_first:
            reconcile(name, url)
        with history.engine(url).connect() as conn:
            holding, rows = held(conn, name)
            waiting = conn.execute(sa.select(sa.func.count()).select_from(history.jobs).where(
                history.jobs.c.team == name, history.jobs.c.state == history.WAITING)).scalar_one()
        out.append({"team": name, "pool": team_pool(name), "held": holding.as_dict(), "quota": limits(team.quota),
                    "waiting": int(waiting), "instance_type": team.instance_type or cfg.training.instance_type,
                    "holders": rows})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m operators.quotas", description="Team quotas and pools.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sync-pools", help="create or update each team's Airflow pool from the configuration")
    sub.add_parser("show", help="each team's usage against its quota now")
    args = parser.parse_args(argv)
    from core import config

    cfg = config.load()
    if args.command == "sync-pools":
        for line in sync_pools(cfg):
            print(line)
        return 0
    with history.cli_errors("quotas show"):
        for team in usage_by_team(cfg, url=history.existing(cfg.job_history.url)):
            quota = ", ".join(f"{k} {team['held'][k]}/{'∞' if v is None else v}" for k, v in team["quota"].items())
            print(f"{team['team']} (pool {team['pool']}, {team['instance_type']}): {quota}; {team['waiting']} waiting")
        return 0
    return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())

