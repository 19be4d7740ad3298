"""What pinflow's pages show and how they draw it, from a real job history, heartbeat files and validation
reports in a temporary home (the pages against a real API server and browser: tests/integration/test_ui_pages.py)."""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from core import config
from services import job_history as history
from training.runtime import DistEnv, Heartbeat, progress_line

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugins"))  # as Airflow puts the plugins folder on sys.path

from pinflow_ui import pages, svg, web  # noqa: E402

pytestmark = pytest.mark.unit


def test_heartbeats_carry_total_percent_rate_eta_and_the_loss_curve(tmp_path):
    beat = Heartbeat(tmp_path, DistEnv(rank=0, world_size=2), every_s=0.0)
    beat.update(progress=0, force=True, phase="training", step=0, total_steps=100, epochs=2)
    first = json.loads((tmp_path / "heartbeat-rank0.json").read_text())
    assert first["percent"] == 0 and "loss" not in first and "eta_s" not in first
    assert first["peak_rss_bytes"] >= 10 * 2**20  # this process's peak so far (VmHWM): at least the interpreter
    assert progress_line([first]) == "step 0/100 (0.0%), epoch 1/2 (1 rank(s) reporting)"  # no loss before a step
    for step in range(1, 41):
        beat.update(examples=32, step=step, epoch=0, loss=1.0 / step)
        time.sleep(0.001)
    data = json.loads((tmp_path / "heartbeat-rank0.json").read_text())
    assert data["percent"] == 40.0 and data["eta_s"] > 0 and data["steps_per_s"] > 0
    assert data["loss_history"][0] == [1, 1.0] and data["loss_history"][-1][0] == 40
    line = progress_line([data, {**data, "rank": 1}])
    assert line.startswith("step 40/100 (40.0%), epoch 1/2, loss 0.0250, ") and "examples/s, ETA " in line
    assert line.endswith("(2 rank(s) reporting)")
    assert "examples/s" in beat.progress_line() and "rank(s)" not in beat.progress_line()


def test_the_loss_curve_is_thinned_to_a_bounded_number_of_points(tmp_path):
    beat = Heartbeat(tmp_path, DistEnv(), every_s=3600)
    beat.LOSS_POINTS = 50
    for step in range(1, 1001):
        beat.update(step=step, loss=float(step))
    points = beat._loss_history
    assert len(points) <= 50 and points[0][0] == 1 and points[-1][0] > 900
    assert sorted(p[0] for p in points) == [p[0] for p in points]


@pytest.fixture
def world(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'history.db'}"
    cfg = config.read(home=tmp_path, environ={})
    cfg = cfg.model_copy(update={"job_history": cfg.job_history.model_copy(update={"url": url})})
    monkeypatch.setattr(config, "load", lambda: cfg)
    monkeypatch.setattr(history, "default_url", lambda: url)
    return cfg


def add_job(cfg, name, run_id, state, *, ended_ago_h=None, failure_class=None, quota_wait=0.0, out=None):
    now = history.now()
    ti = SimpleNamespace(dag_id="pin_ranker_training", run_id=run_id, task_id="train", try_number=1)
    fields = history.job_fields(team="ranking", family="pin_ranker", ti=ti, backend="local", instance_type="p5.48xlarge",
                                nodes=1, procs_per_node=2, gpus_per_node=8, output_dir=str(out) if out else None,
                                checkpoint_dir=str(out / "ckpt") if out else None)
    started = now - dt.timedelta(hours=(ended_ago_h or 0) + 1)
    history.upsert(name, **fields, state=history.SUBMITTED, job_id=name, requested_at=started - dt.timedelta(seconds=quota_wait),
                   submitted_at=started, quota_wait_s=quota_wait)
    if state != history.SUBMITTED:
        history.mark_running("local", name, started.timestamp(), 12.0)
    if ended_ago_h is not None:
        history.mark_ended("local", name, state, failure_class=failure_class,
                           ended_at=(now - dt.timedelta(hours=ended_ago_h)).timestamp())


