"""The job history: one row per compute job, written by the operators at each transition, for capacity planning.

One table, ``pinflow_job_history``, in a real database through SQLAlchemy: SQLite under ``PINFLOW_HOME`` on the
embedded default (``jobdata/job_history.db``), PostgreSQL in production (``job_history.url`` in the platform
configuration, or ``PINFLOW_JOB_HISTORY__URL``). The table is created on first use.

A row is keyed by the job's deterministic name (one per DAG run, task and try) and moves through::

    WAITING (for room in the team's quota) -> ADMITTED -> SUBMITTED (queued on the backend) -> RUNNING
        -> SUCCEEDED | FAILED | STALLED | QUEUE_TIMEOUT | CANCELLED | LOST | ABANDONED

``ADMITTED``, ``SUBMITTED`` and ``RUNNING`` hold the team's quota (:mod:`operators.quotas`). Each row carries the
team, family, DAG / run / task / try, backend, job id, instance type and count, the times (requested, submitted,
started, ended), the waits (for quota, in the backend's queue), run time, GPU- and node-hours, outcome, failure
class, retries, the model version and the promotion decision.

    python -m services.job_history export --format parquet --out jobs.parquet [--since 2026-11-01] [--team ranking]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import logging
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from core.failures import ConfigError

log = logging.getLogger(__name__)

TABLE = "pinflow_job_history"
LOCKS = "pinflow_team_locks"

WAITING = "WAITING"
ADMITTED = "ADMITTED"
SUBMITTED = "SUBMITTED"
RUNNING = "RUNNING"
SUCCEEDED = "SUCCEEDED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
LOST = "LOST"  # the backend no longer knows the job and nobody recorded its end
ABANDONED = "ABANDONED"  # admitted, then never submitted (the task died in between)
STOPPED_BY_A_PERSON = "stopped from Airflow: the task was marked failed or success, cleared, or its run stopped"
# The states that hold a team's quota.
ACTIVE = (ADMITTED, SUBMITTED, RUNNING)
TERMINAL = (SUCCEEDED, FAILED, "STALLED", "QUEUE_TIMEOUT", CANCELLED, LOST, ABANDONED)

metadata = sa.MetaData()

jobs = sa.Table(
    TABLE,
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_name", sa.String(200), nullable=False, unique=True, comment="deterministic per DAG run, task and try"),
    sa.Column("team", sa.String(100), nullable=False, index=True),
    sa.Column("family", sa.String(100)),
    sa.Column("dag_id", sa.String(250), index=True),
    sa.Column("run_id", sa.String(250), index=True),
    sa.Column("task_id", sa.String(250)),
    sa.Column("map_index", sa.Integer, default=-1),
    sa.Column("try_number", sa.Integer),
    sa.Column("retries", sa.Integer, comment="tries before this one"),
    sa.Column("backend", sa.String(32)),
    sa.Column("job_id", sa.String(250), index=True),
    sa.Column("instance_type", sa.String(64)),
    sa.Column("nodes", sa.Integer),
    sa.Column("procs_per_node", sa.Integer),
    sa.Column("gpus_per_node", sa.Integer),
    sa.Column("gpus", sa.Integer, comment="nodes x GPUs per node"),
    sa.Column("state", sa.String(32), nullable=False, index=True),
    sa.Column("requested_at", sa.DateTime(timezone=True), comment="the operator asked for room"),
    sa.Column("submitted_at", sa.DateTime(timezone=True)),
    sa.Column("started_at", sa.DateTime(timezone=True)),
    sa.Column("ended_at", sa.DateTime(timezone=True)),
    sa.Column("quota_wait_s", sa.Float, comment="waiting for room in the team's quota, before submission"),
    sa.Column("queue_wait_s", sa.Float, comment="queued on the backend: capacity, instance boot, image pull"),
    sa.Column("run_s", sa.Float),
    sa.Column("gpu_hours", sa.Float),
    sa.Column("node_hours", sa.Float),
    sa.Column("cost", sa.Float, comment="node-hours x the instance type's price per node-hour (costs:), in currency"),
    sa.Column("currency", sa.String(8)),
    sa.Column("outcome", sa.String(32), comment="the terminal state"),
    sa.Column("failure_class", sa.String(16)),
    sa.Column("reason", sa.Text),
    sa.Column("model_name", sa.String(250)),
    sa.Column("model_version", sa.String(32)),
    sa.Column("mlflow_run_id", sa.String(64)),
    sa.Column("promoted", sa.Boolean),
    sa.Column("promotion_reason", sa.Text),
    sa.Column("input_wait_share", sa.Float, comment="share of step time the ranks waited for input (data-bound)"),
    sa.Column("output_dir", sa.Text),
    sa.Column("checkpoint_dir", sa.Text),
    sa.Column("console_url", sa.Text),
    sa.Column("watched_at", sa.DateTime(timezone=True), comment="the last time a task checked on the running job"),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)
sa.Index("ix_pinflow_job_history_team_state", jobs.c.team, jobs.c.state)
sa.Index("ix_pinflow_job_history_backend_job", jobs.c.backend, jobs.c.job_id)

team_locks = sa.Table(
    LOCKS,
    metadata,
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("admissions", sa.Integer, nullable=False, default=0),
)

# Every move of a model's champion alias (services.champions): what MLflow's registry does not keep.
alias_history = sa.Table(
    "pinflow_alias_history",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("model_name", sa.String(250), nullable=False, index=True),
    sa.Column("alias", sa.String(64), nullable=False),
    sa.Column("from_version", sa.String(32), comment="the version it pointed at before; empty: none"),
    sa.Column("to_version", sa.String(32), nullable=False),
    sa.Column("moved_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("moved_by", sa.String(500), comment="the user or the DAG run that moved it"),
    sa.Column("kind", sa.String(32), comment="promotion, approval or rollback"),
    sa.Column("reason", sa.Text),
)

# Every missed deadline of the daily chain (operators.deadlines): which run, which deadline, how late.
deadline_misses = sa.Table(
    "pinflow_deadline_misses",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("dag_id", sa.String(250), nullable=False),
    sa.Column("run_id", sa.String(250), nullable=False),
    sa.Column("run_type", sa.String(32)),
    sa.Column("deadline", sa.String(100), nullable=False, comment="its name in the configuration (deadlines:)"),
    sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("noticed_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("run_ended_at", sa.DateTime(timezone=True), comment="when the run ended (success or failure); empty: not yet"),
    sa.Column("run_state", sa.String(32)),
    sa.Column("notified", sa.String(1000), comment="the notifier told, or why it could not be"),
    sa.UniqueConstraint("dag_id", "run_id", "deadline"),
)

COLUMNS = [c.name for c in jobs.columns]


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def from_epoch(value: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(value, dt.UTC) if value else None


def aware(value: Any) -> Any:
    """SQLite gives back naive datetimes: they were written in UTC."""
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value


def default_url() -> str:
    from core import config

    return config.load().job_history.url


def parse_url(url: str) -> sa.URL:
    """``url`` parsed; ConfigError naming it and the expected shape if it is not a database URL."""
    try:
        return sa.make_url(url)
    except sa.exc.ArgumentError:
        raise ConfigError(f"job_history.url {url!r} is not a database URL: write sqlite:////absolute/path/jobs.db or "
                          "postgresql+psycopg2://user@host:5432/database") from None


def existing(url: str) -> str:
    """``url``, for a reader (an export, a quota report), unless it is a SQLite file in a folder that does not
    exist: a mistyped path, where the reader would create an empty database and report that nobody used
    anything. (A missing file in an existing folder, or under PINFLOW_HOME, is a platform that has not run a job
    yet.)"""
    from core import config

    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database).parent
        if not folder.is_dir() and not folder.is_relative_to(config.load().home):  # pinflow's own: made on first use
            raise ConfigError(f"no job history at {parsed.database} ({url}): its folder does not exist; check "
                              "job_history.url (PINFLOW_JOB_HISTORY__URL) or --url")
    return url


def engine(url: str | None = None) -> sa.Engine:
    """The engine of ``url`` (default: the configured one, resolved at each call), with the table created."""
    return _engine(url or default_url())


@functools.cache
def _engine(url: str) -> sa.Engine:
    """One engine per database URL, made on first use, with the table created.

    SQLite: the folder is created, every connection waits up to 30 s for a lock, and transactions begin with an
    explicit ``BEGIN``, write transactions (:func:`transaction`) with ``BEGIN IMMEDIATE``: the write lock is
    taken (waited for) up front, because a transaction that reads and then writes while another connection has
    committed fails at once ("database is locked") instead of waiting; WAL lets the pages read while jobs write.
    """
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        eng = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(eng, "connect")
        def _connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None  # we say when a transaction begins
            dbapi_connection.execute("PRAGMA journal_mode=WAL")
            dbapi_connection.execute("PRAGMA busy_timeout=30000")

        @sa.event.listens_for(eng, "begin")
        def _begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("pinflow_write") else "BEGIN")
    else:
        try:
            eng = sa.create_engine(url, pool_pre_ping=True)
        except (ImportError, sa.exc.NoSuchModuleError) as e:
            raise ConfigError(f"job history database {parsed.render_as_string()}: its driver is not installed ({e}): "
                              "use postgresql+psycopg2://... (installed with pinflow) or install the driver") from None
    metadata.create_all(eng)
    _add_new_columns(eng)
    return eng


def _add_new_columns(eng: sa.Engine) -> None:
    """Columns added to the table since a database was created (nullable, so old rows stay valid)."""
    have = {c["name"] for c in sa.inspect(eng).get_columns(TABLE)}
    missing = [c for c in jobs.columns if c.name not in have]
    if not missing:
        return
    with eng.connect() as conn, conn.begin():
        for column in missing:
            kind = column.type.compile(dialect=eng.dialect)
            conn.exec_driver_sql(f'ALTER TABLE {TABLE} ADD COLUMN "{column.name}" {kind}')


@contextlib.contextmanager
def transaction(url: str | None = None) -> Iterator[sa.Connection]:
    """A write transaction (on SQLite: ``BEGIN IMMEDIATE``), committed at the end, rolled back on an error."""
    with engine(url).connect() as conn:
        conn.execution_options(pinflow_write=True)
        with conn.begin():
            yield conn


@contextlib.contextmanager
def locked(key: str, url: str | None = None) -> Iterator[sa.Connection]:
    """A write transaction holding the lock row ``key`` (made on first use) for its whole block: what runs in it
    is serialised per key across processes (SQLite: the database's write lock, waited for; PostgreSQL: the row's
    lock). A team's quota admission and a model's champion moves use it; write through the connection it gives
    (another connection would wait for this one on SQLite)."""
    try:
        with transaction(url) as conn:
            if conn.execute(sa.select(team_locks.c.team).where(team_locks.c.team == key)).first() is None:
                conn.execute(sa.insert(team_locks).values(team=key, admissions=0))
    except sa.exc.IntegrityError:
        pass  # made by a concurrent caller
    with transaction(url) as conn:
        conn.execute(sa.update(team_locks).where(team_locks.c.team == key).values(admissions=team_locks.c.admissions + 1))
        yield conn


# --- writing ------------------------------------------------------------------------------------------------


def note(write: Any, *args: Any, **kwargs: Any) -> None:
    """Call a history ``write`` for a job's transition; a database that does not answer is logged, not raised:
    the history must never fail a training job (the quota check, which needs it, raises on its own)."""
    try:
        write(*args, **kwargs)
    except Exception as err:  # noqa: BLE001
        log.warning("job history: %s failed: %s", getattr(write, "__name__", write), err)


def job_ended(job: dict[str, Any], event: dict[str, Any] | None = None, error: BaseException | None = None,
              status: Any = None) -> None:
    """Record the end of an operator's ``job`` ({"backend", "job_id"}) from its trigger's event or its final
    status, and the error it was classified as (None: it succeeded)."""
    event = event or {}
    state = str(event.get("state") or "")
    if state not in ("STALLED", "QUEUE_TIMEOUT"):
        state = SUCCEEDED if error is None else FAILED
    klass = getattr(getattr(error, "failure_class", None), "value", None) or event.get("failure_class")
    times = {"started_at": event.get("started_at") or getattr(status, "started_at", None),
             "queued_s": event.get("queued_s") if event.get("queued_s") is not None else getattr(status, "queued_s", None),
             "ended_at": getattr(status, "ended_at", None)}
    note(mark_ended, job["backend"], job["job_id"], state, failure_class=None if error is None else klass,
         reason=None if error is None else str(error).split("\nlast log lines:")[0], **times)


def upsert(job_name: str, url: str | None = None, conn: sa.Connection | None = None, **fields: Any) -> None:
    """Create or update the row of ``job_name`` with ``fields`` (None values leave a column as it is)."""
    values = {k: v for k, v in fields.items() if v is not None}
    unknown = set(values) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown job history columns: {', '.join(sorted(unknown))}")
    values["updated_at"] = now()
    if conn is None:
        with transaction(url) as c:
            _upsert(c, job_name, values)
    else:
        _upsert(conn, job_name, values)


def _upsert(conn: sa.Connection, job_name: str, values: dict[str, Any]) -> None:
    done = conn.execute(sa.update(jobs).where(jobs.c.job_name == job_name).values(**values))
    if done.rowcount == 0:
        values.setdefault("state", WAITING)
        values.setdefault("team", "")
        conn.execute(sa.insert(jobs).values(job_name=job_name, **values))


def job_fields(
    *, team: str, family: str | None, ti: Any, backend: str, instance_type: str, nodes: int, procs_per_node: int,
    gpus_per_node: int, output_dir: str | None = None, checkpoint_dir: str | None = None,
) -> dict[str, Any]:
    """The row's fields that a job has from the start (its task instance and request)."""
    try_number = int(getattr(ti, "try_number", 1) or 1)
    return {
        "team": team, "family": family, "dag_id": getattr(ti, "dag_id", None), "run_id": getattr(ti, "run_id", None),
        "task_id": getattr(ti, "task_id", None),
        "map_index": -1 if getattr(ti, "map_index", None) is None else int(ti.map_index),
        "try_number": try_number, "retries": try_number - 1, "backend": backend, "instance_type": instance_type,
        "nodes": nodes, "procs_per_node": procs_per_node, "gpus_per_node": gpus_per_node, "gpus": nodes * gpus_per_node,
        "output_dir": output_dir, "checkpoint_dir": checkpoint_dir,
    }


