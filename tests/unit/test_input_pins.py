"""A training run's pinned inputs (core.storage pins, operators.training.pin_inputs) on a local root: the pinned
version is a hard-linked copy that a rebuild does not change, readers resolve pinned partitions to it, every try of
one run reuses the pins, a pin taken during a publish holds one whole version. (Object store: the version check
against a moto server is in tests/integration/test_rebuild_during_training.py.)"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from core import storage
from core.contracts import EXAMPLES, RAW_PINS, USER_SEQUENCE
from core.failures import ConfigError, DataError
from operators.compute_job import JobRef

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DAYS = ["2026-01-01", "2026-01-02", "2026-01-03"]


def table(day: str, rows: int, tag: int = 0) -> pa.Table:
    return pa.table({"x": list(range(tag, tag + rows)), "day": [day] * rows})


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Examples on three days (referencing the user_sequence of the day before), user_sequence, raw/pins (a full
    snapshot on the first day, increments after it)."""
    root = tmp_path / "storage"
    for i, day in enumerate(DAYS):
        previous = storage.shift_ds(day, -1)
        storage.write_table(root, EXAMPLES, day, table(day, 10 + i),
                            {"sequence_ds": previous, "sequence_digest": f"digest-{previous}"})
        storage.write_table(root, USER_SEQUENCE, previous, table(previous, 3))
        storage.write_table(root, RAW_PINS, day, table(day, 4), {"snapshot": "full" if i == 0 else "incremental"})
    storage.write_table(root, RAW_PINS, "2025-12-30", table("2025-12-30", 4))  # before the view: not pinned
    return root


def pins_dir(tmp_path: Path) -> Path:
    return tmp_path / "storage" / "models" / "pin_ranker" / "run-x" / "inputs"


def pin(root: Path, tmp_path: Path) -> dict:
    from operators.training import pin_inputs

    return pin_inputs(str(root), str(pins_dir(tmp_path)), EXAMPLES, DAYS[:2], DAYS[2])


def test_a_pin_is_a_hard_linked_copy_of_the_published_version(root: Path, tmp_path: Path):
    live = Path(storage.partition(root, EXAMPLES, DAYS[0]))
    p = storage.pin_partition(root, EXAMPLES, DAYS[0], pins_dir(tmp_path))
    assert p.frozen and Path(p.location) == pins_dir(tmp_path) / EXAMPLES / f"ds={DAYS[0]}"
    assert set(p.files) == {storage.DATA_FILE, storage.MARKER, storage.METADATA_FILE}
    for name in p.files:  # the same inode: no bytes copied
        assert os.stat(Path(p.location) / name).st_ino == os.stat(live / name).st_ino
    assert p.marker == (live / storage.MARKER).read_text()
    again = storage.pin_partition(root, EXAMPLES, DAYS[0], tmp_path / "other")
    assert again.version == p.version  # the version names what was published, not where it is pinned

    storage.write_table(root, EXAMPLES, DAYS[0], table(DAYS[0], 99, tag=1000))  # a rebuild
    assert storage.read_parquet(Path(p.location) / storage.DATA_FILE).num_rows == 10  # the pinned copy stays
    assert storage.pin_partition(root, EXAMPLES, DAYS[0], tmp_path / "third").version != p.version


