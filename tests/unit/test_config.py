"""The typed platform configuration: one source of defaults, env overrides, and errors that name the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core import config
from core.config import FeaturesConfig, PlatformConfig, TrainingConfig
from core.failures import ConfigError, FailureClass

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def read(tmp_path: Path, text: str, **environ: str) -> PlatformConfig:
    file = tmp_path / "platform.yaml"
    file.write_text(text)
    return config.read(file, environ, home=tmp_path / "home")


def test_the_shipped_file_is_valid_and_paths_resolve_under_home(tmp_path: Path):
    cfg = config.read(config.CONFIG_FILE, {}, home=tmp_path)
    assert cfg.storage_root == str(tmp_path / "storage")
    assert cfg.mlflow.tracking_uri == f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    assert cfg.home == str(tmp_path)
    assert cfg.training == TrainingConfig()  # the file repeats no default


def test_environment_overrides_the_file(tmp_path: Path):
    cfg = read(tmp_path, "training: {epochs: 2}\n", PINFLOW_TRAINING__EPOCHS="3", PINFLOW_STORAGE_ROOT="s3://b/p",
               PINFLOW_HOME="/elsewhere", PINFLOW_RDZV_PORT="29400")
    assert cfg.training.epochs == 3
    assert cfg.storage_root == "s3://b/p"  # a URL is not resolved under home


@pytest.mark.parametrize(
    ("text", "environ", "says"),
    [
        ("training: {epocs: 3}\n", {}, "training.epocs: unknown key in {file} (did you mean 'training.epochs'?)"),
        ("", {"PINFLOW_TRAINING__EPOCS": "3"},
         "training.epocs: unknown key in environment variable PINFLOW_TRAINING__EPOCS (did you mean 'training.epochs'?)"),
        ("validation: {sensor_poke_seconds: thirty}\n", {},
         "validation.sensor_poke_seconds = 'thirty' in {file}: Input should be a valid number"),
        ("trainig: {}\n", {}, "trainig: unknown key in {file} (did you mean 'training'?)"),
        ("", {"PINFLOW_FEATURES__WINDOW_DAYS": "0"},
         "features.window_days = 0 in environment variable PINFLOW_FEATURES__WINDOW_DAYS: Input should be greater"),
        ("training: {team: search}\n", {}, "training.team='search' is not under teams:"),
        ("teams: {ranking: {queue: q}}\n", {}, "teams.ranking.share"),
        # Misspellings that used to be ignored (issue 37): one underscore, a misspelt top-level key, lower case.
        ("", {"PINFLOW_TRAINING_EPOCHS": "3"},
         "environment variable PINFLOW_TRAINING_EPOCHS is not a setting (did you mean PINFLOW_TRAINING__EPOCHS?)"),
        ("", {"PINFLOW_STORAGE_ROT": "/x"},
         "environment variable PINFLOW_STORAGE_ROT is not a setting (did you mean PINFLOW_STORAGE_ROOT?)"),
        ("", {"pinflow_training__epochs": "3"},
         "environment variable pinflow_training__epochs: pinflow's variables are upper case (PINFLOW_TRAINING__EPOCHS)"),
        ("training: {epochs: 2}\ntraining: {epochs: 3}\n", {}, "key 'training' is given twice (line 1 and line 2)"),
        ("features: {backend: off}\n", {},
         "features.backend = False in {file}: Input should be '', 'local', 'batch' or 'kubernetes' (YAML reads an "
         "unquoted yes, no, on or off as true or false: quote it, e.g. 'off')"),
        # The price table (issue 36): a type that is not an instance type, a negative price.
        ("costs: {prices: {p5.48xlarg: {on_demand: 55.04}}}\n", {},
         "costs.prices names instance type(s) p5.48xlarg not under instance_types:"),
        ("costs: {prices: {p5.48xlarge: {on_demand: -1}}}\n", {},
         "costs.prices.p5.48xlarge.on_demand = -1 in {file}: Input should be greater than or equal to 0"),
        # A misspelt section in a variable, or a section-wide check of a value a variable set: the variable is named.
        ("", {"PINFLOW_VALIDATON__VOLUME_MIN_RATIO": "0.9"},
         "validaton: unknown key in environment variable PINFLOW_VALIDATON__VOLUME_MIN_RATIO (did you mean 'validation'?)"),
        ("", {"PINFLOW_VALIDATION__HOLIDAYS": "['2026-02-30']"}, "in environment variable PINFLOW_VALIDATION__HOLIDAYS"),
        ("", {"PINFLOW_TEAMS": "{ranking: {queue: q}}"},  # a section set whole by a variable: the variable is named
         "teams.ranking.share = {{'queue': 'q'}} in environment variable PINFLOW_TEAMS: Field required"),
    ],
)
def test_a_bad_key_or_value_names_the_key_and_where_it_came_from(tmp_path: Path, text, environ, says):
    with pytest.raises(ConfigError) as err:
        read(tmp_path, text, **environ)
    assert says.format(file=tmp_path / "platform.yaml") in str(err.value)
    assert err.value.failure_class is FailureClass.USER


def test_pinflow_config_naming_no_file_is_an_error(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PINFLOW_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match=r"PINFLOW_CONFIG=.*missing.yaml names no file"):
        config.config_file()


def test_a_typo_in_a_triggers_conf_fails_naming_the_param():
    from core.failures import UserError
    from operators.run_conf import check_run_conf

    class Run:
        dag_id, conf = "pin_daily_features", {"dss": "2026-11-02", "shards": 2}

    check_run_conf({"dag_run": Run(), "params": {"ds": None, "shards": 1, "dss": None}})  # every key known
    with pytest.raises(UserError, match=r"key\(s\) 'dss' \(did you mean 'ds'\?\) that pin_daily_features does not "
                                        r"know: its params are ds, shards"):
        check_run_conf({"dag_run": Run(), "params": {"ds": None, "shards": 1}})
    # As a task's context holds them: its params with the conf merged in (Airflow's), its DAG's declared ones.
    from types import SimpleNamespace

    dag = SimpleNamespace(params={"ds": None, "shards": 1})
    with pytest.raises(UserError, match=r"'dss' \(did you mean 'ds'\?\)"):
        check_run_conf({"dag_run": Run(), "params": {"ds": None, "shards": 2, "dss": "2026-11-02"}, "dag": dag})


def test_overrides_are_checked_by_the_same_model():
    features = FeaturesConfig()
    assert config.with_overrides(features, {"sequence_length": 20, "window_days": None}, "params").sequence_length == 20
    with pytest.raises(ConfigError, match="the form: features.sequence_length = 'x'"):
        config.with_overrides(features, {"sequence_length": "x"}, "the form")


def test_make_demo_stops_at_once_naming_the_key(tmp_path: Path):
    env = {**os.environ, "PINFLOW_HOME": str(tmp_path), "PINFLOW_TRAINING__EPOCS": "3"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "training.epocs: unknown key in environment variable PINFLOW_TRAINING__EPOCS" in proc.stdout
    assert not (tmp_path / "storage").exists()  # nothing was generated


def test_the_cli_prints_every_key_with_its_help():
    proc = subprocess.run([sys.executable, "-m", "core.config"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "  epochs: 1  # passes over the training days" in proc.stdout


def test_a_long_lived_process_sees_an_edited_quota_at_its_next_load(tmp_path: Path, monkeypatch):
    """The Platform page kept the quota it loaded at start-up while tasks enforced the edited one."""
    from core import config

    text = (REPO / "config" / "platform.yaml").read_text()
    edited = tmp_path / "platform.yaml"
    edited.write_text(text)
    monkeypatch.setenv("PINFLOW_CONFIG", str(edited))
    monkeypatch.setenv("PINFLOW_HOME", str(tmp_path / "home"))
    config.load.cache_clear()
    try:
        before = config.load().teams["ranking"].quota.jobs
        assert config.load() is config.load()  # unchanged: not read again
        edited.write_text(text.replace("quota: {jobs: 4,", "quota: {jobs: 12,"))
        assert before == 4 and config.load().teams["ranking"].quota.jobs == 12
        monkeypatch.setenv("PINFLOW_TEAMS__RANKING__QUOTA__JOBS", "3")  # the environment counts too
        assert config.load().teams["ranking"].quota.jobs == 3
        # Mid-write (emptied) or wrong: the process keeps what it has; a new reader is told what is wrong.
        edited.write_text("")
        assert config.load().teams["ranking"].quota.jobs == 3
        edited.write_text(text + "\ntrainig: {}\n")
        assert config.load().teams["ranking"].quota.jobs == 3
        with pytest.raises(ConfigError, match="trainig: unknown key"):
            config.read(edited)
    finally:
        monkeypatch.undo()
        config.load.cache_clear()