def mark_submitted(job_name: str, job_id: str, submitted_at: dt.datetime | None = None, console_url: str = "",
                   url: str | None = None) -> None:
    """The backend accepted the job (``submitted_at``: when the request went out)."""
    upsert(job_name, url, state=SUBMITTED, job_id=job_id, submitted_at=submitted_at or now(),
           console_url=console_url or None, watched_at=now())


WATCH_EVERY_S = 60.0  # how often a waiting task says it still watches its job (far below job_history.orphan_after_s)


def mark_watched(backend: str, job_id: str, url: str | None = None) -> None:
    """A task (the operator polling, or its trigger) still watches this job: it is not orphaned."""
    with transaction(url) as conn:
        conn.execute(sa.update(jobs).where(jobs.c.backend == backend, jobs.c.job_id == job_id,
                                           jobs.c.state.in_(ACTIVE)).values(watched_at=now()))


def lease_every_s(lease_s: float) -> float:
    """How often a watcher renews a job's lease: every WATCH_EVERY_S, and at least four times per lease."""
    return min(WATCH_EVERY_S, lease_s / 4) if lease_s else WATCH_EVERY_S


class Watching:
    """From a task's polling loop: :func:`mark_watched` at most every WATCH_EVERY_S, and the job's lease in
    ``output_dir`` (``core.lease``) renewed at once, then every :func:`lease_every_s` (never raises)."""

    def __init__(self, backend: str, job_id: str, output_dir: str | None = None) -> None:
        self.backend, self.job_id, self.last = backend, job_id, time.monotonic()
        self.output_dir = output_dir
        self.lease_last = -math.inf  # a watcher that starts (a reattaching try, a restarted trigger) renews at once
        self.lease_every = WATCH_EVERY_S
        if output_dir:
            try:
                from core import config

                self.lease_every = lease_every_s(config.load().job_history.lease_s)
            except Exception as err:  # noqa: BLE001 - the default keeps the lease renewed well within 300 s
                log.warning("could not read job_history.lease_s (renewing every %.0f s): %s", WATCH_EVERY_S, err)

    def tick(self) -> None:
        if time.monotonic() - self.last >= WATCH_EVERY_S:
            self.last = time.monotonic()
            note(mark_watched, self.backend, self.job_id)
        if self.output_dir and time.monotonic() - self.lease_last >= self.lease_every:
            from core import lease

            self.lease_last = time.monotonic()
            lease.renew(self.output_dir, self.job_id)


