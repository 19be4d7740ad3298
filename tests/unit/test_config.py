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
    ],
)
def test_a_bad_key_or_value_names_the_key_and_where_it_came_from(tmp_path: Path, text, environ, says):
    with pytest.raises(ConfigError) as err:
        read(tmp_path, text, **environ)
    assert says.format(file=tmp_path / "platform.yaml") in str(err.value)
    assert err.value.failure_class is FailureClass.USER


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
