"""The SQLite settings of Airflow's metadata database: savepoints nest in a real transaction that holds the lock."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from services import metadata_db


@pytest.fixture
def engine(tmp_path: Path):
    metadata_db.install()
    metadata_db.install()  # twice, as Airflow may import its local settings twice: no second listener
    db = tmp_path / "airflow.db"
    with sqlite3.connect(db) as con:
        con.execute("PRAGMA journal_mode=WAL")  # as Airflow sets it
        con.execute("CREATE TABLE dag_run (day TEXT)")
        con.execute("CREATE TABLE other (at REAL)")
    engine = create_engine(f"sqlite:///{db}")
    yield engine, db
    engine.dispose()


@pytest.mark.unit
def test_rollback_undoes_a_released_savepoint(engine):
    engine, db = engine
    with engine.connect() as conn:
        with conn.begin_nested():  # what Airflow's backfill does for each day
            conn.execute(text("INSERT INTO dag_run VALUES ('2026-11-01')"))
        conn.rollback()
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM dag_run").fetchone() == (0,)


@pytest.mark.unit
def test_read_then_write_in_a_savepoint_waits_for_a_concurrent_writer(engine):
    """Without the settings the write fails at once with 'database is locked' (SQLITE_BUSY_SNAPSHOT)."""
    engine, db = engine
    stop = threading.Event()
    commits = 0

    def neighbour() -> None:
        nonlocal commits
        con = sqlite3.connect(db, timeout=30)
        while not stop.is_set():
            con.execute("INSERT INTO other VALUES (?)", (time.time(),))
            con.commit()
            commits += 1
        con.close()

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        for _ in range(20):
            with engine.connect() as conn:
                with conn.begin_nested():
                    conn.execute(text("SELECT count(*) FROM other")).all()
                    time.sleep(0.005)  # the neighbour commits meanwhile
                    conn.execute(text("INSERT INTO dag_run VALUES ('2026-11-01')"))
                conn.commit()
    finally:
        stop.set()
        thread.join()
    assert commits > 0
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM dag_run").fetchone() == (20,)


@pytest.mark.unit
def test_every_connection_waits_for_the_lock(engine, tmp_path: Path):
    engine, _ = engine
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == metadata_db.BUSY_TIMEOUT_MS
    longer = create_engine(f"sqlite:///{tmp_path / 'x.db'}", connect_args={"timeout": 120})
    with longer.connect() as conn:  # a longer timeout from the connect args stays
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 120_000
    longer.dispose()