def update_job(backend: str, job_id: str, url: str | None = None, **fields: Any) -> None:
    """Set ``fields`` on the row of a submitted job (by its backend's id)."""
    with transaction(url) as conn:
        conn.execute(sa.update(jobs).where(jobs.c.backend == backend, jobs.c.job_id == job_id)
                     .values(**fields, updated_at=now()))


def mark_running(backend: str, job_id: str, started_at: float | None, queued_s: float | None,
                 url: str | None = None) -> None:
    """The backend reports the job running: its start and how long it was queued (a trigger or a poller calls)."""
    with transaction(url) as conn:
        conn.execute(
            sa.update(jobs)
            .where(jobs.c.backend == backend, jobs.c.job_id == job_id, jobs.c.state.in_((ADMITTED, SUBMITTED)))
            .values(state=RUNNING, started_at=from_epoch(started_at) or now(), queue_wait_s=queued_s,
                    updated_at=now())
        )


def mark_ended(
    backend: str, job_id: str, state: str, *, failure_class: str | None = None, reason: str | None = None,
    started_at: float | None = None, queued_s: float | None = None, ended_at: float | None = None,
    url: str | None = None,
) -> None:
    """The job has ended: outcome, failure class, run time, GPU- and node-hours (from its start and size)."""
    end = from_epoch(ended_at) or now()
    with transaction(url) as conn:
        row = conn.execute(
            sa.select(jobs).where(jobs.c.backend == backend, jobs.c.job_id == job_id).order_by(jobs.c.id.desc())
        ).mappings().first()
        if row is None:
            return
        started = aware(row["started_at"]) or from_epoch(started_at)
        if started is None and state == SUCCEEDED:
            started = aware(row["submitted_at"])
        run_s = max(0.0, (end - started).total_seconds()) if started else 0.0
        queue_wait = row["queue_wait_s"] if row["queue_wait_s"] is not None else queued_s
        node_hours = (row["nodes"] or 0) * run_s / 3600
        try:
            cost, currency = job_cost(row["instance_type"], row["team"], node_hours)
        except Exception as err:  # noqa: BLE001 - a price that cannot be read must not lose the job's end
            log.warning("job history: no cost for job %s: %s", job_id, err)
            cost, currency = None, None
        conn.execute(
            sa.update(jobs).where(jobs.c.id == row["id"]).values(
                state=state, outcome=state, failure_class=failure_class,
                reason=(reason or None) and str(reason)[:4000], started_at=started, ended_at=end, run_s=run_s,
                queue_wait_s=queue_wait, gpu_hours=(row["gpus"] or 0) * run_s / 3600,
                node_hours=node_hours, cost=cost, currency=currency, updated_at=now(),
            )
        )