def test_platform_shows_usage_gpu_hours_waits_outcomes_and_the_running_jobs(world, tmp_path):
    out = tmp_path / "runs" / "live"
    out.mkdir(parents=True)
    (out / "heartbeat-rank0.json").write_text(json.dumps({
        "rank": 0, "world_size": 1, "phase": "training", "step": 30, "total_steps": 120, "epoch": 0, "epochs": 1,
        "examples_per_s": 500.0, "eta_s": 90.0, "loss": 0.5, "unix_time": time.time() - 3}))
    add_job(world, "done", "r1", history.SUCCEEDED, ended_ago_h=30, quota_wait=60)
    add_job(world, "failed", "r2", history.FAILED, ended_ago_h=2, failure_class="INFRA")
    add_job(world, "live", "r3", history.RUNNING, out=out)
    history.upsert("waiting", team="ranking", state=history.WAITING, dag_id="pin_ranker_training", run_id="r4",
                   requested_at=history.now())
    data = pages.platform(world)
    ranking = next(t for t in data["usage"] if t["team"] == "ranking")
    assert ranking["held"] == {"jobs": 1, "nodes": 1, "gpus": 8} and ranking["waiting"] == 1
    assert ranking["quota"] == {"jobs": 4, "nodes": 8, "gpus": 64}  # config/platform.yaml
    assert sum(data["gpu_hours_by_team"]["ranking"]) == pytest.approx(8 + 8 + 8, rel=0.01)  # 2 ended, 1 for an hour
    assert set(data["outcomes_by_day"]) == {"SUCCEEDED", "FAILED:INFRA"}
    # Cost in money beside GPU-hours (issue 36): two ended 1-node p5.48xlarge jobs of an hour at 55.04 USD.
    assert data["cost_by_team_and_family"] == [{"team": "ranking", "family": "pin_ranker", "jobs": 2, "cost": 110.08,
                                                "gpu_hours": 16.0}]
    assert sum(data["cost_by_team"]["ranking"]) == pytest.approx(110.08) and data["currency"] == "USD"
    assert data["wait_percentiles"]["total"]["p99"] == pytest.approx(72, rel=0.05)
    live = next(j for j in data["active"] if j["job_name"] == "live")
    assert live["progress"]["percent"] == 25.0 and live["progress"]["eta_s"] == 90.0
    assert [j["state"] for j in data["active"]] == ["WAITING", "RUNNING"]
    assert live["links"]["run_page"].endswith("/pinflow/runs/pin_ranker_training/r3")
    html = web.render_platform(_request(), data)
    assert html.count("<svg") >= 7 and "r3" in html and "25.0% (step 30/120)" in html and "FAILED:INFRA" in html
    assert "110.08 USD" in html and "Cost per team and day (USD)" in html


