"""The job history table on a real (SQLite) database: transitions, what a row ends with, the export CLI."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from core.failures import InfraError, UserError
from services import job_history as history

pytestmark = pytest.mark.unit


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'jobdata' / 'history.db'}"


def submit(url, name="train-x", job_id="job-1", gpus_per_node=8, nodes=2):
    ti = SimpleNamespace(dag_id="pin_ranker_training", run_id="manual__1", task_id="train", map_index=-1, try_number=2)
    fields = history.job_fields(team="ranking", family="pin_ranker", ti=ti, backend="batch",
                                instance_type="p5.48xlarge", nodes=nodes, procs_per_node=8, gpus_per_node=gpus_per_node,
                                output_dir="s3://b/runs/x", checkpoint_dir="s3://b/models/x")
    history.upsert(name, url, **fields, state=history.WAITING, requested_at=history.now())
    history.mark_submitted(name, job_id, url=url)
    return fields


def test_a_job_moves_through_its_transitions(url):
    fields = submit(url)
    assert fields["gpus"] == 16 and fields["retries"] == 1
    history.mark_running("batch", "job-1", started_at=history.now().timestamp(), queued_s=42.0, url=url)
    row = history.get("train-x", url)
    assert row["state"] == history.RUNNING and row["queue_wait_s"] == 42.0
    history.mark_ended("batch", "job-1", history.SUCCEEDED, ended_at=row["started_at"].timestamp() + 1800, url=url)
    history.record_result("batch", "job-1", {"model_name": "pin_ranker", "model_version": 7, "mlflow_run_id": "r"},
                          url=url)
    history.record_promotion("pin_ranker_training", "manual__1", {"promoted": False, "reason": "worse",
                                                                  "model_version": "7"}, url=url)
    row = history.get("train-x", url)
    assert row["outcome"] == history.SUCCEEDED and row["run_s"] == pytest.approx(1800)
    assert row["gpu_hours"] == pytest.approx(8.0) and row["node_hours"] == pytest.approx(1.0)
    assert (row["model_version"], row["mlflow_run_id"], row["promoted"], row["promotion_reason"]) == ("7", "r", False,
                                                                                                    "worse")


def test_a_job_costs_its_node_hours_at_its_teams_price_checked_by_hand(url, monkeypatch):
    """Issue 36: cost in money next to GPU-hours. 2 p5.48xlarge nodes for 30 minutes at 55.04 USD a node-hour
    (config/platform.yaml) are 55.04 USD; the same job of a Spot team at 21.50 is 21.50; a local job costs
    costs.local_per_hour; an instance type without a price has no cost."""
    from core import config
    from core.config import LOCAL_MACHINE, PriceConfig

    base = config.read()
    assert base.costs.prices["p5.48xlarge"].on_demand == 55.04 and base.costs.currency == "USD"

    def ended_job(name: str, job_id: str, minutes: float) -> dict:
        submit(url, name, job_id)
        history.mark_running("batch", job_id, started_at=1_000_000.0, queued_s=0.0, url=url)
        history.mark_ended("batch", job_id, history.SUCCEEDED, ended_at=1_000_000.0 + minutes * 60, url=url)
        row = history.get(name, url)
        assert row is not None
        return row

    monkeypatch.setattr(config, "load", lambda: base)
    row = ended_job("train-a", "job-a", 30)
    assert row["node_hours"] == pytest.approx(1.0) and row["cost"] == pytest.approx(55.04) and row["currency"] == "USD"
    spot_team = base.teams["ranking"].model_copy(update={"capacity": "spot"})
    spot = base.model_copy(update={
        "teams": {**base.teams, "ranking": spot_team},
        "costs": base.costs.model_copy(update={"prices": {**base.costs.prices,
                                                          "p5.48xlarge": PriceConfig(on_demand=55.04, spot=21.5)}})})
    monkeypatch.setattr(config, "load", lambda: spot)
    assert ended_job("train-b", "job-b", 30)["cost"] == pytest.approx(21.5)
    assert history.run_cost("pin_ranker_training", "manual__1", url=url) == (pytest.approx(76.54), "USD")
    local = base.model_copy(update={"costs": base.costs.model_copy(update={"local_per_hour": 0.5})})
    monkeypatch.setattr(config, "load", lambda: local)
    assert history.job_cost(LOCAL_MACHINE, "ranking", 3.0) == (pytest.approx(1.5), "USD")
    assert history.job_cost("x1.32xlarge", "ranking", 3.0) == (None, "USD")
    assert history.cost_note(76.54, "USD", 0.02) == "cost 76.54 USD (38.27 USD per AUC point over the champion)"
    assert history.cost_note(76.54, "USD", -0.01) == "cost 76.54 USD"  # no gain: no price per point
    assert "no price" in history.cost_note(None, "USD")


def test_an_operators_error_gives_the_outcome_and_class(url, monkeypatch):
    submit(url)
    monkeypatch.setattr(history, "default_url", lambda: url)
    job = {"backend": "batch", "job_id": "job-1"}
    history.job_ended(job, {"state": "FAILED", "started_at": 1000.0, "queued_s": 5.0},
                      error=UserError("training job job-1 failed (USER): NaN loss\nlast log lines:\n..."))
    row = history.get("train-x", url)
    assert (row["state"], row["failure_class"], row["reason"]) == ("FAILED", "USER", "training job job-1 failed (USER): NaN loss")
    submit(url, "train-y", "job-2")
    history.job_ended({"backend": "batch", "job_id": "job-2"}, {"state": "STALLED"}, error=InfraError("no progress"))
    assert history.get("train-y", url)["state"] == "STALLED" and history.get("train-y", url)["failure_class"] == "INFRA"


def test_a_history_that_does_not_answer_never_fails_the_job(caplog):
    history.note(history.mark_submitted, "x", "y", url="postgresql+psycopg2://nobody@127.0.0.1:1/none")
    assert "job history: mark_submitted failed" in caplog.text


def test_export_csv_and_parquet_for_capacity_planning(url, tmp_path, capsys):
    submit(url)
    history.mark_ended("batch", "job-1", history.FAILED, failure_class="INFRA", url=url)
    assert history.main(["export", "--out", str(tmp_path / "jobs.parquet"), "--url", url, "--team", "ranking"]) == 0
    assert "wrote 1 job(s)" in capsys.readouterr().out
    table = pq.read_table(tmp_path / "jobs.parquet")
    assert table.column_names == history.COLUMNS and table.column("failure_class").to_pylist() == ["INFRA"]
    assert str(table.schema.field("submitted_at").type) == "timestamp[us, tz=UTC]"
    assert history.export(tmp_path / "jobs.csv", "csv", url=url, since=history.now()) == 0  # requested earlier
    assert history.export(tmp_path / "jobs.csv", "csv", url=url) == 1
    rows = list(csv.DictReader((tmp_path / "jobs.csv").open()))
    assert rows[0]["team"] == "ranking" and rows[0]["instance_type"] == "p5.48xlarge" and rows[0]["gpus"] == "16"