def job_cost(instance_type: str | None, team: str | None, node_hours: float) -> tuple[float | None, str]:
    """What ``node_hours`` of ``instance_type`` cost (``costs:`` of the configuration: the team's capacity's price,
    on-demand or Spot; the local backend's machine at ``costs.local_per_hour``), and the currency; None without
    a price for the type."""
    from core import config
    from core.config import LOCAL_MACHINE

    cfg = config.load()
    costs = cfg.costs
    if instance_type == LOCAL_MACHINE:
        return round(node_hours * costs.local_per_hour, 6), costs.currency
    price = costs.prices.get(instance_type or "")
    if price is None:
        return None, costs.currency
    team_config = cfg.teams.get(team or "")
    spot = price.spot if team_config is not None and team_config.capacity == "spot" else None
    return round(node_hours * (price.on_demand if spot is None else spot), 6), costs.currency


def run_cost(dag_id: str, run_id: str, url: str | None = None) -> tuple[float | None, str]:
    """What the ended jobs of one DAG run cost together (every try and trial); None when one of them has no price
    (a partial sum would read as the whole)."""
    from core import config

    currency = config.load().costs.currency
    ended = [r for r in rows(dag_id=dag_id, run_id=run_id, url=url) if r.get("ended_at") is not None]
    if not ended or any(r.get("cost") is None for r in ended):
        return None, currency
    return round(sum(float(r["cost"]) for r in ended), 6), currency