def test_readers_of_a_pinned_root_read_the_pinned_versions(root: Path, tmp_path: Path):
    inputs = pin(root, tmp_path)
    # A rebuild of everything the run reads, and a new raw/pins day inside the snapshot's view.
    for day in DAYS:
        storage.write_table(root, EXAMPLES, day, table(day, 50, tag=500), {"sequence_ds": "2020-01-01"})
    storage.write_table(root, USER_SEQUENCE, DAYS[1], table(DAYS[1], 7, tag=700))
    storage.write_table(root, RAW_PINS, DAYS[1], table(DAYS[1], 8, tag=800), {"snapshot": "full"})

    run = storage.InputPins.of(root, inputs)  # the root as the run reads it
    assert storage.read_table(run, EXAMPLES, DAYS[1]).column("x").to_pylist() == list(range(11))
    assert storage.read_metadata(run, EXAMPLES, DAYS[1])["sequence_ds"] == DAYS[0]
    assert storage.read_table(run, USER_SEQUENCE, DAYS[1]).num_rows == 3
    assert all(f.startswith(str(pins_dir(tmp_path))) for f in storage.data_files(run, EXAMPLES, DAYS[2]))
    assert storage.is_complete(run, EXAMPLES, DAYS[0])
    assert storage.complete_days(run, RAW_PINS) == DAYS  # the pinned view, not the rebuilt full day
    assert storage.snapshot_days(run, RAW_PINS, DAYS[2]) == DAYS
    snap, newest = storage.read_snapshot(run, RAW_PINS, DAYS[2], "x")
    assert newest == DAYS[2] and snap.num_rows == 4
    # A path spelled otherwise (file://, a trailing slash) is the same root.
    assert storage.read_table(storage.InputPins.of(f"file://{root}/", inputs), EXAMPLES, DAYS[0]).num_rows == 10
    # Partitions the run did not pin are read live; writers write the live partitions.
    assert storage.read_table(run, RAW_PINS, "2025-12-30").num_rows == 4

    # Nothing is installed anywhere: the plain root reads the live partitions, before and after.
    assert storage.read_table(root, EXAMPLES, DAYS[1]).num_rows == 50
    assert storage.complete_days(root, RAW_PINS) == ["2025-12-30", *DAYS]
    assert storage.pinned(root, EXAMPLES, DAYS[1]) is None
    assert storage.read_table(run, EXAMPLES, DAYS[1]).num_rows == 11


def test_pin_inputs_pins_the_days_their_sequences_and_the_snapshot_views(root: Path, tmp_path: Path):
    inputs = pin(root, tmp_path)
    assert sorted(inputs[EXAMPLES]) == DAYS
    assert sorted(inputs[USER_SEQUENCE]) == ["2025-12-31", *DAYS[:2]]  # sequence_ds of each examples day
    assert sorted(inputs[RAW_PINS]) == DAYS  # the views as of the last training day and the evaluation day
    manifest = storage.read_json(pins_dir(tmp_path) / storage.PINS_FILE)
    assert manifest == {"plan": {"dataset": EXAMPLES, "train_days": DAYS[:2], "eval_ds": DAYS[2]}, "inputs": inputs}
    for dataset, days in inputs.items():
        for day, entry in days.items():
            assert Path(entry["location"]) == pins_dir(tmp_path) / dataset / f"ds={day}"
            assert entry["source"] == storage.partition(root, dataset, day)


def test_every_try_of_a_run_reuses_its_pins(root: Path, tmp_path: Path):
    first = pin(root, tmp_path)
    data = pins_dir(tmp_path) / EXAMPLES / f"ds={DAYS[1]}" / storage.DATA_FILE
    inode = os.stat(data).st_ino
    storage.write_table(root, EXAMPLES, DAYS[1], table(DAYS[1], 77, tag=7))  # rebuilt between two tries
    assert pin(root, tmp_path) == first  # the retry reads what the checkpoints were trained on
    assert os.stat(data).st_ino == inode

    # A pinned copy gone (removed after a finished run): everything is pinned again, the rebuilt day's new version.
    from operators.training import release_pinned_copies

    release_pinned_copies(str(pins_dir(tmp_path).parent / "checkpoints"))
    assert storage.list_names(pins_dir(tmp_path)) == [storage.PINS_FILE]
    again = pin(root, tmp_path)
    assert again[EXAMPLES][DAYS[1]]["version"] != first[EXAMPLES][DAYS[1]]["version"]
    assert again[EXAMPLES][DAYS[0]]["version"] == first[EXAMPLES][DAYS[0]]["version"]


def test_pins_made_for_other_days_are_replaced(root: Path, tmp_path: Path):
    from operators.training import pin_inputs

    pin(root, tmp_path)
    inputs = pin_inputs(str(root), str(pins_dir(tmp_path)), EXAMPLES, DAYS[:1], DAYS[1])
    assert sorted(inputs[EXAMPLES]) == DAYS[:2]
    assert sorted(p.name for p in (pins_dir(tmp_path) / EXAMPLES).iterdir()) == [f"ds={d}" for d in DAYS[:2]]


