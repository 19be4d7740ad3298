"""DAG run notes written from what a run's tasks decided: the HPO study's summary (``pinflow_hpo``) and the
promotion gate's decision (``pin_ranker_training``).

Airflow 3.3's Task SDK lets a task read its DAG run's note but not write it, so the task pushes the note's
content to XCom and this listener, called where the run's state changes (the scheduler, or ``dag.test()``),
copies it into the run's note. A note the user gave the run is kept above it. One of the listeners of the
pinflow plugin (``plugins/pinflow_plugin.py``), which every Airflow component loads from the plugins folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)

SEPARATOR = "\n\n---\n"
MARK = "**Optuna study**"  # the HPO summary's first words (operators.hpo.run_note)
PROMOTION_MARK = "**Promotion**"


def promotion_note(decision: Any) -> str | None:
    """The promotion gate's decision as a note: version, promoted or not, and why."""
    if not isinstance(decision, dict) or "promoted" not in decision:
        return None
    verdict = "promoted to champion" if decision["promoted"] else "not promoted"
    cost = f" ({decision['cost_note']})" if decision.get("cost_note") else ""
    return (f"{PROMOTION_MARK}: {decision.get('model_name')} version {decision.get('model_version')} {verdict}{cost}: "
            f"{decision.get('reason', '')}")


@dataclass(frozen=True)
class RunNote:
    """Where a DAG's note comes from: a task's XCom, turned into text; ``mark`` starts the text."""

    task_id: str
    key: str
    text: Callable[[Any], str | None]
    mark: str


NOTES: dict[str, RunNote] = {
    "pinflow_hpo": RunNote("summary", "return_value", lambda v: v.get("note") if isinstance(v, dict) else None, MARK),
    "pin_ranker_training": RunNote("promote", "decision", promotion_note, PROMOTION_MARK),
}


def merged_note(existing: str | None, summary_note: str, mark: str = MARK) -> str:
    """The user's own note (if any) above the platform's; a previous platform note is replaced."""
    own = (existing or "").split(mark)[0].rstrip().removesuffix("---").rstrip()
    return f"{own}{SEPARATOR}{summary_note}" if own else summary_note


def set_run_note(dag_run: Any) -> None:
    """Copy the note its task pushed into the run's note (DAGs of ``NOTES`` only).

    In the scheduler the run is bound to the scheduler's session, which commits the note with the run's state (a
    second session there would wait on the row the scheduler holds). ``dag.test()`` passes a run bound to no
    session: the note is written in a session of its own.
    """
    if getattr(dag_run, "dag_id", None) not in NOTES:
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
        log.warning("could not set the note of %s run %s: %s", dag_run.dag_id, getattr(dag_run, "run_id", "?"), err)


def _write_note(session: Any, dag_run: Any) -> None:
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    source = NOTES[dag_run.dag_id]
    row = session.scalar(select(XComModel).where(
        XComModel.dag_id == dag_run.dag_id, XComModel.run_id == dag_run.run_id,
        XComModel.task_id == source.task_id, XComModel.key == source.key, XComModel.map_index == -1,
    ))
    if row is None:
        log.info("no %s XCom of %s in %s run %s: no note", source.key, source.task_id, dag_run.dag_id, dag_run.run_id)
        return
    note = source.text(XComModel.deserialize_value(row))
    if note:
        dag_run.note = merged_note(dag_run.note, str(note), source.mark)
        log.info("note of %s run %s: %s", dag_run.dag_id, dag_run.run_id, note.splitlines()[0])


@hookimpl
def on_dag_run_success(dag_run: Any, msg: str) -> None:
    set_run_note(dag_run)


@hookimpl
def on_dag_run_failed(dag_run: Any, msg: str) -> None:
    set_run_note(dag_run)