def cost_note(cost: float | None, currency: str, gain: float | None = None, over: str = "the champion",
              metric: str = "AUC") -> str:
    """Cost next to the quality it bought: ``cost 12.50 USD (4.17 USD per AUC point over the champion)``; the
    per-point figure only for a gain (``gain``: the metric's improvement, 0.03 is 3 points)."""
    if cost is None:
        return "cost unknown (a job's instance type has no price under costs.prices)"
    text = f"cost {cost:,.2f} {currency}"
    if gain is not None and gain > 0:
        text += f" ({cost / (gain * 100):,.2f} {currency} per {metric} point over {over})"
    return text


def record_alias_move(move: dict[str, Any], conn: sa.Connection) -> None:
    """One move of a champion alias (``services.champions.move``), in the caller's transaction."""
    conn.execute(sa.insert(alias_history).values(**{c.name: move.get(c.name) for c in alias_history.columns
                                                    if c.name != "id"}))


def alias_moves(model_name: str | None = None, url: str | None = None,
                conn: sa.Connection | None = None) -> list[dict[str, Any]]:
    """The recorded moves of champion aliases, oldest first (one model's, or every model's)."""
    query = sa.select(alias_history).order_by(alias_history.c.id)
    if model_name is not None:
        query = query.where(alias_history.c.model_name == model_name)
    with contextlib.nullcontext(conn) if conn is not None else engine(url).connect() as reader:
        return [{k: aware(v) for k, v in row.items()} for row in reader.execute(query).mappings()]


