"""Exactness, point-in-time correctness and idempotence of features.build on a small synthetic world.

The day-by-day (incremental) outputs are compared for *equality* with a full recompute from the raw
events in a fresh storage root, on the first day, on days after a gap of one missing day, and later.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from core import contracts, storage
from core.contracts import EVENTS_SCHEMA
from core.storage import MARKER, day_range, partition, read_metadata, read_table, shift_ds, write_table
from features import build, step_io
from features.steps.daily import build_daily
from features.steps.examples import build_examples
from features.steps.sequences import build_sequences
from features.steps.window import build_window
from features.synthetic import WorldConfig, generate_world
from training.data import read_examples

START = "2026-03-01"
DAYS = day_range(START, shift_ds(START, 6))
GAP = DAYS[3]  # no raw data at all that day (an upstream outage)
BUILT = [d for d in DAYS if d != GAP]
# A short window and short sequences, so that the window drop and the truncation both happen.
PARAMS = {"window_days": 3, "sequence_length": 6, "negative_downsample": 0.5, "seed": 11}
ENGINE = step_io.DuckDBSettings(threads=1, memory_limit="512MB")
RAW = (contracts.RAW_EVENTS, contracts.RAW_PINS, "raw/users")
OUTPUTS = contracts.FEATURE_OUTPUTS


def copy_raw(source: Path, target: Path) -> Path:
    for dataset in RAW:
        shutil.copytree(source / dataset, target / dataset)
    return target


@pytest.fixture(scope="module")
def raw_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("world")
    generate_world(root, WorldConfig(start=START, days=len(DAYS), users=60, pins=80, seed=5, active_rate=0.9))
    for dataset in (*RAW, "truth"):
        storage.remove_tree(partition(root, dataset, GAP))
    return root


@pytest.fixture(scope="module")
def daily_root(raw_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every day built one by one, in order, as the daily schedule does (the gap day fails and is skipped)."""
    root = copy_raw(raw_world, tmp_path_factory.mktemp("daily"))
    for day in DAYS:
        if day == GAP:
            with pytest.raises(step_io.MissingInputError, match=f"raw/events for ds={GAP}"):
                build.build_day(root, day, engine=ENGINE, require_validation=False, **PARAMS)
            continue
        build.build_day(root, day, engine=ENGINE, require_validation=False, **PARAMS)
    return root


def recompute_day(raw_world: Path, root: Path, day: str) -> None:
    """The outputs of ``day`` in a root that holds raw data only: everything from raw events.

    The features of the day before, which the examples read, are recomputed from raw as well.
    """
    copy_raw(raw_world, root)
    previous = shift_ds(day, -1)
    window, length = PARAMS["window_days"], PARAMS["sequence_length"]
    if previous in BUILT:
        build_window(root, previous, window, recompute=True, engine=ENGINE, require_validation=False)
        build_sequences(root, previous, length, window, recompute=True, engine=ENGINE, require_validation=False)
    build_daily(root, day, engine=ENGINE, require_validation=False)
    build_window(root, day, window, recompute=True, engine=ENGINE, require_validation=False)
    build_sequences(root, day, length, window, recompute=True, engine=ENGINE, require_validation=False)
    build_examples(root, day, negative_downsample=PARAMS["negative_downsample"], seed=PARAMS["seed"], engine=ENGINE, require_validation=False)


@pytest.mark.unit
@pytest.mark.parametrize("day", [DAYS[0], DAYS[2], DAYS[4], DAYS[5], DAYS[6]])
def test_daily_outputs_equal_full_recompute_from_raw(raw_world: Path, daily_root: Path, tmp_path: Path, day: str) -> None:
    recompute_day(raw_world, tmp_path, day)
    for dataset in OUTPUTS:
        incremental, full = read_table(daily_root, dataset, day), read_table(tmp_path, dataset, day)
        assert incremental.num_rows > 0, (dataset, day)
        assert incremental.equals(full), f"{dataset} ds={day}: incremental != full recompute"
    # And what training reads: the examples with their sequence references resolved.
    assert read_examples(daily_root, day).equals(read_examples(tmp_path, day))
    for dataset in (contracts.USER_WINDOW, contracts.USER_SEQUENCE, contracts.EXAMPLES):
        assert read_metadata(daily_root, dataset, day)["missing_days"] == read_metadata(tmp_path, dataset, day)["missing_days"]


