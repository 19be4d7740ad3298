"""Real data through the "Bring your own data" path of docs/data.md, and the promotion gate on it through the training DAG.

MovieLens 100K (real ratings, read from the ``recbole`` package's copy: ``features.movielens``) is landed on the
raw contract by the converter's command, validated and built by the validation and build commands (their ``main``,
in this process: the same code and configuration), then trained through ``pin_ranker_training`` with
``dag.test()`` in a subprocess (this file is the driver: ``python test_real_data.py run '<scenarios>'``):

1. a hostile trigger as the family's first model, ``lr`` 1e-6 (2 days, batch 64): it trains its full length and is below the floors
   (a head under the popularity baseline): not promoted, no champion, no champion asset event;
2. the platform's defaults, evaluated on the day before the last: the ranker beats popularity by at least 0.02
   AUC on click and on repin, and as the family's first model that clears every floor it becomes the champion;
3. the hostile trigger ``{"end_ds": <a day before the champion's>, "train_days": 2, "max_steps": 1}``: the job
   evaluates the champion on that day, and the gate refuses the 1-step model of older data, naming both;
4. ``{"batch_size": 65536, "train_days": 30, "promotion_tolerance": 0.1}`` with 11 days: a USER error before any
   training, naming the days there are and how to go on;
5. ``{"end_ds": <the 4th day>, "train_days": 12, "accept_fewer_days": true}``: trains on the 3 days there are and is
   not promoted;
6. the defaults on the last day: the champion (evaluated on another day when it was trained) is evaluated on this
   run's day by its job, and the gate decides by that comparison alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
DAYS = [f"2026-11-{d:02d}" for d in range(1, 13)]
EMBEDDING_DIM = "19"  # MovieLens genres (features.movielens)

pytestmark = pytest.mark.integration


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def _scenario(dag: Any, conf: dict[str, Any]) -> dict[str, Any]:
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    dr = dag.test(run_conf=conf)
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    train = dr.get_task_instance("train").xcom_pull(task_ids="train") if states.get("train") == "success" else None
    decision = dr.get_task_instance("promote").xcom_pull(task_ids="promote", key="decision")
    with create_session() as session:
        events = session.query(AssetEvent).filter(AssetEvent.source_run_id == dr.run_id).count()
    return {"conf": conf, "state": str(dr.state), "tasks": states, "result": train, "decision": decision,
            "asset_events": events}


def _run(scenarios: list[dict[str, Any]]) -> None:
    from airflow.dag_processing.dagbag import DagBag

    for conf in scenarios:
        # A DAG parsed anew for each run: dag.test() keeps a run's conf in the DAG's params (a later run without
        # `lr` would train with the earlier run's) and its rendered templates in the tasks.
        dag = DagBag(dag_folder=str(REPO / "dags")).dags["pin_ranker_training"]
        print("SUMMARY " + json.dumps(_scenario(dag, conf), default=str), flush=True)


# -- the world ------------------------------------------------------------------------------------------------
def _env(home: Path) -> dict[str, str]:
    # The nodes' preflight is another torchrun launch per run, tested on its own (test_train_torchrun, the GPU check).
    return {"PINFLOW_HOME": str(home), "PINFLOW_VALIDATION__EMBEDDING_DIM": EMBEDDING_DIM,
            "PINFLOW_VALIDATION__DATA_DOCS": "false", "PINFLOW_TRAINING__POLL_SECONDS": "0.5",
            "PINFLOW_TRAINING__PREFLIGHT": "false"}


@pytest.fixture(scope="module")
def movielens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PINFLOW_HOME with MovieLens 100K landed as 12 days, every partition validated and every day built."""
    from core import config
    from features import build
    from features.validate import main as validate

    home = tmp_path_factory.mktemp("movielens")
    root = home / "storage"
    land = subprocess.run([sys.executable, "-m", "features.movielens", "--root", str(root), "--start", DAYS[0],
                           "--days", str(len(DAYS))], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert land.returncode == 0, land.stderr
    assert "landed 100000 ratings" in land.stdout
    with pytest.MonkeyPatch.context() as patch:
        for name, value in _env(home).items():
            patch.setenv(name, value)
        config.load.cache_clear()
        try:
            for ds in DAYS:
                for dataset in ("events", "pins", "users"):
                    assert validate([dataset, "--root", str(root), "--ds", ds]) == 0, (dataset, ds)
                assert build.main(["--root", str(root), "--ds", ds]) == 0, ds
        finally:
            config.load.cache_clear()
    return home


@pytest.fixture(scope="module")
def runs(movielens: Path, airflow_db: Path) -> list[dict[str, Any]]:
    scenarios = [
        {"lr": 0.000001, "train_days": 2, "batch_size": 64},
        {"end_ds": DAYS[-2]},
        {"end_ds": DAYS[-3], "train_days": 2, "max_steps": 1},
        {"batch_size": 65536, "train_days": 30, "promotion_tolerance": 0.1},
        {"end_ds": DAYS[3], "train_days": 12, "accept_fewer_days": True, "batch_size": 128},
        {},
    ]
    env = {**os.environ, **_env(movielens), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE), "run", json.dumps(scenarios)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    summaries = [json.loads(line[len("SUMMARY "):]) for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summaries) == len(scenarios), f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return summaries


def _champion(home: Path) -> str | None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        return str(client.get_model_version_by_alias("pin_ranker", "champion").version)
    except Exception:  # noqa: BLE001 - no alias yet
        return None


def test_a_model_below_the_floors_is_not_the_first_champion(runs):
    first = runs[0]
    assert first["tasks"] == {"plan_run": "success", "train": "success", "approve": "success", "promote": "skipped"}, first
    decision, result = first["decision"], first["result"]
    assert not decision["promoted"] and decision["champion_version"] is None
    assert result["steps"] >= 100 and result["champion"] is None  # trained its full length; no champion to compare
    assert "is below the baseline's" in decision["reason"], decision["reason"]
    assert first["asset_events"] == 0  # no champion event: corpus inference does not rescore for it


def test_at_the_defaults_the_ranker_beats_popularity_on_real_data_and_becomes_the_first_champion(runs, movielens):
    default = runs[1]
    assert default["tasks"] == {"plan_run": "success", "train": "success", "approve": "success", "promote": "success"}, \
        default
    result = default["result"]
    metrics = result["metrics"]
    lift = {head: metrics["auc"][head] - metrics["baseline_auc"][head] for head in metrics["auc"]}
    assert lift["click"] >= 0.02 and lift["repin"] >= 0.02, (metrics["auc"], metrics["baseline_auc"])
    # 7 days of ~8,300 ratings are 57 steps an epoch at 2 x 512: the run took passes until min_steps (100).
    assert result["steps"] >= 100 and result["epochs"] >= 2 and len(result["train_days"]) == 7
    assert result["eval_ds"] == DAYS[-2]
    assert not [w for w in result["warnings"] if "min_steps" in w or "warmup" in w or "days asked" in w], result["warnings"]
    decision = default["decision"]
    assert decision["promoted"] and decision["reason"].startswith("the family's first model; every head clears")
    assert default["asset_events"] == 1
    assert str(result["model_version"]) == "2"  # v1 is the refused model of the first run


def test_a_one_step_model_is_refused_against_the_champion_evaluated_on_its_own_day(runs, movielens):
    short = runs[2]
    assert short["tasks"]["train"] == "success" and short["tasks"]["promote"] == "skipped", short
    result, decision = short["result"], short["decision"]
    assert result["steps"] == 1 and result["eval_ds"] == DAYS[-3]
    champion = result["champion"]
    assert champion["version"] == "2" and champion["metrics"]["examples"] > 0  # v2, evaluated on this run's day
    assert decision["champion_version"] == "2" and not decision["promoted"]
    reason = decision["reason"]
    assert "trained 1 optimizer step(s), fewer than training.min_steps=100" in reason
    assert f"before the champion v2's evaluation day {DAYS[-2]}: a model of older data" in reason
    assert f"AUC on {DAYS[-3]} new / baseline / champion v2" in reason
    assert f"{champion['metrics']['mean_auc']:.4f}" in reason  # the champion's number on this day
    assert short["asset_events"] == 0


def test_more_days_than_exist_is_a_user_error_before_any_training(runs):
    many = runs[3]
    assert many["tasks"]["plan_run"] == "failed" and many["tasks"]["train"] == "upstream_failed", many
    assert many["result"] is None and many["decision"] is None


def test_a_run_that_accepts_fewer_days_trains_and_is_not_promoted(runs, movielens):
    fewer = runs[4]
    assert fewer["tasks"]["train"] == "success" and fewer["tasks"]["promote"] == "skipped", fewer
    result, decision = fewer["result"], fewer["decision"]
    assert len(result["train_days"]) == 3 and result["train_days_requested"] == 12
    assert any("trained on 3 of the 12 days asked for" in w for w in result["warnings"])
    assert "trained on 3 of the 12 days asked for" in decision["reason"] and not decision["promoted"]


def test_the_champion_from_another_day_is_compared_on_the_new_models_day(runs, movielens):
    latest = runs[5]
    result, decision = latest["result"], latest["decision"]
    assert result["eval_ds"] == DAYS[-1] and result["champion"]["eval_ds"] == DAYS[-2]
    champion = result["champion"]["metrics"]
    assert champion["examples"] == result["metrics"]["examples"]  # the same day's examples
    better = result["metrics"]["mean_auc"] + 0.002 >= champion["mean_auc"]
    assert decision["promoted"] is better and decision["failed"] == ([] if better else decision["failed"])
    assert f"champion v2's {champion['mean_auc']:.4f}" in decision["reason"], decision["reason"]
    assert f"on {DAYS[-1]}" in decision["reason"]
    assert latest["asset_events"] == (1 if better else 0)
    assert _champion(movielens) == (str(result["model_version"]) if better else "2")


def test_the_user_error_names_the_days_and_the_way_out(movielens):
    from core import config
    from core.failures import UserError
    from operators.training import plan_training_days

    with pytest.MonkeyPatch.context() as patch:
        for name, value in _env(movielens).items():
            patch.setenv(name, value)
        config.load.cache_clear()
        try:
            with pytest.raises(UserError) as err:
                plan_training_days("pin_ranker", None, 30)
        finally:
            config.load.cache_clear()
    message = str(err.value)
    assert "train_days=30, but only 11 complete examples partition(s)" in message
    assert f"({DAYS[0]}..{DAYS[-2]})" in message and "accept_fewer_days" in message


if __name__ == "__main__":
    _run(json.loads(sys.argv[2]))