def record_deadline_miss(miss: dict[str, Any], url: str | None = None) -> bool:
    """A missed deadline, once per run and deadline (a callback run twice records one row); True if new."""
    with transaction(url) as conn:
        table = deadline_misses.c
        seen = conn.execute(sa.select(table.id).where(table.dag_id == miss["dag_id"], table.run_id == miss["run_id"],
                                                      table.deadline == miss["deadline"])).first()
        if seen is None:
            conn.execute(sa.insert(deadline_misses).values(**{c.name: miss.get(c.name) for c in deadline_misses.columns
                                                              if c.name != "id"}))
        return seen is None


def deadline_run_ended(dag_id: str, run_id: str, ended_at: dt.datetime, state: str, url: str | None = None) -> None:
    """The run of a missed deadline ended: how late it was is now known."""
    table = deadline_misses.c
    with transaction(url) as conn:
        conn.execute(sa.update(deadline_misses).where(table.dag_id == dag_id, table.run_id == run_id)
                     .values(run_ended_at=ended_at, run_state=state))


def deadline_misses_since(since: dt.datetime, url: str | None = None) -> list[dict[str, Any]]:
    """Missed deadlines whose deadline was at or after ``since``, newest first."""
    query = (sa.select(deadline_misses).where(deadline_misses.c.deadline_at >= since)
             .order_by(deadline_misses.c.deadline_at.desc()))
    with engine(url).connect() as conn:
        return [{k: aware(v) for k, v in row.items()} for row in conn.execute(query).mappings()]


def record_result(backend: str, job_id: str, result: dict[str, Any], url: str | None = None) -> None:
    """What the finished job produced: its MLflow run and registered model version, and the share of its step time
    spent waiting for input."""
    with transaction(url) as conn:
        conn.execute(
            sa.update(jobs).where(jobs.c.backend == backend, jobs.c.job_id == job_id).values(
                model_name=result.get("model_name"), model_version=str(result.get("model_version") or "") or None,
                mlflow_run_id=result.get("mlflow_run_id"), updated_at=now(),
                input_wait_share=(result.get("input") or {}).get("wait_share"),
            )
        )


def record_promotion(dag_id: str, run_id: str, decision: dict[str, Any], url: str | None = None) -> None:
    """The promotion gate's decision, on the run's job that produced that model version."""
    with transaction(url) as conn:
        row = conn.execute(
            sa.select(jobs.c.id).where(jobs.c.dag_id == dag_id, jobs.c.run_id == run_id, jobs.c.state == SUCCEEDED)
            .order_by(jobs.c.id.desc())
        ).first()
        if row is not None:
            conn.execute(sa.update(jobs).where(jobs.c.id == row[0]).values(
                promoted=bool(decision.get("promoted")), promotion_reason=str(decision.get("reason", ""))[:4000],
                model_version=str(decision.get("model_version") or "") or None, updated_at=now(),
            ))


# --- reading ------------------------------------------------------------------------------------------------


def get(job_name: str, url: str | None = None) -> dict[str, Any] | None:
    """The row of ``job_name``, or None."""
    with engine(url).connect() as conn:
        row = conn.execute(sa.select(jobs).where(jobs.c.job_name == job_name)).mappings().first()
    return {k: aware(v) for k, v in row.items()} if row else None


