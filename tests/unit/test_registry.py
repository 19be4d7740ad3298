"""The promotion gate and the corpus-inference plan against the MLflow registry: "not found" is an answer,
an outage is INFRA (retried) and never promotes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from core import config
from core.config import JobHistoryConfig, MlflowConfig, PlatformConfig
from core.failures import FailureClass, InfraError, UserError
from operators import registry
from operators.inference import plan_inference
from operators.promotion import promote_if_better

pytestmark = pytest.mark.unit
RESULT = {"model_name": "pin_ranker", "model_version": "1", "metrics": {"auc": {"click": 0.7}, "mean_auc": 0.7},
          "eval_ds": "2026-11-20", "steps": 500, "warmup_steps": 20, "train_days": ["2026-11-19"], "champion": None}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


@pytest.fixture
def use_mlflow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def use(tracking_uri: str) -> None:
        platform = PlatformConfig(storage_root=str(tmp_path / "storage"), mlflow=MlflowConfig(tracking_uri=tracking_uri),
                                  job_history=JobHistoryConfig(url=f"sqlite:///{tmp_path / 'history.db'}"))
        monkeypatch.setattr(config, "load", lambda: platform)

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    return use


def test_an_mlflow_outage_is_infra_and_promotes_nothing(use_mlflow):
    use_mlflow(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(InfraError, match="MLflow registry at http://127.0.0.1") as err:
        promote_if_better(RESULT, tolerance=0.0)
    assert err.value.failure_class is FailureClass.INFRA
    with pytest.raises(InfraError):
        plan_inference("pin_ranker", "champion", None, 2)


def test_the_first_model_above_its_floors_is_promoted_and_an_unknown_version_is_a_user_error(use_mlflow, tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    use_mlflow(uri)
    client = registry.client(MlflowConfig(tracking_uri=uri))
    client.create_registered_model("pin_ranker")
    run = client.create_run(client.create_experiment("x")).info
    client.log_metric(run.run_id, "eval_mean_auc", 0.7)
    client.log_param(run.run_id, "eval_ds", "2026-11-20")
    client.create_model_version("pin_ranker", "runs:/x/model", run_id=run.run_id)
    assert registry.champion(client, "pin_ranker") is None

    decision = promote_if_better(RESULT, tolerance=0.0)
    assert decision["promoted"] and decision["reason"].startswith("the family's first model; every head clears")
    assert str(registry.champion(client, "pin_ranker").version) == "1"
    tag = client.get_model_version("pin_ranker", "1").tags["promotion"]
    assert tag.startswith("promoted: the family's first model") and "click 0.7000" in tag
    assert promote_if_better(RESULT, tolerance=0.0)["reason"] == "version 1 is already the champion"  # a retry

    with pytest.raises(UserError, match="no version or alias '7'"):
        plan_inference("pin_ranker", "7", None, 2)


def test_not_found_from_a_tracking_server_is_an_answer():
    """A tracking server answers "not found" with a RestException (an MlflowException subclass): no champion yet."""
    from mlflow.exceptions import RestException

    class Registry:
        tracking_uri = "http://mlflow:5000"

        def get_model_version_by_alias(self, name: str, alias: str) -> None:
            raise RestException({"error_code": "INVALID_PARAMETER_VALUE",
                                 "message": f"Registered model alias {alias} not found."})

    assert registry.champion(Registry(), "pin_ranker") is None  # type: ignore[arg-type]
    with pytest.raises(UserError, match="no version or alias 'champion'"):
        registry.model_version(Registry(), "pin_ranker", "champion")  # type: ignore[arg-type]
