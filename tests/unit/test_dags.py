"""The DAG files: they import cleanly, cheaply, and say what they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[2] / "dags"
HEAVY = ("torch", "pandas", "great_expectations", "duckdb", "boto3", "mlflow", "pyarrow")
EXPECTED = {"pin_daily_features", "pin_ranker_training", "pin_corpus_inference", "pinflow_hpo", "pinflow_rollback"}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.mark.unit
def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == EXPECTED


@pytest.mark.unit
def test_every_dag_is_documented_tagged_and_retried(dagbag):
    for dag_id in EXPECTED:
        dag = dagbag.dags[dag_id]
        assert dag.doc_md and len(dag.doc_md) > 100, dag_id
        assert "pinflow" in dag.tags, dag_id
        assert dag.params, f"{dag_id} has no typed params"
        for task in dag.tasks:
            if task.task_id.startswith("validate_") or task.task_id.startswith("plan_"):
                assert task.retries == 0, f"{dag_id}.{task.task_id}: a DATA check must not retry"
            else:
                assert task.retries >= 2, f"{dag_id}.{task.task_id}"
            assert task.retry_policy is not None


@pytest.mark.unit
def test_every_dag_serializes_as_the_dag_processor_sends_it(dagbag):
    """What the DAG processor stores and the scheduler runs is the serialized DAG: every DAG must round-trip."""
    from airflow.serialization.serialized_objects import DagSerialization

    for dag_id in EXPECTED:
        dag = dagbag.dags[dag_id]
        again = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        assert set(again.task_dict) == set(dag.task_dict), dag_id
        assert set(again.params) == set(dag.params), dag_id


@pytest.mark.unit
def test_backend_param_is_an_enum(dagbag):
    param = dagbag.dags["pin_ranker_training"].params.get_param("backend")
    assert param.schema["enum"] == ["local", "batch", "kubernetes"]
    assert param.value == "local"


HELLO = """
import pendulum
from airflow.sdk import DAG, task

with DAG(dag_id="hello", start_date=pendulum.datetime(2026, 11, 1, tz="UTC"), schedule=None):
    task(lambda: None, task_id="hello")()
"""


@pytest.mark.unit
@pytest.mark.parametrize("dag_file", sorted(p.name for p in DAGS.glob("*.py")))
def test_parsing_imports_nothing_heavy_and_no_airflow_module_it_does_not_name(dag_file):
    """Importing a DAG file (what the DAG processor does) must not load heavy modules; and every Airflow module its
    parse imports beyond what any DAG's does is named in the file, so that the DAG processor imports it once before
    it forks the parses (parsing_pre_import_modules) instead of in every parse."""
    path = str(DAGS / dag_file)
    code = f"""
import importlib, json, runpy, sys
import airflow.dag_processing.dagbag  # the DAG processor's own (its parent has it)
from airflow.utils.file import iter_airflow_imports
for module in iter_airflow_imports({path!r}):
    importlib.import_module(module)
exec({HELLO!r}, {{}})
before = set(sys.modules)
runpy.run_path({path!r})
print(json.dumps({{"heavy": sorted(m for m in {HEAVY!r} if m in sys.modules),
                  "airflow": sorted(m for m in set(sys.modules) - before if m.startswith("airflow."))}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["heavy"] == []
    assert found["airflow"] == [], f"{dag_file}: name these Airflow modules in the file (see its pre-import block)"


@pytest.mark.unit
@pytest.mark.parametrize("dag_file", ["pin_daily_features.py", "pin_ranker_training.py", "pinflow_hpo.py"])
def test_the_busiest_dags_parse_without_taskflow(dag_file):
    """TaskFlow's modules cost a parse most of a hello DAG's; these DAGs' own tasks are plain operators, so that
    each parses within 2x of a hello DAG (benchmarks/dag_parse.py). A `@task` added to one of them fails here."""
    path = str(DAGS / dag_file)
    code = f"""
import importlib, runpy, sys
import airflow.dag_processing.dagbag  # the DAG processor's own (its parent has it)
from airflow.utils.file import iter_airflow_imports
for module in iter_airflow_imports({path!r}):
    importlib.import_module(module)
runpy.run_path({path!r})
print("airflow.sdk.definitions.decorators" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False", f"{dag_file}: its parse imports TaskFlow (a @task?)"


@pytest.mark.unit
def test_no_taskflow_argument_is_named_like_a_context_key(dagbag):
    """A TaskFlow task given a positional argument named like a context key ("ds") fails every run at execution
    ("The key 'ds' in args is a part of kwargs and therefore reserved"), which parsing does not show."""
    import inspect

    from airflow.sdk.definitions.context import KNOWN_CONTEXT_KEYS

    for dag in dagbag.dags.values():
        for task in dag.tasks:
            callable_ = getattr(task, "python_callable", None)
            if callable_ is None:
                continue
            positional = list(inspect.signature(callable_).parameters)[: len(getattr(task, "op_args", ()) or ())]
            clashes = [name for name in positional if name in KNOWN_CONTEXT_KEYS]
            assert not clashes, f"{dag.dag_id}.{task.task_id}: argument(s) {clashes} are context keys"
