"""The DAG files' view of the configuration (core.config_view): the values core.config.load() returns, from a cache,
and an invalid configuration still stops the DAG files with the message that names the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from core import config, config_view
from core.failures import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"


def assert_same(view: Any, model: Any, where: str = "config") -> None:
    """The view holds the model's values with the same types, section by section."""
    if isinstance(model, BaseModel):
        assert isinstance(view, config_view.Section), where
        for name in type(model).model_fields:
            assert_same(getattr(view, name), getattr(model, name), f"{where}.{name}")
    elif isinstance(model, dict):
        assert type(view) is dict and list(view) == list(model), where
        for key in model:
            assert_same(view[key], model[key], f"{where}[{key!r}]")
    elif isinstance(model, list):
        assert type(view) is list and len(view) == len(model), where
        for i, (a, b) in enumerate(zip(view, model, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert type(view) is type(model) and view == model, (where, view, model)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PINFLOW_HOME", str(tmp_path))
    return tmp_path


def test_the_view_is_what_load_returns_from_the_cache_too(home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PINFLOW_TRAINING__MODEL", "pin_content")
    monkeypatch.setenv("PINFLOW_FEATURES__SHARDS", "4")
    first = config_view.load()  # builds the configuration and writes the cache
    assert (home / "cache" / config_view.CACHE_NAME).is_file()
    cached = config_view.load()
    for view in (first, cached):
        assert_same(view, config.load())
    assert cached.training.model == "pin_content" and cached.features.shards == 4
    monkeypatch.setenv("PINFLOW_FEATURES__SHARDS", "2")  # another key: read again
    assert config_view.load().features.shards == 2


def test_a_damaged_cache_is_read_anew(home: Path):
    config_view.load()
    path = home / "cache" / config_view.CACHE_NAME
    key = json.loads(path.read_text())["key"]
    for damaged in ("{not json", json.dumps({"key": key, "config": [1, 2]}), json.dumps({"key": key, "config": {}})):
        path.write_text(damaged)
        assert_same(config_view.load(), config.load())


def test_the_view_is_read_only_and_names_a_missing_setting(home: Path):
    view = config_view.load()
    with pytest.raises(AttributeError, match="read-only"):
        view.training.model = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="'epocs'"):
        view.training.epocs  # type: ignore[attr-defined]  # noqa: B018


def test_an_invalid_configuration_stops_the_view_as_it_stops_load(home: Path, monkeypatch: pytest.MonkeyPatch):
    config_view.load()  # a valid configuration cached first
    monkeypatch.setenv("PINFLOW_TRAINING__EPOCS", "3")
    config.load.cache_clear()  # as a new process (a parse): load() keeps no earlier configuration
    with pytest.raises(ConfigError) as err:
        config.read()
    with pytest.raises(ConfigError) as view_err:
        config_view.load()
    assert str(view_err.value) == str(err.value)
    assert "training.epocs: unknown key in environment variable PINFLOW_TRAINING__EPOCS" in str(err.value)


def test_a_dag_file_with_an_invalid_configuration_is_an_import_error_naming_the_key(
    home: Path, monkeypatch: pytest.MonkeyPatch
):
    from airflow.dag_processing.dagbag import DagBag

    config_view.load()
    monkeypatch.setenv("PINFLOW_TRAINING__EPOCS", "3")
    config.load.cache_clear()  # as the DAG processor's parsing process, which has read none before
    bag = DagBag(dag_folder=str(DAGS / "pinflow_rollback.py"))
    assert not bag.dags
    (message,) = bag.import_errors.values()
    assert "did you mean 'training.epochs'?" in message


def test_parsing_with_the_cache_builds_no_typed_configuration(home: Path):
    """A DAG file parsed with a filled cache does not import core.config (the pydantic models)."""
    config_view.load()
    code = (
        "import json, runpy, sys;"
        f"[runpy.run_path(str(p)) for p in sorted(__import__('pathlib').Path({str(DAGS)!r}).glob('*.py'))];"
        "print(json.dumps('core.config' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False


def test_the_dags_are_the_same_built_from_the_view_or_from_the_typed_configuration(
    home: Path, monkeypatch: pytest.MonkeyPatch
):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    def serialized() -> dict[str, str]:
        bag = DagBag(dag_folder=str(DAGS))
        assert bag.import_errors == {}
        return {dag_id: json.dumps(DagSerialization.to_dict(dag), sort_keys=True, default=str)
                for dag_id, dag in bag.dags.items()}

    config_view.load()
    from_view = serialized()
    monkeypatch.setattr(config_view, "load", config.load)
    assert serialized() == from_view