def test_training_run_page_reads_progress_curve_checkpoint_mlflow_and_promotion(world, tmp_path):
    out = tmp_path / "runs" / "job"
    (out / "ckpt" / "step-00000040").mkdir(parents=True)
    (out / "ckpt" / "step-00000040" / "COMPLETE.json").write_text(json.dumps({"step": 40, "epoch": 0, "time": "t"}))
    (out / "ckpt" / "mlflow_run.json").write_text(json.dumps({"run_id": "abc", "experiment_id": "3"}))
    for rank in (0, 1):
        (out / f"heartbeat-rank{rank}.json").write_text(json.dumps({
            "rank": rank, "world_size": 2, "phase": "training", "step": 50, "total_steps": 200, "epoch": 0,
            "epochs": 2, "examples_per_s": 100.0, "eta_s": 300.0, "loss": 0.7, "unix_time": time.time() - 5 * rank,
            "host": "node", "pid": 10 + rank, **({"loss_history": [[10, 0.9], [50, 0.7]]} if rank == 0 else {})}))
    add_job(world, "job", "run-1", history.RUNNING, out=out)
    data = pages.training_run(world, "pin_ranker_training", "run-1")
    prog = data["progress"]
    assert (prog["step"], prog["total_steps"], prog["percent"], prog["examples_per_s"]) == (50, 200, 25.0, 200.0)
    assert prog["eta_s"] == 300.0 and [r["age_s"] >= 5 for r in prog["ranks"]] == [False, True]
    assert data["loss_curve"] == [[10.0, 0.9], [50.0, 0.7]] and data["checkpoint"]["step"] == 40
    assert data["mlflow"]["run_url"] == "http://localhost:5000/#/experiments/3/runs/abc"
    html = web.render_run(_request(), data)
    assert "step 50 of 200 (25.0%)" in html and "ETA 5.0 min" in html and "polyline" in html
    assert 'http-equiv="refresh"' in html  # live while the job runs
    history.mark_ended("local", "job", history.SUCCEEDED)
    history.record_promotion("pin_ranker_training", "run-1", {"promoted": True, "reason": "mean AUC 0.7 >= 0.6",
                                                              "model_version": "3"})
    (out / "result.json").write_text(json.dumps({"model_name": "m", "model_version": "3", "metrics": {
        "auc": {"click": 0.79, "hide": 0.61}, "mean_auc": 0.7, "baseline_auc": {"click": 0.73, "hide": 0.6}},
        "champion": {"version": "2", "metrics": {"auc": {"click": 0.77, "hide": 0.62}, "mean_auc": 0.695}}}))
    data = pages.training_run(world, "pin_ranker_training", "run-1", dag_run_state="running")
    assert data["promotion"] == {"promoted": True, "reason": "mean AUC 0.7 >= 0.6", "model_version": "3"}
    assert data["heads"]["click"] == {"new": 0.79, "baseline": 0.73, "champion": 0.77}
    html = web.render_run(_request(), data)
    assert "promoted to champion" in html and "champion v2" in html and "<td>0.6100</td>" in html
    # The job has ended but the DAG run has not (promotion, notes): the tab keeps refreshing until it has.
    assert 'http-equiv="refresh"' in html
    ended = web.render_run(_request(), pages.training_run(world, "pin_ranker_training", "run-1", dag_run_state="success"))
    assert 'http-equiv="refresh"' not in ended
    features = web.render_run(_request(), pages.training_run(world, "pin_daily_features", "other"))
    assert "builds its features: it runs no training job, and this tab shows training jobs only" in features
    assert "Loss" not in features and "Last checkpoint" not in features  # no empty training sections
    assert "has not started" in web.render_run(_request(), pages.training_run(world, "pin_ranker_training", "none"))


def test_data_quality_reads_reports_and_the_quarantine(world):
    root = Path(world.storage_root)
    for ds, ok in (("2026-11-01", True), ("2026-11-02", False)):
        folder = root / "reports" / "validation" / "events" / f"ds={ds}"
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({"success": ok, "failed_checks": [] if ok else ["action.in_set"],
                                                        "rows": 10}))
    record = root / "quarantine" / "events" / "ds=2026-11-02" / "20261103T000000Z"
    record.mkdir(parents=True)
    (record / "QUARANTINE.json").write_text(json.dumps({
        "failed_checks": ["action.in_set"], "quarantined_at": "2026-11-03T00:00:00",
        "message": "Validation failed for raw/events partition ds=2026-11-02: 1 of 28 checks failed\n"
                   "  - action.in_set: 3 rows have action outside [...]\nReport: x"}))
    data = pages.data_quality(world)
    assert data["days"] == ["2026-11-01", "2026-11-02"] and (data["passed"], data["failed"]) == (1, 1)
    assert data["cells"]["events"]["2026-11-01"]["docs"].endswith("/pinflow/data-quality/report/events/2026-11-01")
    (q,) = data["quarantine"]
    assert q["reason"].startswith("Validation failed") and q["details"] == ["action.in_set: 3 rows have action outside [...]"]
    assert q["report"].endswith("/pinflow/files/quarantine/events/ds%3D2026-11-02/20261103T000000Z/report/index.html")
    html = web.render_data_quality(_request(), data)
    assert 'class="pass"' in html and 'class="fail"' in html and "action.in_set" in html