@pytest.mark.unit
def test_incremental_path_was_taken_and_gap_is_named(daily_root: Path) -> None:
    seq = {d: read_metadata(daily_root, contracts.USER_SEQUENCE, d) for d in BUILT}
    assert [seq[d]["mode"] for d in BUILT] == ["full", "incremental", "incremental", "full", "incremental", "incremental"]
    # The windows too: the previous window + the day - the day that leaves (none when it is the gap), equal to a
    # full recompute from raw (test_daily_outputs_equal_full_recompute_from_raw), across the gap.
    window_modes = [read_metadata(daily_root, contracts.USER_WINDOW, day)["mode"] for day in BUILT]
    assert window_modes == ["full", "incremental", "incremental", "full", "incremental", "incremental"]
    assert read_metadata(daily_root, contracts.PIN_WINDOW, DAYS[6])["inputs"] == [
        f"{contracts.PIN_WINDOW}/ds={DAYS[5]}", f"{contracts.PIN_DAILY}/ds={DAYS[6]}"  # the gap left: nothing to subtract
    ]
    # The gap stays named while it lies in the 3-day window, then leaves it.
    assert [seq[d]["missing_days"] for d in DAYS[4:]] == [[GAP], [GAP], []]
    window = {d: read_metadata(daily_root, contracts.USER_WINDOW, d) for d in DAYS[4:]}
    assert [window[d]["missing_days"] for d in DAYS[4:]] == [[GAP], [GAP], []]
    assert all(window[d]["computed_from_raw"] == [] for d in DAYS[4:])  # daily partitions were there
    # The day after the gap has no features of the day before: priors, named in the metadata.
    examples = read_metadata(daily_root, contracts.EXAMPLES, DAYS[4])
    assert examples["missing_inputs"] == [f"{d}/ds={GAP}" for d in (contracts.USER_WINDOW, contracts.PIN_WINDOW, contracts.USER_SEQUENCE)]
    later = read_metadata(daily_root, contracts.EXAMPLES, DAYS[5])
    assert later["missing_inputs"] == [] and later["negative_downsample"] == 0.5 and later["negative_weight"] == 2.0
    assert later["rows"] < later["impressions"]


@pytest.mark.unit
def test_examples_need_the_features_of_the_day_before_when_it_has_data(raw_world: Path, tmp_path: Path) -> None:
    root = copy_raw(raw_world, tmp_path)
    with pytest.raises(step_io.MissingInputError, match=rf"features/user_window/ds={DAYS[1]}.*--ds {DAYS[1]}"):
        build_examples(root, DAYS[2], engine=ENGINE, require_validation=False)


def feature_columns(table: pa.Table) -> list[str]:
    labels = {"click", "repin", "hide"}
    return [name for name in table.column_names if name not in labels]


def perturb_day(root: Path, day: str) -> None:
    """Replace every engagement of ``day`` by others (each impression clicked and repinned one second later)."""
    events = read_table(root, contracts.RAW_EVENTS, day)
    impressions = events.filter(pc.equal(events["action"], "impression"))
    engagements = []
    for k, action in enumerate(("click", "repin")):
        engagements.append(
            impressions.set_column(
                impressions.schema.get_field_index("event_id"), "event_id", pc.add(impressions["event_id"], 10**8 * (k + 1))
            )
            .set_column(impressions.schema.get_field_index("action"), "action", pa.array([action] * impressions.num_rows))
            .set_column(
                impressions.schema.get_field_index("ts"),
                "ts",
                pc.add(impressions["ts"], pa.scalar(dt.timedelta(seconds=1 + k), pa.duration("us"))),
            )
            .cast(EVENTS_SCHEMA)
        )
    write_table(root, contracts.RAW_EVENTS, day, pa.concat_tables([impressions, *engagements]))


@pytest.mark.unit
def test_no_example_carries_information_from_its_own_day(daily_root: Path, tmp_path: Path) -> None:
    day = DAYS[5]
    root = tmp_path / "root"
    shutil.copytree(daily_root, root)
    before = read_examples(root, day)  # the sequences resolved, as training reads them

    perturb_day(root, day)
    build.build_day(root, day, engine=ENGINE, require_validation=False, **PARAMS)
    after = read_examples(root, day)

    # Every label changed meaning (all clicked and repinned now), every feature stayed exactly the same.
    kept = pc.is_in(before["impression_id"], after["impression_id"])
    assert pc.all(kept).as_py(), "a negative kept before must be kept after: the sampling hash ignores labels"
    same = after.filter(pc.is_in(after["impression_id"], before["impression_id"]))
    assert same.select(feature_columns(same)).equals(before.select(feature_columns(before)))
    assert pc.all(pc.equal(after["click"], 1)).as_py() and pc.all(pc.equal(after["repin"], 1)).as_py()
    # And the day's own features (of ds, used by ds+1) did change: the perturbation was seen where it belongs.
    assert not read_table(root, contracts.USER_WINDOW, day).equals(read_table(daily_root, contracts.USER_WINDOW, day))

    # Every action in a sequence happened before the day started.
    day_start = dt.datetime.fromisoformat(f"{day}T00:00:00+00:00")
    for row in before.select(["ts", "seq_age_hours"]).to_pylist():
        since_midnight = (row["ts"] - day_start).total_seconds() / 3600
        assert all(age > since_midnight - 1e-3 for age in row["seq_age_hours"]), row


