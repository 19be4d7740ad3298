"""The `pin_daily_features` form is backfill-safe: the `ds` param never pins a backfilled run to another day.

The UI's Backfill dialog offers the DAG's params; a `ds` filled in there is sent as every backfilled run's conf.
Each task's day is rendered from the run: a backfill run builds its own day whatever `params.ds` says; a run
triggered from the form builds `params.ds` when given. (tests/integration/test_production_stack.py posts such a
backfill through the REST API and checks that each day was built.)
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS / "pin_daily_features.py"))
    assert bag.import_errors == {}
    return bag.dags["pin_daily_features"]


def rendered_days(dag, run_type: str, params_ds: str | None, ds: str = "2026-11-02") -> set[str]:
    env = dag.get_template_env()
    context = {"ds": ds, "params": {"ds": params_ds}, "dag_run": SimpleNamespace(run_type=run_type)}
    templates = {task.ds for task in dag.tasks if isinstance(getattr(task, "ds", None), str)}
    assert templates, "no task takes its day from a template"
    return {str(env.from_string(template).render(**context)) for template in templates}


@pytest.mark.parametrize("run_type", ["backfill", "scheduled"])
def test_a_backfilled_or_scheduled_run_builds_its_own_day(dag, run_type: str):
    from airflow.utils.types import DagRunType

    assert DagRunType(run_type).value == run_type  # the run types the template compares with
    assert rendered_days(dag, DagRunType(run_type), params_ds=None) == {"2026-11-02"}
    if run_type == "backfill":
        # What the Backfill dialog sends when its form's `ds` is filled: ignored.
        assert rendered_days(dag, DagRunType(run_type), params_ds="2026-11-05") == {"2026-11-02"}


@pytest.mark.parametrize("run_type", ["manual", "asset_triggered"])
def test_a_triggered_run_builds_the_day_of_its_form(dag, run_type: str):
    assert rendered_days(dag, run_type, params_ds="2026-11-05") == {"2026-11-05"}
    assert rendered_days(dag, run_type, params_ds=None) == {"2026-11-02"}


def test_the_form_says_that_backfills_ignore_ds(dag):
    assert "Ignored by backfills" in dag.params.get_param("ds").description
    assert "unpause" in dag.doc_md