def test_the_validation_report_page_lists_every_check_and_the_quarantine_without_outside_assets(world):
    root = Path(world.storage_root)
    folder = root / "reports" / "validation" / "events" / "ds=2026-11-02"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({
        "success": False, "rows": 10, "validated_at": "2026-11-03T00:00:00+00:00", "duration_s": 1.5,
        "partition": "raw/events/ds=2026-11-02", "failed_checks": ["action.in_set"], "checks": [
            {"name": "rows.between", "status": "passed", "success": True, "observed": 10, "expected": [1, None],
             "details": "", "severity": "fail"},
            {"name": "action.in_set", "status": "failed", "success": False, "observed": {"unexpected": 3},
             "expected": ["click", "repin"], "details": "3 rows have action <script>", "severity": "fail"},
            {"name": "volume.vs_history", "status": "failed", "success": False, "observed": 10, "expected": 100,
             "details": "", "severity": "warn"}]}))
    record = root / "quarantine" / "events" / "ds=2026-11-02" / "20261103T000000Z"
    record.mkdir(parents=True)
    (record / "QUARANTINE.json").write_text(json.dumps({"message": "Validation failed\n- x", "restore": "mv a b"}))
    report = pages.validation_report(world, "events", "2026-11-02")
    html = web.render_report(_request(), "events", "2026-11-02", report)
    assert "FAILED: 3 checks, 1 failed, on 10 rows" in html and "Quarantined" in html and "mv a b" in html
    assert html.index("action.in_set") < html.index("volume.vs_history") < html.index("rows.between")  # failed first
    assert "&lt;script&gt;" in html and ">warned<" in html  # escaped; a warning does not fail the partition
    assert "/pinflow/data-quality/docs/events/2026-11-02" in html  # GX's own Data Docs, linked
    assert not re.search(r'(src|href)="https?://(?!localhost)', html)  # nothing loaded from elsewhere
    assert pages.validation_report(world, "events", "2026-11-09") is None
    assert "has not been validated yet" in web.render_report(_request(), "events", "2026-11-09", None)


def test_only_reports_are_served_never_data():
    assert web._allowed_file(["reports", "validation", "events", "ds=2026-11-01", "index.html"])
    assert web._allowed_file(["quarantine", "events", "ds=1", "t", "report", "index.html"])
    assert not web._allowed_file(["quarantine", "events", "ds=1", "t", "data", "part-0.parquet"])
    assert not web._allowed_file(["raw", "events", "ds=1", "part-0.parquet"])
    assert not web._allowed_file(["reports", "validation", "..", "..", "raw", "x"])


def test_charts_are_svg_with_escaped_text_and_an_empty_state():
    chart = svg.stacked_bars(["2026-11-01", "2026-11-02"], {"<team>": [1.0, 2.5], "b": [0.0, 1.0]}, title="t & u")
    assert chart.startswith("<svg") and "&lt;team&gt;" in chart and "<title>t &amp; u</title>" in chart
    assert chart.count('class="bar"') == 3
    assert "no data yet" in svg.stacked_bars(["2026-11-01"], {"a": [0.0]}, title="t")
    assert svg.lines({"loss": [(1, 0.9), (2, 0.5)]}, title="loss").count("<polyline") == 1
    assert svg.nice_max(0.037) == 0.05 and svg.nice_max(730) == 1000