@pytest.mark.unit
def test_rerun_replaces_exactly_that_day(daily_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(daily_root, root)
    markers = {p: p.read_text() for p in root.glob(f"*/*/ds=*/{MARKER}")} | {
        p: p.read_text() for p in root.glob(f"examples/ds=*/{MARKER}")
    }
    tables = {(d, day): read_table(root, d, day) for d in OUTPUTS for day in BUILT}

    build.build_day(root, DAYS[4], engine=ENGINE, require_validation=False, **PARAMS)
    build.build_day(root, DAYS[4], engine=ENGINE, require_validation=False, **PARAMS)

    changed = {p.relative_to(root).parent.as_posix() for p, text in markers.items() if p.read_text() != text}
    assert changed == {f"{d}/ds={DAYS[4]}" for d in OUTPUTS}
    for (dataset, day), table in tables.items():
        assert read_table(root, dataset, day).equals(table), (dataset, day)
    assert not [p for p in root.rglob(".tmp-*")] and not [p for p in root.rglob(".old-*")]


@pytest.mark.unit
def test_small_memory_limit_spills_instead_of_failing(daily_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(daily_root, root)
    spill = tmp_path / "spill"
    spill.mkdir()
    tight = step_io.DuckDBSettings(threads=1, memory_limit="32MB", temp_directory=str(spill))
    build.build_day(root, DAYS[6], engine=tight, require_validation=False, **PARAMS)
    for dataset in OUTPUTS:
        assert read_table(root, dataset, DAYS[6]).equals(read_table(daily_root, dataset, DAYS[6])), dataset
    assert list(spill.iterdir()) == []  # each connection's spill folder is removed afterwards


@pytest.mark.unit
def test_outputs_cut_into_many_files_hold_the_same_rows_in_the_same_order(
    daily_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large output is written as several files encoded side by side (step_io.FILE_BYTES); read in name order they
    are the one-file output, row for row, with the same metadata (the sequences' content digest included)."""
    root = tmp_path / "root"
    shutil.copytree(daily_root, root)
    monkeypatch.setattr(step_io, "FILE_BYTES", 2048)
    build.build_day(root, DAYS[6], engine=ENGINE, require_validation=False, **PARAMS)
    for dataset in OUTPUTS:
        files = storage.data_files(root, dataset, DAYS[6])
        assert len(files) > 2, dataset
        assert [Path(f).name for f in files] == [f"part-{i:05d}.parquet" for i in range(len(files))]
        assert read_table(root, dataset, DAYS[6]).equals(read_table(daily_root, dataset, DAYS[6])), dataset
        ignore = {"input_versions", "daily_versions", "built_at"}  # when the inputs were published
        new, old = read_metadata(root, dataset, DAYS[6]), read_metadata(daily_root, dataset, DAYS[6])
        assert {k: v for k, v in new.items() if k not in ignore} == {k: v for k, v in old.items() if k not in ignore}
    assert read_examples(root, DAYS[6]).equals(read_examples(daily_root, DAYS[6]))


# --- examples reference their sequence --------------------------------------------------------------------


def copied_examples(root: Path, day: str) -> pa.Table:
    """The examples of ``day`` with their user's whole sequence of the day before copied into every row, the way
    the build wrote them before it stored references (computed here independently, row by row in Python)."""
    stored = read_table(root, contracts.EXAMPLES, day)
    previous = shift_ds(day, -1)
    sequences = {}
    if storage.is_complete(root, contracts.USER_SEQUENCE, previous):
        table = read_table(root, contracts.USER_SEQUENCE, previous)
        table = table.set_column(4, "seq_ts", pc.cast(table["seq_ts"], pa.list_(pa.int64())))
        sequences = {row["user_id"]: row for row in table.to_pylist()}
    lists: dict[str, list[list[float]]] = {name: [] for name in contracts.SEQUENCE_COLUMNS}
    for user, impression_us in zip(stored["user_id"].to_pylist(), pc.cast(stored["ts"], pa.int64()).to_pylist(), strict=True):
        seq = sequences.get(user, {"seq_pin_ids": [], "seq_actions": [], "seq_categories": [], "seq_ts": []})
        for name in ("seq_pin_ids", "seq_actions", "seq_categories"):
            lists[name].append(seq[name])
        lists["seq_age_hours"].append([float(np.float32((impression_us - t) / 3600e6)) for t in seq["seq_ts"]])
    columns = {name: stored[name] for name in stored.column_names if name not in contracts.SEQUENCE_REF_COLUMNS}
    columns |= {field.name: pa.array(lists[field.name], field.type) for field in contracts.SEQUENCE_FIELDS}
    return pa.table(columns).select(contracts.RESOLVED_EXAMPLES_SCHEMA.names).cast(contracts.RESOLVED_EXAMPLES_SCHEMA)


@pytest.mark.unit
def test_resolved_examples_equal_the_copied_ones(daily_root: Path) -> None:
    for day in BUILT:
        resolved = read_examples(daily_root, day)
        assert resolved.num_rows > 0
        assert resolved.equals(copied_examples(daily_root, day)), day
        assert resolved.schema.equals(contracts.RESOLVED_EXAMPLES_SCHEMA)
    assert any(len(s) for s in read_examples(daily_root, DAYS[6])["seq_pin_ids"].to_pylist())
    # The stored rows are narrower than the copied ones (sequences of 6 here; of 50 by default).
    stored = read_table(daily_root, contracts.EXAMPLES, DAYS[6])
    assert stored.nbytes < copied_examples(daily_root, DAYS[6]).nbytes


@pytest.mark.unit
def test_example_stream_resolves_references_exactly_and_resumes(daily_root: Path, tmp_path: Path) -> None:
    """The stream over referenced examples gives the same tables as over the same examples copied inline, with a
    shuffle, two ranks and a resume in the middle of an epoch."""
    from training.data import ExampleStream
    from training.models.pin_ranker.inputs import EXAMPLE_COLUMNS

    days = BUILT[1:]
    inline = tmp_path / "inline"
    for day in days:
        write_table(inline, contracts.EXAMPLES, day, copied_examples(daily_root, day))

    def tables(root: Path, skip: int) -> list[pa.Table]:
        stream = ExampleStream(root, days, lambda t: {}, batch_size=16, columns=EXAMPLE_COLUMNS, rank=1,
                               world_size=2, seed=3)
        return list(stream.iter_tables(stream.rank_units(1), 1, skip))

    for skip in (0, 2):
        referenced, copied = tables(daily_root, skip), tables(inline, skip)
        assert len(referenced) == len(copied) > 0
        for a, b in zip(referenced, copied, strict=True):
            assert a.column_names == list(EXAMPLE_COLUMNS)
            assert a.equals(b)


@pytest.mark.unit
def test_a_changed_sequence_partition_is_refused_and_a_rerun_is_not(daily_root: Path, tmp_path: Path) -> None:
    from core.failures import DataError

    root = tmp_path / "root"
    shutil.copytree(daily_root, root)
    day, previous = DAYS[6], DAYS[5]
    expected = read_examples(root, day)
    # A rerun of the day before rewrites its sequences with the same content: the references still resolve.
    build_sequences(root, previous, PARAMS["sequence_length"], PARAMS["window_days"], engine=ENGINE,
                          require_validation=False)
    assert read_examples(root, day).equals(expected)
    # Other content (a shorter sequence length) under the same day: refused, naming the partition and what to do.
    build_sequences(root, previous, 2, PARAMS["window_days"], recompute=True, engine=ENGINE, require_validation=False)
    with pytest.raises(DataError, match=rf"features/user_sequence ds={previous} with content digest .* rebuild the examples"):
        read_examples(root, day)
    # A missing one: named by the preflight's planning (example_units) as well.
    storage.remove_tree(partition(root, contracts.USER_SEQUENCE, previous))
    from training.data import example_units

    with pytest.raises(DataError, match=rf"features/user_sequence ds={previous}, which is missing"):
        example_units(root, [day], columns=("seq_pin_ids",))
    assert example_units(root, [day], columns=("click",))  # a reader of other columns does not need it


@pytest.mark.unit
def test_a_reference_to_actions_after_the_impression_is_refused(daily_root: Path, tmp_path: Path) -> None:
    """Point in time holds in the reader too: a sequence partition holding an action at or after an impression that
    references it is a DataError (here: the sequences of ds-1 shifted two days later, their digest re-recorded)."""
    from core.failures import DataError

    root = tmp_path / "root"
    shutil.copytree(daily_root, root)
    day, previous = DAYS[6], DAYS[5]
    table = read_table(root, contracts.USER_SEQUENCE, previous)
    lists = table["seq_ts"].combine_chunks()
    later = pc.add(pc.list_flatten(lists), pa.scalar(dt.timedelta(days=2), pa.duration("us")))
    offsets = lists.offsets
    table = table.set_column(4, "seq_ts", pa.ListArray.from_arrays(offsets, later)).cast(contracts.USER_SEQUENCE_SCHEMA)
    write_table(root, contracts.USER_SEQUENCE, previous, table)
    meta = read_metadata(root, contracts.EXAMPLES, day)
    meta["sequence_digest"] = contracts.sequence_digest(table)
    storage.write_json(Path(partition(root, contracts.EXAMPLES, day)) / "_metadata.json", meta)
    with pytest.raises(DataError, match="not before their impression"):
        read_examples(root, day)