def test_a_missing_input_fails_as_data_naming_it_and_pins_nothing(root: Path, tmp_path: Path):
    from operators.training import pin_inputs

    storage.remove_tree(storage.partition(root, USER_SEQUENCE, DAYS[0]))
    with pytest.raises(DataError, match=rf"features/user_sequence partition ds={DAYS[0]} is missing"):
        pin(root, tmp_path)
    assert not (pins_dir(tmp_path) / storage.PINS_FILE).exists()
    (Path(storage.partition(root, EXAMPLES, "2026-02-01"))).mkdir(parents=True)  # no marker: incomplete
    with pytest.raises(DataError, match="examples partition ds=2026-02-01 is incomplete: no _SUCCESS"):
        pin_inputs(str(root), str(pins_dir(tmp_path)), EXAMPLES, ["2026-02-01"], DAYS[2])


def test_a_pinned_copy_removed_by_hand_is_named_when_read(root: Path, tmp_path: Path):
    inputs = pin(root, tmp_path)
    storage.remove_tree(inputs[EXAMPLES][DAYS[0]]["location"])
    with pytest.raises(FileNotFoundError, match="pinned copy of examples partition ds=2026-01-01 is missing"):
        storage.data_files(storage.InputPins.of(root, inputs), EXAMPLES, DAYS[0])


