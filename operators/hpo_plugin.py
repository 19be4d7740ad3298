"""The HPO DAG's run note: the study's summary, written when a ``pinflow_hpo`` run ends.

Airflow 3.3's Task SDK lets a task read its DAG run's note but not write it, so the ``summary`` task returns the
note in its XCom (``note``) and this listener, called where the run's state changes (the scheduler, or
``dag.test()``), copies it into the run's note. A note the user gave the run is kept above it. One of the listeners of
the pinflow plugin (``plugins/pinflow_plugin.py``), which every Airflow component loads from the plugins folder.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)

DAG_ID = "pinflow_hpo"
SUMMARY_TASK = "summary"
SEPARATOR = "\n\n---\n"
MARK = "**Optuna study**"


def merged_note(existing: str | None, summary_note: str) -> str:
    """The user's own note (if any) above the study's summary; a previous summary is replaced."""
    own = (existing or "").split(MARK)[0].rstrip().removesuffix("---").rstrip()
    return f"{own}{SEPARATOR}{summary_note}" if own else summary_note


def set_run_note(dag_run: Any) -> None:
    """Copy the ``summary`` task's note into the run's note.

    In the scheduler the run is bound to the scheduler's session, which commits the note with the run's state (a
    second session there would wait on the row the scheduler holds). ``dag.test()`` passes a run bound to no
    session: the note is written in a session of its own.
    """
    if getattr(dag_run, "dag_id", None) != DAG_ID:
        return
    try:
        from sqlalchemy.orm import object_session

        session = object_session(dag_run)
        if session is not None:
            _write_note(session, dag_run)
            return
        from airflow.models.dagrun import DagRun
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as own:
            run = own.scalar(select(DagRun).where(DagRun.dag_id == dag_run.dag_id, DagRun.run_id == dag_run.run_id))
            if run is not None:
                _write_note(own, run)
    except Exception as err:  # noqa: BLE001 - a note is never worth a scheduler error
        log.warning("could not set the note of %s run %s: %s", DAG_ID, getattr(dag_run, "run_id", "?"), err)


def _write_note(session: Any, dag_run: Any) -> None:
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    row = session.scalar(select(XComModel).where(
        XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id,
        XComModel.task_id == SUMMARY_TASK, XComModel.key == "return_value", XComModel.map_index == -1,
    ))
    if row is None:
        log.warning("no summary XCom for %s run %s: no note", DAG_ID, dag_run.run_id)
        return
    summary = XComModel.deserialize_value(row)
    note = summary.get("note") if isinstance(summary, dict) else None
    if note:
        dag_run.note = merged_note(dag_run.note, str(note))
        log.info("note of %s run %s: the study's summary", DAG_ID, dag_run.run_id)


@hookimpl
def on_dag_run_success(dag_run: Any, msg: str) -> None:
    set_run_note(dag_run)


@hookimpl
def on_dag_run_failed(dag_run: Any, msg: str) -> None:
    set_run_note(dag_run)