def rows(
    *, url: str | None = None, team: str | None = None, dag_id: str | None = None, run_id: str | None = None,
    states: Sequence[str] | None = None, since: dt.datetime | None = None, limit: int | None = None,
    newest_first: bool = False, backend: str | None = None, job_id: str | None = None,
) -> list[dict[str, Any]]:
    """Rows as dicts (times timezone-aware UTC), oldest first unless ``newest_first``."""
    query = sa.select(jobs)
    if backend:
        query = query.where(jobs.c.backend == backend)
    if job_id:
        query = query.where(jobs.c.job_id == job_id)
    if team:
        query = query.where(jobs.c.team == team)
    if dag_id:
        query = query.where(jobs.c.dag_id == dag_id)
    if run_id:
        query = query.where(jobs.c.run_id == run_id)
    if states:
        query = query.where(jobs.c.state.in_(list(states)))
    if since is not None:
        query = query.where(sa.func.coalesce(jobs.c.requested_at, jobs.c.submitted_at, jobs.c.updated_at) >= since)
    query = query.order_by(jobs.c.id.desc() if newest_first else jobs.c.id)
    if limit:
        query = query.limit(limit)
    with engine(url).connect() as conn:
        return [{k: aware(v) for k, v in row.items()} for row in conn.execute(query).mappings()]


def export(path: str | Path, fmt: str = "csv", **filters: Any) -> int:
    """Write the rows (``rows(**filters)``) to a CSV or Parquet file; return how many."""
    import pyarrow as pa

    table_rows = rows(**filters)
    schema = pa.schema([(c.name, _arrow_type(c.type)) for c in jobs.columns])
    table = pa.Table.from_pylist(table_rows, schema=schema)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif fmt == "csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, path)
    else:
        raise ValueError(f"unknown export format {fmt!r}: csv or parquet")
    return len(table_rows)


def _arrow_type(column_type: Any) -> Any:
    import pyarrow as pa

    if isinstance(column_type, sa.DateTime):
        return pa.timestamp("us", tz="UTC")
    if isinstance(column_type, sa.Boolean):
        return pa.bool_()
    if isinstance(column_type, sa.Integer):
        return pa.int64()
    if isinstance(column_type, sa.Float):
        return pa.float64()
    return pa.string()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.job_history", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write the job history to a CSV or Parquet file (capacity planning)")
    exp.add_argument("--out", required=True, help="the file to write")
    exp.add_argument("--format", choices=("csv", "parquet"), help="default: from the file's suffix, else csv")
    exp.add_argument("--since", type=since_day,
                     help="only jobs requested on or after this day: YYYY-MM-DD, today, yesterday or <N>d")
    exp.add_argument("--team", help="only this team's jobs")
    exp.add_argument("--url", help="the database (default: job_history.url of the platform configuration)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"--out {args.out} is a folder: give a file name, e.g. {out / 'jobs.csv'}")
    if not out.parent.is_dir():
        parser.error(f"--out {args.out}: the folder {out.parent} does not exist")
    fmt = args.format or ("parquet" if args.out.endswith(".parquet") else "csv")
    with cli_errors("export"):
        url = existing(args.url or default_url())
        count = export(args.out, fmt, url=url, team=args.team, since=args.since)
        print(f"wrote {count} job(s) to {args.out} ({fmt}) from {parse_url(url).render_as_string()}")
        return 0
    return 1


def since_day(text: str) -> dt.datetime:
    """``--since``: a day (YYYY-MM-DD), ``today``, ``yesterday`` or ``<N>d`` (N days ago), as UTC midnight."""
    word = text.strip().lower()
    days_ago = {"today": "0", "yesterday": "1"}.get(word, word.removesuffix("d") if word.endswith("d") else "")
    try:
        day = (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=int(days_ago)) if days_ago.isdigit()
               else dt.date.fromisoformat(word))
        return dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a day: write YYYY-MM-DD, today, yesterday or 7d") from None


@contextlib.contextmanager
def cli_errors(what: str) -> Iterator[None]:
    """One line, not a traceback, for what a user of a command can fix: a bad URL or setting, a database that
    does not answer. The command then exits 1 (the ``return 1`` after the ``with``)."""
    try:
        yield
    except ConfigError as e:
        print(f"error: {what}: {e}", file=sys.stderr)
    except sa.exc.OperationalError as e:
        print(f"error: {what}: the job history database does not answer ({str(e.orig).strip().splitlines()[0]}): "
              "start it, or fix job_history.url (PINFLOW_JOB_HISTORY__URL)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