def test_files_are_copied_where_hard_links_fail(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def cross_device(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    p = storage.pin_partition(root, EXAMPLES, DAYS[0], pins_dir(tmp_path))
    live = Path(storage.partition(root, EXAMPLES, DAYS[0]))
    for name in p.files:
        copy = Path(p.location) / name
        assert copy.read_bytes() == (live / name).read_bytes() and os.stat(copy).st_ino != os.stat(live / name).st_ino


# Publishes the folder over and over; every file of one version holds the same token.
WRITER = textwrap.dedent(
    """
    import sys
    from core import storage

    final, rounds = sys.argv[1], int(sys.argv[2])
    for i in range(rounds):
        with storage.publish(final) as staging:
            for name in ("a.txt", "b.txt", "c.txt"):
                storage.write_text(storage.join(staging, name), f"v{i}\\n" * 20000)
    """
)


def test_a_pin_taken_while_the_partition_is_republished_holds_one_whole_version(tmp_path: Path):
    root = tmp_path / "storage"
    final = storage.partition(root, EXAMPLES, DAYS[0])
    with storage.publish(final) as staging:
        for name in ("a.txt", "b.txt", "c.txt"):
            storage.write_text(storage.join(staging, name), "start\n")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, final, "300"], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    versions = set()
    gave_up = 0
    try:
        while writer.poll() is None:
            target = tmp_path / "pins" / str(len(versions))
            try:
                p = storage.pin_partition(root, EXAMPLES, DAYS[0], target)
            except OSError as err:
                # On a loaded machine the writer can republish under every one of a pin's attempts: the pin then says
                # so (and leaves nothing) instead of holding a mixed version.
                assert "times while it was being pinned: pin it again later" in str(err) and not target.exists()
                gave_up += 1
                continue
            tokens = {(Path(p.location) / name).read_text() for name in ("a.txt", "b.txt", "c.txt")}
            assert len(tokens) == 1, f"a pin mixed versions: {[t[:8] for t in tokens]}"
            assert set(p.files) == {"a.txt", "b.txt", "c.txt", storage.MARKER}
            versions.add(p.version)
            storage.remove_tree(target)
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert len(versions) > 1, f"{len(versions)} pins taken, {gave_up} gave up"  # pinned while it was republished
    assert sorted(os.listdir(Path(final).parent)) == [f"ds={DAYS[0]}"]  # nothing left behind


def test_run_config_takes_a_pin_manifest_and_refuses_a_malformed_one(root: Path, tmp_path: Path):
    from training.config import RunConfig

    base = {"root": str(root), "train_days": DAYS[:2], "eval_ds": DAYS[2], "output_dir": str(tmp_path / "job"),
            "checkpoint_dir": str(tmp_path / "ckpt"), "mlflow_tracking_uri": "sqlite:///x.db"}
    inputs = pin(root, tmp_path)
    config = RunConfig.from_dict({**base, "inputs": inputs})
    assert config.inputs == inputs and RunConfig.from_dict(base).inputs == {}
    assert config.input_versions()[EXAMPLES] == {d: inputs[EXAMPLES][d]["version"] for d in DAYS}
    with pytest.raises(ConfigError, match="inputs: pinned input examples ds=2026-01-01 lacks location"):
        RunConfig.from_dict({**base, "inputs": {EXAMPLES: {DAYS[0]: {"version": "abc"}}}})
    with pytest.raises(ConfigError, match=r"inputs\['examples'\]"):
        RunConfig.from_dict({**base, "inputs": {EXAMPLES: ["2026-01-01"]}})
    assert storage.pinned(config.input_root, EXAMPLES, DAYS[0]) is not None
    assert storage.pinned(RunConfig.from_dict(base).input_root, EXAMPLES, DAYS[0]) is None


def test_the_operator_writes_the_pins_to_run_json_and_every_try_reuses_them(root: Path, tmp_path: Path, monkeypatch):
    """The training operator on a scripted backend (tests/unit/test_triggers_operator.py): the first try pins,
    a retry after a failed job gets the same manifest, a succeeded run releases the copies."""
    from airflow.sdk.exceptions import TaskDeferred
    from test_triggers_operator import TI, Backend, Store

    from core import config
    from core.contracts import MODELS
    from operators.backends import JobState
    from operators.training import DistributedTrainingOperator
    from training.config import RunConfig

    cfg = config.read().model_copy(update={"storage_root": str(root)})
    monkeypatch.setattr(config, "load", lambda: cfg)
    backend = Backend()
    monkeypatch.setattr("operators.backends.get_backend", lambda name, cfg=None, home=None: backend)
    monkeypatch.setattr(DistributedTrainingOperator, "_preflight", lambda self, backend, tracking_uri: None)

    def submit(try_number: int) -> RunConfig:
        op = DistributedTrainingOperator(task_id="train", plan={"train_days": DAYS[:2], "eval_ds": DAYS[2]},
                                         backend="local", nodes=1, procs_per_node=2)
        with pytest.raises(TaskDeferred) as deferred:
            op.execute({"ti": TI(try_number), "task_state_store": Store()})
        job = deferred.value.trigger.serialize()[1]
        return RunConfig.from_json(storage.join(job["output_dir"], "RUN.json"))

    first = submit(1)
    run_folder = Path(first.checkpoint_dir).parent
    assert run_folder.parent == root / MODELS / "pin_ranker"
    assert sorted(first.inputs) == sorted([EXAMPLES, RAW_PINS, USER_SEQUENCE])
    assert all(Path(e["location"]).is_relative_to(run_folder / "inputs") for d in first.inputs.values() for e in d.values())
    storage.write_table(root, EXAMPLES, DAYS[0], table(DAYS[0], 5, tag=99))  # rebuilt before the retry
    backend.jobs = dict.fromkeys(backend.jobs, JobState.FAILED)  # try 1's job failed: try 2 submits anew
    second = submit(2)
    assert second.inputs == first.inputs and second.checkpoint_dir == first.checkpoint_dir

    op = DistributedTrainingOperator(task_id="train", plan={"train_days": DAYS[:2], "eval_ds": DAYS[2]}, backend="local")
    storage.write_json(storage.join(second.output_dir, "result.json"), {"metrics": {}})
    op.finish({"ti": TI(2)}, JobRef("local", "j", output_dir=second.output_dir))  # type: ignore[arg-type]
    assert sorted(os.listdir(run_folder / "inputs")) == [storage.PINS_FILE]  # the copies go, the versions stay


def test_pins_of_another_root_do_not_apply(root: Path, tmp_path: Path):
    # A RUN.json copied to another storage root: its pins describe the first root's partitions, not this one's.
    inputs = pin(root, tmp_path)
    other = tmp_path / "other-storage"
    storage.write_table(other, EXAMPLES, DAYS[0], table(DAYS[0], 5, tag=50))
    view = storage.InputPins.of(other, inputs)
    assert storage.pinned(view, EXAMPLES, DAYS[0]) is None
    assert storage.read_table(view, EXAMPLES, DAYS[0]).column("x").to_pylist() == list(range(50, 55))
