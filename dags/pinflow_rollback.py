"""Rollback DAG: move a family's champion alias back to an earlier version, recorded, and re-score the corpus."""

from __future__ import annotations

from typing import Any

# The Airflow modules the operators below import, named so that the DAG processor imports them once, before
# it forks the parses (parsing_pre_import_modules), instead of in every parse (docs/architecture.md).
import airflow.sdk.definitions.retry_policy  # noqa: F401
import pendulum
from airflow.sdk import DAG, Param, task

from core import config_view
from operators.assets import CHAMPION_MODEL_ASSET
from operators.errors import default_args

_cfg = config_view.load()

with DAG(
    dag_id="pinflow_rollback",
    doc_md="""
### Roll a champion back

Moves the `champion` alias of a family's registered model (`model`) back to `to_version`, with a `reason`. The
version must be one of that model's registered versions (a version number of another family's model, or one that
does not exist, is refused with the versions there are, and nothing moves). The move is recorded like every
promotion (`services/champions.py`): a row of the alias history (when, by whom, from which version, why: the
*Models* page shows it) and tags on both versions in MLflow. Its champion asset event then starts
`pin_corpus_inference`, which re-scores the whole corpus with the restored version (the scores of a version are
keyed by it, so nothing of the version rolled away from is reused).
""",
    schedule=None,
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["pinflow", "registry"],
    default_args=default_args("ml-eng"),
    params={
        "model": Param(_cfg.training.model, enum=sorted(_cfg.families), description="The model family whose champion moves back."),
        "to_version": Param("", type="string", pattern="^[0-9]+$", description="The registered version to make champion again (the Models page lists them)."),
        "reason": Param("", type="string", minLength=3, description="Why: recorded with the move (alias history, MLflow tags)."),
    },
    render_template_as_native_obj=True,
) as dag:

    @task(outlets=[CHAMPION_MODEL_ASSET])
    def rollback(params: dict | None = None, dag_run: Any = None, outlet_events: Any = None, dag: Any = None) -> dict:
        from airflow.sdk.exceptions import AirflowSkipException

        from operators.run_conf import check_run_conf
        from services import champions

        assert params is not None
        check_run_conf({"dag_run": dag_run, "params": params, "dag": dag})
        user = getattr(dag_run, "triggering_user_name", None) or "an unnamed user"
        move = champions.rollback(str(params["model"]), str(params["to_version"]), str(params["reason"]),
                                  moved_by=f"{user} via {dag_run.dag_id}/{dag_run.run_id}")
        if not move["moved"]:
            raise AirflowSkipException(move["reason"])  # no event: nothing to re-score
        # Corpus inference re-scores the corpus with the restored champion (the event names family and version).
        outlet_events[CHAMPION_MODEL_ASSET].extra = {"model": move["model"], "model_version": move["to_version"]}
        return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in move.items()}

    rollback()
