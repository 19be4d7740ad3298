"""pinflow's Airflow plugin: a listener that records job data for capacity planning, and extra links.

Every finished task instance of a pinflow DAG appends one JSON line (dag, task, run, try, state,
duration, the failure's class and message) to ``<PINFLOW_HOME>/jobdata/task_runs.jsonl``.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any

from airflow.listeners import hookimpl
from airflow.plugins_manager import AirflowPlugin

PINFLOW_DAGS = ("pin_daily_features", "pin_ranker_training", "pin_corpus_inference")


def _record(task_instance: Any, state: str, error: BaseException | str | None = None) -> None:
    if getattr(task_instance, "dag_id", None) not in PINFLOW_DAGS:
        return
    from core.config import pinflow_home

    start = getattr(task_instance, "start_date", None)
    now = dt.datetime.now(dt.UTC)
    row = {
        "time": now.isoformat(),
        "dag_id": task_instance.dag_id,
        "task_id": task_instance.task_id,
        "run_id": task_instance.run_id,
        "map_index": getattr(task_instance, "map_index", -1),
        "try_number": getattr(task_instance, "try_number", None),
        "state": state,
        "seconds": (now - start).total_seconds() if start else None,
        "failure_class": getattr(getattr(error, "failure_class", None), "value", None),
        "error": str(error)[:2000] if error else None,
    }
    path = pinflow_home() / "jobdata" / "task_runs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:  # one short line per append: safe with concurrent writers
        f.write(json.dumps(row, default=str) + "\n")


@hookimpl
def on_task_instance_success(previous_state: Any, task_instance: Any) -> None:
    _record(task_instance, "success")


@hookimpl
def on_task_instance_failed(previous_state: Any, task_instance: Any, error: BaseException | str | None) -> None:
    _record(task_instance, "failed", error)


def _operator_extra_links() -> list[Any]:
    # Registered here so that the API server, which deserializes DAGs, can show the validation tasks'
    # "Data Docs" button and the training task's job console and MLflow run buttons (the link class must
    # be known to the plugin manager).
    from operators.training import JobConsoleLink, MlflowRunLink
    from operators.validation import DataDocsLink

    return [DataDocsLink(), JobConsoleLink(), MlflowRunLink()]


class PinflowPlugin(AirflowPlugin):
    name = "pinflow"
    listeners = [sys.modules[__name__]]
    operator_extra_links = _operator_extra_links()
