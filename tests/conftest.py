"""Test session environment: a private PINFLOW_HOME and Airflow home, set before Airflow is imported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_HOME = Path(tempfile.mkdtemp(prefix="pinflow-test-"))

os.environ.update(
    {
        "PINFLOW_HOME": str(_HOME),
        "AIRFLOW_HOME": str(_HOME / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_HOME / 'airflow' / 'airflow.db'}",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "GX_ANALYTICS_ENABLED": "False",
    }
)
(_HOME / "airflow").mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="session")
def pinflow_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def airflow_db(pinflow_home: Path) -> Path:
    """A migrated Airflow metadata database (SQLite) for this test session."""
    db = pinflow_home / "airflow" / "airflow.db"
    if not db.exists():
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    return db


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's homes go with it (each pytest-xdist worker has its own): tests leave no file behind."""
    shutil.rmtree(_HOME, ignore_errors=True)
