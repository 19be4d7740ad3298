"""Bringing one's own data: a source whose pins carry 64-d embeddings and arrive as daily increments (only the
new pins each day), described by the configuration rather than by code.

Under ``validation.embedding_dim: 64`` every partition passes, and the validation command and the DAG's operator
give the same verdict on the same partition under the same configuration (under the default 32 both fail,
naming the check). The features built from the increments equal those built from full daily snapshots; the
ranker reads the width from the data, trains by a budget of examples (and warns that the run is short), and the
corpus scored is the whole view as of the day, not only that day's increment.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core import config, contracts, storage
from core.config import ValidationConfig
from core.failures import DataError
from features import build
from features.synthetic import WorldConfig, generate_world
from features.validate import validate_partition

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORLD = WorldConfig(start="2026-11-01", days=3, users=60, pins=80, seed=9, active_rate=0.9, embedding_dim=64,
                    incremental_pins=True)
DAYS = WORLD.day_list
WINDOW = {"window_days": 2, "sequence_length": 6}


class _TI:
    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own-data") / "storage"
    generate_world(root, WORLD)
    return root


def _command_verdict(root: Path, dataset: str, ds: str, env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``python -m features.validate`` (its main, in this process: the same configuration loading)."""
    from features.validate import main

    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        config.load.cache_clear()
        try:
            code = main([dataset, "--root", str(root), "--ds", ds, "--no-data-docs"])
        finally:
            config.load.cache_clear()
    out = capsys.readouterr()
    return code, out.out + out.err


def _operator_verdict(root: Path, dataset: str, ds: str, env: dict[str, str]) -> dict[str, Any]:
    """The verdict of the validation task of the DAG: its operator, configured as the DAG's workers are."""
    from operators.validation import ValidatePartitionOperator

    ti = _TI()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**env, "PINFLOW_STORAGE_ROOT": str(root), "PINFLOW_VALIDATION__DATA_DOCS": "false"}.items():
            patch.setenv(name, value)
        config.load.cache_clear()
        try:
            ValidatePartitionOperator(task_id=f"validate_{dataset}", dataset=dataset, ds=ds).execute({"ti": ti})  # type: ignore[arg-type]
        except DataError:
            pass
        finally:
            config.load.cache_clear()
    return dict(ti.xcom["validation"])


def test_the_command_and_the_dag_give_one_verdict_under_one_configuration(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    for dim, passes in ((64, True), (32, False)):
        env = {"PINFLOW_VALIDATION__EMBEDDING_DIM": str(dim)}
        # A copy per verdict: the operator quarantines a failed partition, as the DAG does.
        root = tmp_path / f"dim{dim}"
        shutil.copytree(storage.partition(world, contracts.RAW_PINS, DAYS[0]), storage.partition(root, contracts.RAW_PINS, DAYS[0]))
        code, output = _command_verdict(root, "pins", DAYS[0], env, capsys)
        summary = _operator_verdict(root, "pins", DAYS[0], env)
        assert (code == 0) is passes is summary["success"], output
        if not passes:
            assert code == 2 and summary["failed_checks"] == ["embedding.length"], (output, summary)
            assert "embedding.length" in output and "32" in output


def test_a_64d_incremental_world_validates_builds_trains_and_scores_the_whole_corpus(world: Path, tmp_path: Path):
    validation = ValidationConfig(embedding_dim=64)
    for ds in DAYS:
        for dataset in ("pins", "events", "pin_labels"):  # the datasets that read the pins view
            report = validate_partition(world, dataset, ds, config=validation, data_docs=False)
            assert report.success, report.failure_message()
    assert storage.read_metadata(world, contracts.RAW_PINS, DAYS[-1])["snapshot"] == "incremental"
    increment = storage.read_table(world, contracts.RAW_PINS, DAYS[-1], columns=["pin_id"]).num_rows
    corpus, _ = storage.read_snapshot(world, contracts.RAW_PINS, DAYS[-1], "pin_id", [])
    assert 0 < increment < corpus.num_rows

    # The features of increments equal those of full daily snapshots of the same world.
    full = tmp_path / "full"
    generate_world(full, WorldConfig(**{**WORLD.__dict__, "incremental_pins": False}))
    for ds in DAYS:
        build.build_day(world, ds, **WINDOW)  # validated above
        build.build_day(full, ds, **WINDOW, require_validation=False)  # the same world, a reference only
    for dataset in contracts.FEATURE_OUTPUTS:
        for ds in DAYS:
            assert storage.read_table(world, dataset, ds).equals(storage.read_table(full, dataset, ds)), (dataset, ds)

    # Training by a budget of examples, on the width the data has.
    job, batch, target = tmp_path / "job", 32, 200
    run_config = {
        "root": str(world), "train_days": DAYS[1:-1], "eval_ds": DAYS[-1], "output_dir": str(job),
        "checkpoint_dir": str(tmp_path / "checkpoints"), "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "mlflow_artifact_location": str(tmp_path / "artifacts"), "batch_size": batch, "target_examples": target,
        "num_threads": 1, "checkpoint_every": 0, "heartbeat_every_s": 1.0,
        "params": {"ablation": False, "sequence_length": WINDOW["sequence_length"]},
    }
    storage.write_json(job / "RUN.json", run_config)
    proc = subprocess.run([sys.executable, "-m", "training.train", "--config", str(job / "RUN.json")],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = storage.read_json(job / "result.json")
    assert result["steps"] == math.ceil(target / batch)
    assert result["examples_seen"] >= target
    assert any("min_steps=100" in w for w in result["warnings"]) and any("warmup" in w for w in result["warnings"])
    assert result["metrics"]["mean_auc"] is not None

    import mlflow

    mlflow.set_tracking_uri(run_config["mlflow_tracking_uri"])
    spec = mlflow.artifacts.load_dict(f"runs:/{result['mlflow_run_id']}/feature_spec.json")
    assert spec["embedding_dim"] == 64

    # The corpus scored is the view as of the day: every pin once, not only that day's increment.
    from training import inference

    out = str(tmp_path / "scores")
    for shard in range(2):
        inference.score_shard(model_uri=result["model_uri"], tracking_uri=run_config["mlflow_tracking_uri"],
                              root=str(world), ds=DAYS[-1], shard=shard, num_shards=2, out_dir=out)
    manifest = inference.publish_manifest(out, 2, result["model_uri"], DAYS[-1])
    assert manifest["rows"] == corpus.num_rows
