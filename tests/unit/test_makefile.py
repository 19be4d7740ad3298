"""Ports and URLs of the embedded default come from one place: ``make airflow PORT=...`` and ``make print-env``."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed"),
]

REPO = Path(__file__).resolve().parents[2]


def print_env(*args: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PORT" and not k.startswith(("AIRFLOW__", "MAKE"))}
    proc = subprocess.run(["make", "-s", "print-env", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    exported = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        exported[name] = shlex.split(value)[0] if value else ""
    return exported


def test_port_moves_the_api_server_its_urls_and_the_log_servers():
    env = print_env("PORT=9191")
    assert env["AIRFLOW__API__PORT"] == "9191"
    assert env["PINFLOW_MLFLOW__UI_URL"] == "http://localhost:6111"  # the MLflow UI moves with it
    assert env["AIRFLOW__API__BASE_URL"] == "http://localhost:9191"
    # Task processes report to the execution API of this API server, not to localhost:8080.
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://localhost:9191/execution/"
    ports = [int(env[name]) for name in ("AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT",
                                         "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT",
                                         "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT")]
    assert len(set(ports + [9191])) == 4
    assert float(env["AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT"]) >= 30


def test_default_port_keeps_airflows_defaults():
    env = print_env()
    assert env["AIRFLOW__API__PORT"] == "8080"
    assert env["PINFLOW_MLFLOW__UI_URL"] == "http://localhost:5000"  # MLflow's own default
    assert env["AIRFLOW__API__BASE_URL"] == "http://localhost:8080"
    assert env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] == "8793"
    assert env["AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT"] == "8794"
    assert env["AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT"] == "8974"


def test_the_api_server_listens_on_this_machine_only_unless_asked():
    assert print_env()["AIRFLOW__API__HOST"] == "127.0.0.1"
    assert print_env("HOST=0.0.0.0")["AIRFLOW__API__HOST"] == "0.0.0.0"

