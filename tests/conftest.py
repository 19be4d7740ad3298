"""Test session environment: a private PINFLOW_HOME and Airflow home, set before Airflow is imported."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The system's temporary folder, as the first process of the session (pytest-xdist's controller) found it: workers
# inherit the controller's TMPDIR below and must not nest theirs in it. (Not PINFLOW_*: the platform refuses an
# unknown PINFLOW_ variable as a typo.)
_SYSTEM_TEMP = os.environ.setdefault("PYTEST_PINFLOW_SYSTEM_TEMP", tempfile.gettempdir())
_HOME = Path(tempfile.mkdtemp(prefix="pinflow-test-", dir=_SYSTEM_TEMP))
# The temporary folder of the session and of every process it starts: what a process that a test kills or cancels
# cannot remove (torchrun's error folders, multiprocessing's, MLflow's, Ray's sessions) goes with the session instead
# of staying in /tmp. A short path: Ray puts its sockets under it (AF_UNIX paths: at most 107 bytes).
_TEMP = Path(tempfile.mkdtemp(prefix="pft-", dir=_SYSTEM_TEMP))
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

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
        "TMPDIR": str(_TEMP),
    }
)
(_HOME / "airflow").mkdir(parents=True, exist_ok=True)


@pytest.fixture(autouse=True)
def no_logging_to_closed_streams() -> None:
    """A command's main() run in a test (training.inference, training.train: ``logging.basicConfig(force=True)``)
    points the root logger at that test's captured stderr, closed once the test ends: a later test's warning would
    then print a logging error (with a traceback) into its own output. Such handlers go before each test."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if getattr(getattr(handler, "stream", None), "closed", False):
            root.removeHandler(handler)


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
    """The session's homes and temporary folder go with it (each pytest-xdist worker has its own): tests leave no file
    behind."""
    shutil.rmtree(_HOME, ignore_errors=True)
    shutil.rmtree(_TEMP, ignore_errors=True)


# The longest files first (by their measured time, a `make test` run's --durations), so that two pytest-xdist workers
# finish together (the many short unit tests fill in at the end); within a file the order is kept. The Makefile
# passes --no-loadscope-reorder: xdist would otherwise order the files by their number of tests.
_LONG_FIRST = (
    "test_train_torchrun.py", "test_production_stack.py", "test_backfill.py", "test_real_data.py", "test_chain.py",
    "test_training_operator.py", "test_local_agent_kill.py", "test_approval.py", "test_hpo_dag.py", "test_ui_pages.py",
    "test_sharded_tables.py", "test_validation_dag.py", "test_demo_stop.py", "test_corpus_inference.py", "test_s3_chain.py",
    "test_train_s3.py", "test_gpu_check.py", "test_orphan_lease.py", "test_local_backend.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        if name in _LONG_FIRST:
            return _LONG_FIRST.index(name)
        return len(_LONG_FIRST) + (0 if "/unit/" not in str(item.path) else 1)

    items.sort(key=rank)  # stable: a file's tests stay in their order
