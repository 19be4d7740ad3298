"""Bad inputs to the platform's commands get one line that names what was wrong and how to fix it, never a
traceback (issue 37, 6). Table-driven: each case is a command line (called in process), the environment it runs
in, and the words its error must contain. Misspelt configuration and trigger conf are covered in test_config.py
and test_dags.py, the validation gate's holes in test_validate_corpus.py."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from core import config
from features import build, validate
from operators import quotas
from services import job_history


def _closed_port() -> int:
    """A local port where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


NO_AWS = {  # no credentials from anywhere, and no instance metadata endpoint to wait for
    "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None, "AWS_PROFILE": None,
    "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
}
A_FILE = "{tmp}/a-file"
UNREACHABLE = "postgresql+psycopg2://nobody@127.0.0.1:{port}/none"
DAY = ["--ds", "2026-01-01"]

# (case id, command, argv, env, words the error line must hold, exit status)
CASES: list[tuple[str, Callable[..., int], list[str], dict[str, str | None], list[str], int]] = [
    ("validate: root is a file", validate.main, ["--root", A_FILE, *DAY, "events"], {}, ["is a file", "--root"], 1),
    ("validate: root does not exist", validate.main, ["--root", "{tmp}/mistyped/root", *DAY, "events"], {},
     ["{tmp}/mistyped/root does not exist", "--root"], 1),
    ("build: root does not exist", build.main, ["--root", "{tmp}/mistyped/root", *DAY], {},
     ["USER error", "does not exist (nothing has landed there)"], 1),
    ("validate: s3 root without credentials", validate.main, ["--root", "s3://pinflow-none/x", *DAY, "events"], NO_AWS,
     ["no AWS credentials", "AWS_PROFILE"], 1),
    ("build: root is a file", build.main, ["--root", A_FILE, *DAY], {}, ["USER error", "is a file"], 1),
    ("build: s3 root without credentials", build.main, ["--root", "s3://pinflow-none/x", *DAY], NO_AWS,
     ["no AWS credentials"], 1),
    ("build: memory limit not a size", build.main, ["--root", "{tmp}/root", *DAY, "--memory-limit", "4XB"], {},
     ["USER error", "'4XB' is not a memory size"], 1),
    ("build: memory limit setting not a size", build.main, ["--root", "{tmp}/root", *DAY],
     {"PINFLOW_FEATURES__DUCKDB_MEMORY_LIMIT": "banana"}, ["PINFLOW_FEATURES__DUCKDB_MEMORY_LIMIT", "not a memory size"], 1),
    ("build: temp directory missing", build.main, ["--root", "{tmp}/root", *DAY, "--temp-directory", "{tmp}/no-tmp"],
     {}, ["USER error", "no-tmp is not a folder"], 1),
    ("export: --since not a day", job_history.main, ["export", "--out", "{tmp}/j.csv", "--since", "yesterdy"], {},
     ["'yesterdy' is not a day", "YYYY-MM-DD"], 2),
    ("export: --out a folder", job_history.main, ["export", "--out", "{tmp}"], {}, ["is a folder"], 2),
    ("export: --out in a missing folder", job_history.main, ["export", "--out", "{tmp}/no/j.csv"], {},
     ["does not exist"], 2),
    ("export: not a URL", job_history.main, ["export", "--out", "{tmp}/j.csv", "--url", "not a url"], {},
     ["is not a database URL", "sqlite:////"], 1),
    ("export: a driver not installed", job_history.main, ["export", "--out", "{tmp}/j.csv", "--url", "mysql://a@b/c"],
     {}, ["driver is not installed"], 1),
    ("export: sqlite in a missing folder", job_history.main,
     ["export", "--out", "{tmp}/j.csv", "--url", "sqlite:///{tmp}/nowhere/jobs.db"], {}, ["folder does not exist"], 1),
    ("export: database not answering", job_history.main, ["export", "--out", "{tmp}/j.csv", "--url", UNREACHABLE], {},
     ["does not answer", "job_history.url"], 1),
    ("quotas show: database not answering", quotas.main, ["show"], {"PINFLOW_JOB_HISTORY__URL": UNREACHABLE},
     ["does not answer"], 1),
    ("quotas show: sqlite in a missing folder", quotas.main, ["show"],
     {"PINFLOW_JOB_HISTORY__URL": "sqlite:///{tmp}/nowhere/jobs.db"}, ["folder does not exist"], 1),
]


@pytest.fixture(autouse=True)
def _config_read_per_case():
    """Each case's environment is read as a new process would (the configuration is read once per process)."""
    config.load.cache_clear()
    yield
    config.load.cache_clear()
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # none made here without credentials outlives its case


@pytest.mark.parametrize(("command", "argv", "env", "words", "status"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_naming_the_fix(command, argv, env, words, status, tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "root").mkdir()
    port = _closed_port()

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{port}", str(port))

    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, fill(value))
    config.load.cache_clear()
    try:
        code = command([fill(a) for a in argv])
    except SystemExit as e:  # argparse's usage error
        code = e.code
    err = capsys.readouterr().err
    assert code == status, err
    assert "Traceback" not in err, err
    assert all(fill(word) in err for word in words), err
    assert not (tmp_path / "nowhere").exists()  # a reader never creates a database at a mistyped path
    assert not (tmp_path / "mistyped").exists()  # nor a storage root


def test_the_storage_root_is_accepted_when_it_is_a_writable_folder(tmp_path: Path):
    from core import storage

    (tmp_path / "root").mkdir()
    storage.check_root(tmp_path / "root")
    storage.check_root(f"file://{tmp_path}")