def test_the_plugin_registers_its_app_views_and_http_links():
    import pinflow_plugin

    plugin = pinflow_plugin.PinflowPlugin
    assert plugin.fastapi_apps[0]["url_prefix"] == "/pinflow"
    for view in plugin.external_views:
        assert not view["href"].startswith(("/", "http"))  # relative to the UI's base: works behind a proxy prefix
    assert {v["destination"] for v in plugin.external_views} == {"nav", "dag_run"}
    assert {type(link).__name__ for link in plugin.operator_extra_links} == {"DataDocsLink", "JobConsoleLink",
                                                                             "MlflowRunLink"}
    from operators.validation import DataDocsLink

    op = SimpleNamespace(data_docs_url=None, dataset="events", ds="2026-11-01")
    assert DataDocsLink().get_link(op, ti_key=None).startswith("http")  # type: ignore[arg-type]


def _request():
    return SimpleNamespace(scope={"root_path": "/pinflow"})


def test_the_app_describes_itself_and_bounds_its_days():
    """/pinflow/openapi.json (every route's annotations resolvable) and the days a page accepts (1 to 366)."""
    app = web.create_app()
    spec = app.openapi()
    assert {"/api/platform", "/api/data-quality", "/platform"} <= set(spec["paths"])
    days = next(p for p in spec["paths"]["/api/platform"]["get"]["parameters"] if p["name"] == "days")
    assert days["schema"]["minimum"] == 1 and days["schema"]["maximum"] == 366


def test_the_listener_records_the_tasks_of_every_dag_in_dags(tmp_path, monkeypatch):
    """PINFLOW_DAGS is every dag_id in dags/ (pinflow_hpo's trials were missing from the task outcomes)."""
    import re

    import pinflow_plugin

    dag_ids = {m for f in (REPO / "dags").glob("*.py") for m in re.findall(r'dag_id="([a-z0-9_]+)"', f.read_text())}
    assert dag_ids and set(pinflow_plugin.PINFLOW_DAGS) == dag_ids
    monkeypatch.setenv("PINFLOW_HOME", str(tmp_path))
    ti = SimpleNamespace(dag_id="pinflow_hpo", task_id="trials", run_id="r", map_index=-1, try_number=1, start_date=None)
    pinflow_plugin._record(ti, "failed", error="boom")
    row = json.loads((tmp_path / "jobdata" / "task_runs.jsonl").read_text())
    assert (row["dag_id"], row["state"], row["error"]) == ("pinflow_hpo", "failed", "boom")


def test_every_failure_the_listener_records_is_classified_or_says_it_had_no_exception(tmp_path, monkeypatch):
    """The Platform page's legend showed "failed:?": an exception without a failure_class attribute went unclassified."""
    import pinflow_plugin

    from core.failures import DataError

    monkeypatch.setenv("PINFLOW_HOME", str(tmp_path))
    ti = SimpleNamespace(dag_id="pin_daily_features", task_id="t", run_id="r", map_index=-1, try_number=1,
                         start_date=None)
    for error in (DataError("bad day"), ConnectionResetError("peer"), KeyError("x"), "lost its worker", None):
        pinflow_plugin._record(ti, "failed", error=error)
    rows = [json.loads(line) for line in (tmp_path / "jobdata" / "task_runs.jsonl").read_text().splitlines()]
    assert [r["failure_class"] for r in rows] == ["DATA", "INFRA", "USER", None, None]
    cfg = config.read().model_copy(update={"home": str(tmp_path)})
    today = rows[0]["time"][:10]
    assert set(pages.task_outcomes(cfg, [today])) == {"failed:DATA", "failed:INFRA", "failed:USER", "failed:no exception"}


def test_durations_below_ten_seconds_keep_a_decimal():
    assert [web._duration(s) for s in (None, 0, 0.33, 9.4, 12, 90, 7200)] == [
        "—", "0 s", "0.3 s", "9.4 s", "12 s", "1.5 min", "2.0 h"]
