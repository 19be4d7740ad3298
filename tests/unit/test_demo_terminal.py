"""The demo's terminal while a DAG run retries: each failed job of the run said as it fails (before, a preflight
that found too little disk was retried with backoff while the terminal said nothing; the reason was in demo.log)."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from services import job_history as history

pytestmark = pytest.mark.unit
DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"



def load_demo() -> ModuleType:
    """scripts/demo.py as a module of its own (a fresh one each time: its terminal is patched per test)."""
    spec = importlib.util.spec_from_file_location("pinflow_demo_under_test", DEMO)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def failed_job(name: str, run_id: str, reason: str, url: str) -> None:
    ti = SimpleNamespace(dag_id="pin_ranker_training", run_id=run_id, task_id="train", map_index=-1, try_number=1)
    fields = history.job_fields(team="ranking", family="pin_ranker", ti=ti, backend="local", instance_type="local",
                                nodes=1, procs_per_node=2, gpus_per_node=0, output_dir="/o", checkpoint_dir="/c")
    history.upsert(name, url, **fields, state=history.WAITING, requested_at=history.now())
    history.mark_submitted(name, f"{name}-id", url=url)
    history.mark_ended("local", f"{name}-id", history.FAILED, failure_class="INFRA", reason=reason, url=url)


def test_each_failed_job_of_the_run_is_said_once_as_it_fails(tmp_path: Path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'history.db'}"
    monkeypatch.setenv("PINFLOW_JOB_HISTORY__URL", url)
    demo = load_demo()
    terminal = io.StringIO()
    monkeypatch.setattr(demo, "CONSOLE", terminal)
    run_id = "demo__2026-11-07__pin_ranker"
    failed_job("earlier", run_id, "an earlier demo's run of the same id", url)  # before this run began: not said
    time.sleep(0.01)

    with demo.FailedJobsSaid("pin_ranker_training", run_id, tmp_path / "demo.log", every_s=0.05) as watch:
        failed_job("try-1", run_id, "preflight: 0.4 GB free under /c,\n  needs 1.6 GB: free disk space", url)
        failed_job("other-run", "demo__2026-11-07__pin_content", "another run's job", url)
        deadline = time.monotonic() + 10
        while "try-1" not in watch.said and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = terminal.getvalue().splitlines()
    assert len(lines) == 1, lines  # once, though the watch read the history many times and once more at its end
    assert "pin_ranker_training train: try 1 failed (INFRA): preflight: 0.4 GB free under /c, needs 1.6 GB" in lines[0]
    assert "Airflow retries it while the task has retries left" in lines[0] and str(tmp_path / "demo.log") in lines[0]


@pytest.mark.parametrize(("args", "said"), [
    (["--days", "1"], "--days 1: at least 2 (the demo trains on the days before the last and evaluates on the last)"),
    (["--train-days", "0"], "--train-days 0: 1 to 30"),
    (["--epochs", "101"], "--epochs 101: 1 to 100"),
    (["--users", "0"], "users=0 must be >= 1"),
    (["--start", "2026-13-01"], "partition day '2026-13-01' is not a date in the form YYYY-MM-DD"),
])
def test_arguments_the_chain_would_refuse_late_are_refused_before_anything_runs(args, said, capsys, tmp_path,
                                                                                 monkeypatch):
    """Before, --days 1 or --epochs 0 built every day's features and then failed on the training DAG's params."""
    monkeypatch.setenv("PINFLOW_STORAGE_ROOT", str(tmp_path / "storage"))
    demo = load_demo()
    with pytest.raises(SystemExit) as exit_:
        demo.main(args)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "storage").exists()  # no world generated


def test_run_by_hand_without_airflows_environment_it_says_how_and_makes_no_airflow_home(tmp_path):
    """Before, `python scripts/demo.py` without the Makefile's environment made ~/airflow with an empty database and
    failed on `no such table: task_instance`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(HOME=str(tmp_path), PINFLOW_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, str(DEMO)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "AIRFLOW_HOME is not set: run the demo with `make demo`" in proc.stdout
    assert not (tmp_path / "airflow").exists()

    env.update(AIRFLOW_HOME=str(tmp_path / "home" / "airflow"),
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path / 'empty.db'}")
    proc = subprocess.run([sys.executable, str(DEMO)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"Airflow's metadata database (sqlite:///{tmp_path / 'empty.db'}) has no tables: `make install`" in proc.stdout
