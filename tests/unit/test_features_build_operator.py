"""FeatureBuildOperator: config (and param overrides) reach features.build as explicit arguments."""

from __future__ import annotations

from typing import Any

import pytest

from core import config
from core.config import FeaturesConfig, PlatformConfig
from core.failures import ConfigError, DataError, FailureClass
from features import build
from operators.features import FeatureBuildOperator

SETTINGS = {
    "window_days": 14,
    "sequence_length": 50,
    "pin_prior_impressions": 10.0,
    "negative_downsample": 1.0,
    "negative_downsample_seed": 5,
    "duckdb_threads": 3,
    "duckdb_memory_limit": "1GB",
    "duckdb_temp_directory": "/spill",
}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    recorded: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    platform = PlatformConfig(storage_root="/data", features=FeaturesConfig(**SETTINGS))
    monkeypatch.setattr(config, "load", lambda: platform)
    for name in ("build_daily", "build_window", "build_sequences", "build_examples"):
        def fake(*args: Any, _name: str = name, **kwargs: Any) -> dict[str, Any]:
            recorded.append((_name, args, kwargs))
            return {"features/x": {"rows": 1, "missing_days": ["2026-11-01"], "computed_from_raw": []}}

        monkeypatch.setattr(build, name, fake)
    return recorded


@pytest.mark.unit
def test_engine_and_parameters_come_from_config_and_overrides(calls: list[Any]) -> None:
    op = FeatureBuildOperator(
        task_id="examples", step="examples", ds="2026-11-02", overrides={"negative_downsample": 0.25, "sequence_length": None}
    )
    op.execute({})  # type: ignore[arg-type]
    name, args, kwargs = calls[-1]
    assert (name, args) == ("build_examples", ("/data", "2026-11-02"))
    assert kwargs["engine"] == build.DuckDBSettings(threads=3, memory_limit="1GB", temp_directory="/spill")
    assert (kwargs["negative_downsample"], kwargs["seed"], kwargs["prior_impressions"]) == (0.25, 5, 10.0)

    FeatureBuildOperator(task_id="window", step="window", ds="2026-11-02").execute({})  # type: ignore[arg-type]
    assert calls[-1][2]["window_days"] == 14


@pytest.mark.unit
def test_missing_input_is_a_data_failure(monkeypatch: pytest.MonkeyPatch, calls: list[Any]) -> None:
    def missing(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise build.MissingInputError("required input raw/events for ds=2026-11-02 is missing")

    monkeypatch.setattr(build, "build_daily", missing)
    with pytest.raises(DataError, match="raw/events for ds=2026-11-02"):
        FeatureBuildOperator(task_id="daily", step="daily", ds="2026-11-02").execute({})  # type: ignore[arg-type]


@pytest.mark.unit
def test_a_bad_param_fails_as_user_error_naming_it(calls: list[Any]) -> None:
    op = FeatureBuildOperator(task_id="examples", step="examples", ds="2026-11-02", overrides={"negative_downsample": 5})
    with pytest.raises(ConfigError, match="the run's params: features.negative_downsample = 5: .*less than or equal to 1") as err:
        op.execute({})  # type: ignore[arg-type]
    assert err.value.failure_class is FailureClass.USER and not calls


@pytest.mark.unit
def test_validation_is_required_unless_the_task_skips_it(calls: list[Any]) -> None:
    for step in ("daily", "window", "sequences", "examples"):
        FeatureBuildOperator(task_id=step, step=step, ds="2026-11-02").execute({})  # type: ignore[arg-type]
        assert calls[-1][2]["require_validation"] is True, step
        FeatureBuildOperator(task_id=step, step=step, ds="2026-11-02", skip_validation=True).execute({})  # type: ignore[arg-type]
        assert calls[-1][2]["require_validation"] is False, step
