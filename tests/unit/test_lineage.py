"""OpenLineage facets of the chain's operators (operators.lineage): names per the naming spec, real inputs/outputs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core import config, storage
from core.config import MlflowConfig, PlatformConfig
from operators import lineage

S3 = "s3://lake/pinflow"


def names(datasets: list[Any]) -> list[tuple[str, str]]:
    return [(d.namespace, d.name) for d in datasets]


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return str(tmp_path / "storage") if request.param == "local" else S3


def expect(root: str, path: str) -> tuple[str, str]:
    """The (namespace, name) a partition under ``root`` must have."""
    if root.startswith("s3://"):
        return "s3://lake", f"pinflow/{path}"
    return "file", f"{root}/{path}"


@pytest.mark.unit
def test_location_names_follow_the_naming_spec() -> None:
    assert lineage.location_names("/data/raw/events/ds=2026-11-01") == ("file", "/data/raw/events/ds=2026-11-01")
    assert lineage.location_names("file:///data/examples/ds=2026-11-01") == ("file", "/data/examples/ds=2026-11-01")
    assert lineage.location_names("file://nas1/data/x") == ("file://nas1", "/data/x")
    assert lineage.location_names("s3://lake/pinflow/examples/ds=2026-11-01/") == (
        "s3://lake", "pinflow/examples/ds=2026-11-01",
    )
    assert lineage.location_names("s3://lake/raw") == ("s3://lake", "raw")


@pytest.mark.unit
def test_validation_reads_the_raw_partition_and_writes_its_report(root: str) -> None:
    ol = lineage.validation_lineage(root, "events", "2026-11-01", [("row_count", True), ("null_user_id", False)])
    assert names(ol.inputs) == [expect(root, "raw/events/ds=2026-11-01")]
    assertions = ol.inputs[0].inputFacets["dataQualityAssertions"].assertions
    assert [(a.assertion, a.success) for a in assertions] == [("row_count", True), ("null_user_id", False)]
    assert names(ol.outputs) == [expect(root, "reports/validation/events/ds=2026-11-01")]


@pytest.mark.unit
def test_feature_build_reports_what_its_metadata_says_it_read(root: str) -> None:
    summary = {
        "features/user_window": {"dataset": "features/user_window", "ds": "2026-11-03",
                                 "inputs": ["features/user_daily/ds=2026-11-02", "raw/events/ds=2026-11-03",
                                            "raw/pins/ds=2026-11-03"]},
        "features/pin_window": {"dataset": "features/pin_window", "ds": "2026-11-03",
                                "inputs": ["features/pin_daily/ds=2026-11-02", "raw/events/ds=2026-11-03",
                                           "raw/pins/ds=2026-11-03"]},
    }
    ol = lineage.feature_lineage(root, "2026-11-03", summary)
    assert names(ol.outputs) == [expect(root, "features/user_window/ds=2026-11-03"),
                                 expect(root, "features/pin_window/ds=2026-11-03")]
    # Each input once, in the order the build named them.
    assert names(ol.inputs) == [expect(root, p) for p in (
        "features/user_daily/ds=2026-11-02", "raw/events/ds=2026-11-03", "raw/pins/ds=2026-11-03",
        "features/pin_daily/ds=2026-11-02",
    )]


@pytest.mark.unit
def test_training_reads_its_days_and_writes_the_registered_model(root: str) -> None:
    plan = {"model": "pin_ranker", "dataset": "examples", "train_days": ["2026-11-01", "2026-11-02"],
            "eval_ds": "2026-11-03"}
    result = {"model_name": "pin_ranker", "model_version": "7"}
    ol = lineage.training_lineage(root, "https://alice:secret@mlflow.internal:5000/", plan, result)
    assert names(ol.inputs) == [expect(root, f"examples/ds=2026-11-0{d}") for d in (1, 2, 3)]
    assert names(ol.outputs) == [("https://mlflow.internal:5000", "models/pin_ranker/7")]
    assert ol.outputs[0].facets["datasetType"].datasetType == "MODEL"
    assert lineage.tracking_namespace("sqlite:////home/me/mlflow/mlflow.db") == "sqlite:////home/me/mlflow/mlflow.db"
    assert lineage.tracking_namespace("http://mlflow:5000/") == "http://mlflow:5000"
    # A run that registered nothing has no output.
    assert lineage.training_lineage(root, "sqlite:////x/mlflow.db", plan, {"model_name": "pin_ranker"}).outputs == []


@pytest.mark.unit
def test_inference_reads_the_model_and_the_snapshot_and_writes_its_partition(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An incremental snapshot: the newest full partition and the increment after it.
    monkeypatch.setattr(storage, "snapshot_days", lambda r, d, ds: ["2026-11-03", "2026-11-04"])
    out_dir = storage.partition(root, "inference/pin_ranker/7", "2026-11-04")
    plan = {"model_name": "pin_ranker", "model_version": "7", "ds": "2026-11-04", "out_dir": out_dir}
    ol = lineage.inference_lineage(plan, root=root, tracking_uri="http://mlflow:5000")
    assert names(ol.inputs) == [("http://mlflow:5000", "models/pin_ranker/7"),
                                expect(root, "raw/pins/ds=2026-11-03"), expect(root, "raw/pins/ds=2026-11-04")]
    assert names(ol.outputs) == [expect(root, "inference/pin_ranker/7/ds=2026-11-04")]


@pytest.mark.unit
def test_stages_link_raw_to_scores(tmp_path: Any) -> None:
    """An output of each stage is an input of the next: examples → model → scores."""
    root = str(tmp_path)
    features = lineage.feature_lineage(root, "2026-11-03", {"examples": {"inputs": ["raw/events/ds=2026-11-03"]}})
    train = lineage.training_lineage(root, "http://mlflow:5000", {"train_days": ["2026-11-02"], "eval_ds": "2026-11-03"},
                                     {"model_name": "pin_ranker", "model_version": 3})
    score = lineage.inference_lineage({"model_name": "pin_ranker", "model_version": 3, "ds": "2026-11-03"},
                                      root=root, tracking_uri="http://mlflow:5000")
    assert set(names(features.outputs)) & set(names(train.inputs))
    assert set(names(train.outputs)) & set(names(score.inputs))
    assert names(score.outputs) == [("file", f"{root}/inference/pin_ranker/3/ds=2026-11-03")]


@pytest.mark.unit
def test_operators_report_their_lineage(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from operators.features import FeatureBuildOperator
    from operators.training import DistributedTrainingOperator
    from operators.validation import ValidatePartitionOperator

    root = str(tmp_path)
    platform = PlatformConfig(storage_root=root, mlflow=MlflowConfig(tracking_uri="http://mlflow:5000"))
    monkeypatch.setattr(config, "load", lambda: platform)

    # Read back from the output's metadata when this instance did not build it.
    meta = storage.partition(root, "features/user_sequence", "2026-11-02")
    storage.write_json(storage.join(meta, storage.METADATA_FILE),
                       {"inputs": ["features/user_sequence/ds=2026-11-01", "raw/events/ds=2026-11-02"]})
    op = FeatureBuildOperator(task_id="user_sequences", step="sequences", ds="2026-11-02")
    ol = op.get_openlineage_facets_on_complete(None)
    assert names(ol.inputs) == [("file", f"{root}/features/user_sequence/ds=2026-11-01"),
                                ("file", f"{root}/raw/events/ds=2026-11-02")]
    assert names(ol.outputs) == [("file", f"{root}/features/user_sequence/ds=2026-11-02")]

    val = ValidatePartitionOperator(task_id="validate_pins", dataset="pins", ds="2026-11-02")
    assert names(val.get_openlineage_facets_on_complete(None).inputs) == [("file", f"{root}/raw/pins/ds=2026-11-02")]

    class TaskInstance:
        def xcom_pull(self, task_ids: str) -> dict[str, Any]:
            return {"model_name": "pin_ranker", "model_version": "2"}

    train = DistributedTrainingOperator(task_id="train", plan={"train_days": ["2026-11-01"], "eval_ds": "2026-11-02"})
    ol = train.get_openlineage_facets_on_complete(TaskInstance())
    assert names(ol.outputs) == [("http://mlflow:5000", "models/pin_ranker/2")]
    assert names(ol.inputs) == [("file", f"{root}/examples/ds=2026-11-0{d}") for d in (1, 2)]


@pytest.mark.unit
def test_events_serialize() -> None:
    from openlineage.client.serde import Serde

    ol = lineage.training_lineage(S3, "http://mlflow:5000", {"train_days": [], "eval_ds": "2026-11-02"},
                                  {"model_name": "m", "model_version": "1"})
    payload = json.loads(Serde.to_json(ol.outputs[0]))
    assert payload["name"] == "models/m/1" and payload["facets"]["datasetType"]["datasetType"] == "MODEL"


@pytest.mark.unit
def test_openlineage_is_off_without_a_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded default configures no transport: the provider stays disabled (no listener, no network)."""
    from airflow.providers.openlineage import conf

    for name in ("AIRFLOW__OPENLINEAGE__TRANSPORT", "AIRFLOW__OPENLINEAGE__CONFIG_PATH", "OPENLINEAGE_URL",
                 "OPENLINEAGE_CONFIG", "AIRFLOW__OPENLINEAGE__DISABLED"):
        monkeypatch.delenv(name, raising=False)
    # Under pytest the provider does not cache its settings.
    assert conf.is_disabled()
