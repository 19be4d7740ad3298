"""pinflow's Airflow plugin: pages in the Airflow UI, a listener that records task data, and extra links.

- Pages: a FastAPI app (``pinflow_ui.web``) mounted on the API server under ``/pinflow`` and shown in the UI's
  navigation through ``external_views`` (menu *Pinflow*: Platform, Training runs, Data quality, Models) and as a
  *Training progress* tab of every DAG run. Its routes need an authenticated user as Airflow's own API does.
- Every finished task instance of a pinflow DAG appends one JSON line (dag, task, run, try, state, duration, the
  failure's class and message) to ``<PINFLOW_HOME>/jobdata/task_runs.jsonl`` (the Platform page's task outcomes);
  the compute jobs themselves are in the job history database (``services.job_history``).
- The operators' extra links ("Data Docs", "Training job", "MLflow run"), all ``http(s)``: ``operators.links``.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from typing import Any

from airflow.listeners import hookimpl
from airflow.plugins_manager import AirflowPlugin

# Every DAG in dags/ (a test keeps the list complete): the listener records their tasks only.
PINFLOW_DAGS = ("pin_daily_features", "pin_ranker_training", "pin_corpus_inference", "pinflow_hpo", "pinflow_rollback")


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
        "failure_class": _failure_class(error),
        "error": str(error)[:2000] if error else None,
    }
    path = pinflow_home() / "jobdata" / "task_runs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:  # one short line per append: safe with concurrent writers
        f.write(json.dumps(row, default=str) + "\n")


def _failure_class(error: BaseException | str | None) -> str | None:
    """The class of a failure's exception (``core.failures.classify``: typed errors carry theirs, any other is
    classified by what it is); None where Airflow gives no exception (a task marked failed, a worker lost)."""
    if not isinstance(error, BaseException):
        return None
    from core.failures import classify

    return classify(error).value


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


class PagesApp:
    """The pages' ASGI app, built on its first request: only the API server serves it, and every other Airflow
    process that loads this plugin (scheduler, workers, triggerer) never imports the web code."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            from pinflow_ui.web import create_app  # plugins/pinflow_ui, on sys.path as the plugins folder

            self._app = create_app()
        await self._app(scope, receive, send)


URL_PREFIX = "/pinflow"  # operators.links.URL_PREFIX

EXTERNAL_VIEWS = [
    {"name": "Platform", "href": "pinflow/platform", "url_route": "pinflow-platform", "destination": "nav",
     "category": "Pinflow"},
    {"name": "Training runs", "href": "pinflow/runs", "url_route": "pinflow-runs", "destination": "nav",
     "category": "Pinflow"},
    {"name": "Data quality", "href": "pinflow/data-quality", "url_route": "pinflow-data-quality", "destination": "nav",
     "category": "Pinflow"},
    {"name": "Models", "href": "pinflow/models", "url_route": "pinflow-models", "destination": "nav",
     "category": "Pinflow"},
    # A tab on every DAG run's page: the run's training job, live.
    {"name": "Training progress", "href": "pinflow/runs/{DAG_ID}/{RUN_ID}", "url_route": "pinflow-run",
     "destination": "dag_run"},
]


def _run_listeners() -> list[Any]:
    """The DAG-run listeners: run notes (the HPO study's summary, the promotion decision: operators/run_notes.py) and
    the end of a run with a missed deadline (operators/deadlines.py)."""
    from operators import deadlines, run_notes

    return [run_notes, deadlines]


class PinflowPlugin(AirflowPlugin):
    name = "pinflow"
    listeners = [sys.modules[__name__], *_run_listeners()]
    operator_extra_links = _operator_extra_links()
    fastapi_apps = [{"app": PagesApp(), "url_prefix": URL_PREFIX, "name": "pinflow pages"}]
    external_views = EXTERNAL_VIEWS
