"""A rebuild of a training run's inputs while it trains does not disturb the run (issue 16).

A real 2-process ``torchrun`` job (gloo, deterministic CPU) trains on examples that reference their user's
sequence (``features/user_sequence`` of the day before). Its inputs are pinned first, as the training operator pins
them on submit (``operators.training.pin_inputs``). Once both ranks train, a training day's examples (other rows,
another count: without pins the ranks would split), the sequences they and the evaluation day reference, and the
evaluation day's ``raw/pins`` snapshot are rebuilt through ``core.storage.publish``. The run ends as a run on the
undisturbed data does, bitwise (final checkpoint) and in its metrics, and RUN.json, result.json and MLflow record the
pinned versions. On an object store (moto server) a pin records the version folder the partition's marker names
and keeps reading it after a rebuild; once a later publish removed it, a read fails as DATA instead of mixing
versions.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import s3_bucket
from test_train_torchrun import REPO, assert_bitwise_equal, final_state, run, run_config

from core import contracts, storage
from core.contracts import EXAMPLES, RAW_PINS, USER_SEQUENCE
from core.failures import DataError
from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.integration

DAYS = ["2026-01-01", "2026-01-02", "2026-01-03", "2026-01-04"]
TRAIN_DAYS, EVAL_DS = DAYS[1:3], DAYS[3]
LAUNCH = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config"]
COMMON = {
    "strategy": "ddp",
    "deterministic": True,
    "register": False,
    "params": {"ablation": False},
    "epochs": 2,
    "batch_size": 16,
    "checkpoint_every": 4,
    "keep_checkpoints": 1,
    "min_steps": 0,  # short on purpose: exactly the epochs asked for
}


def reference_sequences(root: Path, day: str, seed: int) -> None:
    """Rewrite the examples of ``day`` (inline sequences, as the tiny world writes them) the way the feature build
    writes them: each row references the first ``seq_len`` actions of its user's row in ``features/user_sequence``
    of the day before, written here too (actions during that day: before every impression of ``day``)."""
    rng = np.random.default_rng(seed)
    previous = storage.shift_ds(day, -1)
    examples = storage.read_table(root, EXAMPLES, day)
    pins = storage.read_table(root, RAW_PINS, day, columns=["pin_id", "category"])
    users = np.unique(examples.column("user_id").to_numpy())
    lengths = rng.integers(0, 21, size=len(users))
    picks = [rng.integers(0, pins.num_rows, size=n) for n in lengths]
    start = dt.datetime.fromisoformat(previous).replace(tzinfo=dt.UTC)
    sequences = pa.table(
        {
            "user_id": users,
            "seq_pin_ids": [pins.column("pin_id").to_numpy()[p].tolist() for p in picks],
            "seq_actions": [rng.integers(1, len(contracts.ACTIONS), size=n).tolist() for n in lengths],
            "seq_categories": [pins.column("category").to_numpy()[p].tolist() for p in picks],
            "seq_ts": [sorted((start + dt.timedelta(seconds=int(s)) for s in rng.integers(0, 86_400, n)),
                              reverse=True) for n in lengths],
        }
    ).cast(contracts.USER_SEQUENCE_SCHEMA)
    storage.write_table(root, USER_SEQUENCE, previous, sequences)
    available = dict(zip(users.tolist(), lengths.tolist(), strict=True))
    seq_len = [int(rng.integers(0, available[u] + 1)) for u in examples.column("user_id").to_pylist()]
    columns = {name: examples.column(name) for name in contracts.EXAMPLES_SCHEMA.names if name in examples.column_names}
    columns["seq_ds"] = pa.array([dt.date.fromisoformat(previous)] * examples.num_rows, pa.date32())
    columns["seq_len"] = pa.array(seq_len, pa.int32())
    table = pa.table(columns).select(contracts.EXAMPLES_SCHEMA.names).cast(contracts.EXAMPLES_SCHEMA)
    with storage.write_partition(root, EXAMPLES, day) as staging:
        pq.write_table(table, Path(staging) / storage.DATA_FILE, row_group_size=40)
        storage.write_json(Path(staging) / storage.METADATA_FILE, {
            "sequence_ds": previous, "sequence_digest": contracts.sequence_digest(sequences)})


def write_world(root: Path, *, seed: int, rows: int) -> None:
    write_tiny_world(root, DAYS, rows_per_day=rows, pins=90, row_group_size=40, max_sequence=20, seed=seed)
    for i, day in enumerate(DAYS[1:]):
        reference_sequences(root, day, seed * 100 + i)


def republish(source: Path, root: Path, dataset: str, day: str) -> None:
    """Rebuild a partition of ``root`` with the files of the same partition under ``source`` (one publish)."""
    with storage.publish(storage.partition(root, dataset, day)) as staging:
        storage.copy_tree(storage.partition(source, dataset, day), staging)
        storage.remove(storage.join(staging, storage.MARKER))  # publish writes the marker last


def beats(job: Path) -> list[dict]:
    out = []
    for rank in (0, 1):
        try:
            out.append(json.loads((job / f"heartbeat-rank{rank}.json").read_text()))
        except (OSError, ValueError):
            out.append({})
    return out


def test_a_rebuild_during_training_does_not_disturb_the_run(tmp_path: Path):
    from mlflow import MlflowClient

    from operators.training import pin_inputs
    from training.data import read_examples

    root = tmp_path / "storage"
    write_world(root, seed=0, rows=160)
    rebuilt = tmp_path / "rebuilt"  # the same days built from other data: other rows, another row count
    write_world(rebuilt, seed=5, rows=96)
    before = read_examples(root, TRAIN_DAYS[1])

    # Undisturbed.
    straight = tmp_path / "straight"
    straight.mkdir()
    proc = run([*LAUNCH, str(run_config(straight, **COMMON, root=str(root), train_days=TRAIN_DAYS, eval_ds=EVAL_DS))])
    assert proc.returncode == 0, proc.stderr[-4000:]

    # Pinned as the operator pins on submit, then rebuilt while both ranks train.
    pins_dir = tmp_path / "models" / "run" / "inputs"
    inputs = pin_inputs(str(root), str(pins_dir), EXAMPLES, TRAIN_DAYS, EVAL_DS)
    assert sorted(inputs[EXAMPLES]) == [*TRAIN_DAYS, EVAL_DS]
    assert sorted(inputs[USER_SEQUENCE]) == DAYS[:3]
    assert sorted(inputs[RAW_PINS]) == [TRAIN_DAYS[1], EVAL_DS]  # full snapshots every day in the tiny world
    disturbed = tmp_path / "disturbed"
    disturbed.mkdir()
    config = run_config(disturbed, **COMMON, root=str(root), train_days=TRAIN_DAYS, eval_ds=EVAL_DS, inputs=inputs,
                        debug_step_sleep_s=0.3, heartbeat_every_s=0.1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([sys.executable, *LAUNCH, str(config)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    rebuilt_at = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and job.poll() is None:
            if all(b.get("phase") == "training" and b.get("step", 0) >= 1 for b in beats(disturbed / "job")):
                for dataset, day in [(EXAMPLES, TRAIN_DAYS[1]), (USER_SEQUENCE, TRAIN_DAYS[0]),
                                     (USER_SEQUENCE, TRAIN_DAYS[1]), (RAW_PINS, EVAL_DS)]:
                    republish(rebuilt, root, dataset, day)
                rebuilt_at = [b.get("step") for b in beats(disturbed / "job")]
                still = [b.get("phase") in ("training", "checkpointing") and b["step"] < b["total_steps"]
                         for b in beats(disturbed / "job")]
                assert all(still), f"the run ended before the rebuild was done: {rebuilt_at}"
                break
            time.sleep(0.02)
        _, stderr = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert rebuilt_at is not None, f"the ranks never reached a training step: {stderr[-3000:]}"
    assert job.returncode == 0, stderr[-4000:]
    assert read_examples(root, TRAIN_DAYS[1]).num_rows == 96 != before.num_rows  # the live day was rebuilt

    a = final_state(straight / "checkpoints", tmp_path, "straight")
    b = final_state(disturbed / "checkpoints", tmp_path, "disturbed")
    assert a["step"] == b["step"] > max(rebuilt_at)
    assert_bitwise_equal(a, b)  # model, optimizer, data position, RNG states
    result_a = json.loads((straight / "job" / "result.json").read_text())
    result_b = json.loads((disturbed / "job" / "result.json").read_text())
    assert result_b["metrics"] == result_a["metrics"]
    assert result_b["examples_seen"] == result_a["examples_seen"]

    # The versions read are recorded: RUN.json, result.json, MLflow (a param per partition, the manifest).
    versions = {dataset: {day: entry["version"] for day, entry in days.items()} for dataset, days in inputs.items()}
    assert json.loads(config.read_text())["inputs"] == inputs
    assert result_b["inputs"] == versions and result_a["inputs"] == {}
    uri = f"sqlite:///{disturbed / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    params = client.get_run(result_b["mlflow_run_id"]).data.params
    assert params[f"input.{EXAMPLES}.{TRAIN_DAYS[1]}"] == versions[EXAMPLES][TRAIN_DAYS[1]]
    assert params[f"input.{USER_SEQUENCE}.{TRAIN_DAYS[1]}"] == versions[USER_SEQUENCE][TRAIN_DAYS[1]]
    assert "inputs" not in params
    manifest = client.download_artifacts(result_b["mlflow_run_id"], "inputs.json", str(tmp_path))
    assert json.loads(Path(manifest).read_text()) == inputs


@pytest.fixture
def s3(moto_server: str, tmp_path: Path):
    with s3_bucket(moto_server, tmp_path, "pinflow-pins") as fs:
        yield fs


def test_on_an_object_store_a_pin_records_the_version_and_a_changed_one_fails_as_data(
    tmp_path: Path, s3, monkeypatch: pytest.MonkeyPatch
):
    from operators.training import pin_inputs

    root = "s3://pinflow-pins/storage"
    pins_dir = "s3://pinflow-pins/storage/models/pin_ranker/run/inputs"
    table = pa.table({"x": np.arange(1000)})
    for day in DAYS:
        storage.write_table(root, EXAMPLES, day, table, {"rows": 1000})
        storage.write_table(root, RAW_PINS, day, table)
    inputs = pin_inputs(root, pins_dir, EXAMPLES, DAYS[:2], DAYS[2])
    pin = storage.Pin.from_dict(EXAMPLES, DAYS[0], inputs[EXAMPLES][DAYS[0]])
    source = storage.partition(root, EXAMPLES, DAYS[0])
    # The version folder the partition's marker names: never changed once published, nothing copied.
    assert pin.frozen and pin.source == source and pin.location == storage.resolve(source) != source
    assert all(info["etag"] for info in pin.files.values())  # the ETags of the objects
    assert storage.list_names(pins_dir) == [storage.PINS_FILE]
    assert pin_inputs(root, pins_dir, EXAMPLES, DAYS[:2], DAYS[2]) == inputs  # every try reuses them

    run = storage.InputPins.of(root, inputs)  # the root as the run reads it
    files = storage.data_files(run, EXAMPLES, DAYS[0])
    assert storage.read_table(run, EXAMPLES, DAYS[0]).num_rows == 1000
    assert storage.read_metadata(run, EXAMPLES, DAYS[0]) == {"rows": 1000}
    with storage.parquet_file(files[0], run) as parquet:  # opened on the pinned version ...
        storage.write_table(root, EXAMPLES, DAYS[0], pa.table({"x": np.arange(7)}))  # ... rebuilt meanwhile
        assert parquet.read_row_group(0).num_rows == 1000  # the pinned version is still there
    assert storage.read_table(run, EXAMPLES, DAYS[0]).num_rows == 1000  # and still read after the rebuild
    assert storage.read_metadata(run, EXAMPLES, DAYS[0]) == {"rows": 1000}
    storage.write_table(root, EXAMPLES, DAYS[0], pa.table({"x": np.arange(6)}))  # a second rebuild soon after:
    assert storage.read_table(run, EXAMPLES, DAYS[0]).num_rows == 1000  # the grace keeps the pinned version
    monkeypatch.setattr(storage.publishing, "SUPERSEDED_GRACE_SECONDS", 0.0)  # a rebuild after the grace removes it
    with pytest.raises(DataError, match=rf"examples partition ds={DAYS[0]} .* changed during this run"):
        with storage.parquet_file(files[0], run) as parquet:  # opened on the pinned version ...
            storage.write_table(root, EXAMPLES, DAYS[0], pa.table({"x": np.arange(5)}))  # ... which this removes
            parquet.read_row_group(0)
    for read in (storage.data_files, storage.read_table, storage.read_metadata):
        with pytest.raises(DataError, match="the run pinned version .* version folder was removed by later"):
            read(run, EXAMPLES, DAYS[0])
    with pytest.raises(DataError, match="start a new run of the training"):
        with storage.parquet_file(files[0], run):
            pass
    assert storage.read_table(run, EXAMPLES, DAYS[1]).num_rows == 1000  # the other days are as pinned
    assert storage.read_table(root, EXAMPLES, DAYS[0]).num_rows == 5
