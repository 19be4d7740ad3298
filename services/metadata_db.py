"""Make Airflow's SQLite metadata database (the embedded default) safe for concurrent writers.

Airflow runs on SQLite in WAL mode with Python's ``sqlite3`` driver in its legacy transaction mode, where a
``SAVEPOINT`` issued outside a transaction starts one of its own and its ``RELEASE`` commits it. Airflow
wraps each backfill day (``models/backfill.py``) and each asset event (``assets/manager.py``) in
``session.begin_nested()``, so on SQLite:

* the transaction the savepoint opened reads first and writes later; when another process (the scheduler)
  commits in between, SQLite refuses the write at once with ``database is locked`` (``SQLITE_BUSY_SNAPSHOT``:
  the busy timeout does not apply), so a backfill created while the scheduler runs fails at random;
* each released savepoint is already committed, so the caller's rollback undoes nothing. When the backfill
  then fails, Airflow's clean-up deletes every ``dag_run`` whose ``backfill_id`` is the new backfill's, which
  includes the existing runs it had just taken over: runs are lost, and a scheduler holding them dies with
  ``StaleDataError``.

The fix is the driver-level one SQLAlchemy documents for SQLite: a savepoint outside a transaction first
opens a real one with ``BEGIN IMMEDIATE``, which takes the write lock up front (waiting up to the busy
timeout instead of failing) and makes the savepoint nest, so a rollback undoes the whole unit. Writes that
do not use savepoints are unchanged. Every connection also waits at least ``BUSY_TIMEOUT_MS`` for the lock.

Loaded in every Airflow process (API server, scheduler, DAG processor, triggerer, CLI) by
``plugins/airflow_local_settings.py``; it does nothing for other databases.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

# Longer than any transaction the scheduler holds on a loaded laptop; sqlite3's default is 5 s.
BUSY_TIMEOUT_MS = 30_000


def _in_transaction(dbapi_connection: Any) -> bool:
    """``sqlite3.Connection.in_transaction``, also through aiosqlite's adapter (which wraps it twice)."""
    if isinstance(dbapi_connection, sqlite3.Connection):
        return dbapi_connection.in_transaction
    return bool(getattr(getattr(dbapi_connection, "_connection", None), "in_transaction", False))


def _wait_for_lock(dbapi_connection: Any, connection_record: Any) -> None:
    if not _is_sqlite(dbapi_connection):
        return
    cursor = dbapi_connection.cursor()  # the DB-API cursor: also right for aiosqlite's worker thread
    try:
        cursor.execute("PRAGMA busy_timeout")
        (current,) = cursor.fetchone()
        if current < BUSY_TIMEOUT_MS:  # a longer timeout from the connect args stays
            cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _is_sqlite(dbapi_connection: Any) -> bool:
    return isinstance(dbapi_connection, sqlite3.Connection) or type(dbapi_connection).__name__.startswith(
        "AsyncAdapt_aiosqlite"
    )


def _begin_before_savepoint(conn: Connection, name: str | None) -> None:
    if conn.dialect.name == "sqlite" and not _in_transaction(conn.connection.dbapi_connection):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def install() -> None:
    """Register the listeners on every engine of this process; calling it again changes nothing."""
    if not event.contains(Engine, "connect", _wait_for_lock):
        event.listen(Engine, "connect", _wait_for_lock)
    if not event.contains(Engine, "savepoint", _begin_before_savepoint):
        event.listen(Engine, "savepoint", _begin_before_savepoint)
