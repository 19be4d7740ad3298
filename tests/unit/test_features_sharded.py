"""Scale-out of the feature build: a day split into shards by user / pin hash, merged by the shards' metadata,
equals the unsharded build, row for row and in every metadata key but the layout's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core import contracts, storage
from core.config import FeaturesConfig
from core.failures import ConfigError, DataError, ExitCode, InfraError
from core.storage import day_range, partition, read_metadata, read_table, shift_ds
from features import bucketed_events, build, sharding, spec, step_io
from features.steps import window as window_module
from features.steps.daily import build_daily
from features.synthetic import WorldConfig, generate_world

START = "2026-03-01"
DAYS = day_range(START, shift_ds(START, 5))
GAP = DAYS[3]  # no raw data that day: the window and sequences after it are full sums, then incremental again
BUILT = [d for d in DAYS if d != GAP]
FEATURES = FeaturesConfig(window_days=3, sequence_length=6, negative_downsample=0.5, negative_downsample_seed=11)
ENGINE = step_io.DuckDBSettings(threads=1, memory_limit="512MB")
SHARDS = 3
KEYS = {
    contracts.USER_DAILY: "user_id", contracts.PIN_DAILY: "pin_id", contracts.USER_WINDOW: "user_id",
    contracts.PIN_WINDOW: "pin_id", contracts.USER_SEQUENCE: "user_id", contracts.EXAMPLES: "impression_id",
}
# What only the layout changes (the digest hashes rows in file order), publish stamps (daily_versions, input_versions),
# that a window was built by the shards of the day's first job (staged_day), and the staging folder they were merged from.
LAYOUT_KEYS = {"shards", "hash_buckets", "content_digest", "sequence_digest", "daily_versions", "input_versions",
               "staged_day", "merged_from"}
SETTINGS = build.recorded_settings(FEATURES, skip_validation=True)


def build_sharded(root: Path, day: str, step: str, shards: int = SHARDS) -> dict:
    """One of the DAG's jobs of ``day`` in ``shards`` shards, merged; the window job does nothing when the first job's
    shards built the window (as the DAG's window task)."""
    if step == "window" and build.window_built_by_group(root, day, SETTINGS):
        return {}
    staging = storage.join(root, "_staging", step, f"ds={day}")
    for index in range(shards):
        build.build_step(root, day, step, FEATURES, require_validation=False, engine=ENGINE,
                         shard=sharding.Shard(index, shards, staging))
    # With the settings the DAG's merge checks (the first day and the day after the gap have no window before them).
    return build.merge_shards(root, day, step, staging, shards, SETTINGS)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same raw world built day by day unsharded, step by step, and with each of the DAG's jobs in 3 shards."""
    raw = tmp_path_factory.mktemp("raw")
    generate_world(raw, WorldConfig(start=START, days=len(DAYS), users=50, pins=70, seed=3, active_rate=0.9))
    for dataset in (contracts.RAW_EVENTS, contracts.RAW_PINS, "raw/users", "truth"):
        storage.remove_tree(partition(raw, dataset, GAP))
    whole, sharded = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("sharded")
    for target in (whole, sharded):
        for dataset in ("raw",):
            shutil.copytree(raw / dataset, target / dataset)
    for day in BUILT:
        for step in build.STEP_DATASETS:
            build.build_step(whole, day, step, FEATURES, require_validation=False, engine=ENGINE)
        for job in spec.DAY_JOBS:  # as the DAG shards them: daily, sequences and examples in one job, then the window
            build_sharded(sharded, day, job)
    return whole, sharded


def sorted_by(table: pa.Table, key: str) -> pa.Table:
    return table.sort_by(key).combine_chunks()


@pytest.mark.unit
@pytest.mark.parametrize("day", BUILT)
def test_sharded_build_equals_the_unsharded_one(roots: tuple[Path, Path], day: str) -> None:
    whole, sharded = roots
    for dataset, key in KEYS.items():
        expected, got = read_table(whole, dataset, day), read_table(sharded, dataset, day)
        assert got.num_rows == expected.num_rows > 0, dataset
        assert sorted_by(got, key).equals(sorted_by(expected, key)), f"{dataset} ds={day}"
        assert len(storage.data_files(sharded, dataset, day)) == SHARDS
        meta_whole, meta_sharded = read_metadata(whole, dataset, day), read_metadata(sharded, dataset, day)
        assert meta_sharded["shards"] == SHARDS
        assert {k: v for k, v in meta_sharded.items() if k not in LAYOUT_KEYS} == {
            k: v for k, v in meta_whole.items() if k not in LAYOUT_KEYS
        }, f"{dataset} ds={day}"
    # The incremental paths were taken on both sides (not only full sums that happen to agree).
    if day in (DAYS[1], DAYS[2], DAYS[5]):
        for root in roots:
            assert read_metadata(root, contracts.USER_WINDOW, day)["mode"] == "incremental"
            assert read_metadata(root, contracts.USER_SEQUENCE, day)["mode"] == "incremental"
    assert not (sharded / "_staging").exists() or not any((sharded / "_staging").rglob("*.parquet"))


@pytest.mark.unit
def test_training_reads_sharded_examples_like_unsharded_ones(roots: tuple[Path, Path]) -> None:
    from training.data import read_examples

    whole, sharded = roots
    day = BUILT[-1]
    expected = read_examples(whole, day)
    got = read_examples(sharded, day)
    assert sorted_by(got, "impression_id").equals(sorted_by(expected, "impression_id"))


@pytest.mark.unit
def test_merged_sequences_record_the_digest_the_next_examples_reference(roots: tuple[Path, Path]) -> None:
    _, sharded = roots
    day, before = BUILT[-1], BUILT[-2]
    tables = [storage.read_parquet(f) for f in storage.data_files(sharded, contracts.USER_SEQUENCE, before)]
    digest = contracts.combined_digest([contracts.sequence_digest(t.cast(contracts.USER_SEQUENCE_SCHEMA)) for t in tables])
    assert read_metadata(sharded, contracts.USER_SEQUENCE, before)["content_digest"] == digest
    # No examples shard digested the sequences again; training accepts the reference (the test above).
    assert read_metadata(sharded, contracts.EXAMPLES, day)["sequence_digest"] == digest


@pytest.mark.unit
def test_duplicated_pins_fail_shard_0_and_nothing_is_merged(roots: tuple[Path, Path], tmp_path: Path) -> None:
    whole, _ = roots
    root, day, staging = tmp_path / "root", BUILT[-1], str(tmp_path / "staging")
    shutil.copytree(whole / "raw", root / "raw")
    pins = read_table(root, contracts.RAW_PINS, day)
    storage.write_table(root, contracts.RAW_PINS, day, pa.concat_tables([pins, pins.slice(0, 1)]))
    build.build_step(root, day, "daily", FEATURES, require_validation=False, engine=ENGINE, shard=sharding.Shard(1, 2, staging))
    with pytest.raises(step_io.InputDataError, match="1 duplicated pin_id rows"):  # the check is shard 0's
        build.build_step(root, day, "daily", FEATURES, require_validation=False, engine=ENGINE, shard=sharding.Shard(0, 2, staging))
    with pytest.raises(InfraError, match=r"shard\(s\) \[0\] have no output"):
        build.merge_shards(root, day, "daily", staging, 2)


@pytest.mark.unit
def test_shards_of_other_inputs_are_not_merged(roots: tuple[Path, Path], tmp_path: Path) -> None:
    _, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day, staging = BUILT[-1], str(tmp_path / "staging")
    build.build_step(root, day, "examples", FEATURES, require_validation=False, engine=ENGINE, shard=sharding.Shard(0, 2, staging))
    with pytest.raises(InfraError, match=r"shard\(s\) \[1\] have no output"):
        build.merge_shards(root, day, "examples", staging, 2)
    # Merged as 3 shards: shard 0 of 2 is there, so building shards 1-2 (the missing ones) would not help: said first.
    with pytest.raises(ConfigError, match=r"shard-00000 .* is shard 0 of 2 .*, but this merge is of 3 shard\(s\)"):
        build.merge_shards(root, day, "examples", staging, 3)
    other = FEATURES.model_copy(update={"negative_downsample": 0.25})
    build.build_step(root, day, "examples", other, require_validation=False, engine=ENGINE, shard=sharding.Shard(1, 2, staging))
    before = storage.read_json(storage.join(partition(root, contracts.EXAMPLES, day), storage.METADATA_FILE))
    with pytest.raises(DataError, match="shard 1 was built from other inputs or settings.*negative_downsample"):
        build.merge_shards(root, day, "examples", staging, 2)
    # Nothing was published: the day's examples are still the 3-shard build.
    assert storage.read_json(storage.join(partition(root, contracts.EXAMPLES, day), storage.METADATA_FILE)) == before
    # The mixed shards are gone, so that the step's rerun (the same staging folder) builds every shard again.
    assert build.missing_shards(staging, "examples", 2) == [0, 1]


@pytest.mark.unit
def test_cli_builds_the_shard_its_array_index_picks_and_merges(roots: tuple[Path, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    whole, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day, staging = BUILT[-1], str(tmp_path / "staging")
    args = ["--root", str(root), "--ds", day, "--step", "sequences", "--shards", "4", "--staging", staging,
            "--window-days", "3", "--sequence-length", "6", "--skip-validation", "--threads", "1"]
    order = [3, 0, 2, 1]
    for index, shard in enumerate(order):  # an array job over shards 3,0,2,1: the index picks one each
        monkeypatch.setenv("PINFLOW_ARRAY_INDEX", str(index))
        assert build.main([*args, "--run-shards", "3,0,2,1"]) == 0
        assert shard not in build.missing_shards(staging, "sequences", 4)
        assert build.missing_shards(staging, "sequences", 4) == sorted(set(range(4)) - set(order[: index + 1]))
    monkeypatch.delenv("PINFLOW_ARRAY_INDEX")
    assert build.main([*args, "--merge"]) == 0
    assert not Path(staging).exists()
    key = "user_id"
    expected = read_table(whole, contracts.USER_SEQUENCE, day)
    assert sorted_by(read_table(root, contracts.USER_SEQUENCE, day), key).equals(sorted_by(expected, key))
    assert len(storage.data_files(root, contracts.USER_SEQUENCE, day)) == 4


@pytest.mark.unit
def test_a_merge_publishes_only_the_shards_it_names_and_removes_only_them(
    roots: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day, staging = BUILT[-1], tmp_path / "staging"
    args = ["--root", str(root), "--ds", day, "--step", "sequences", "--staging", str(staging),
            "--window-days", "3", "--sequence-length", "6", "--skip-validation", "--threads", "1"]
    published = read_metadata(root, contracts.USER_SEQUENCE, day)
    assert build.main([*args, "--shards", "4"]) == 0  # every shard, in this process
    (staging / "notes.txt").write_text("not a shard")
    capsys.readouterr()
    for wrong, says in (
        (["--shards", "3"], f"is shard 0 of 4 of ds={day}, but this merge is of 3 shard(s) of ds={day}"),
        (["--shards", "4", "--ds", BUILT[-2]], f"but this merge is of 4 shard(s) of ds={BUILT[-2]}"),
        (["--shards", "4", "--sequence-length", "7"], "were built with sequence_length 6 (this merge: 7)"),
    ):
        assert build.main([*args, *wrong, "--merge"]) == ExitCode.USER
        assert says in capsys.readouterr().err
        assert read_metadata(root, contracts.USER_SEQUENCE, day) == published  # nothing published
        assert build.missing_shards(str(staging), "sequences", 4) == []  # the shards kept
    assert build.main([*args, "--shards", "4", "--merge"]) == 0
    assert read_metadata(root, contracts.USER_SEQUENCE, day)["shards"] == 4
    assert [p.name for p in staging.iterdir()] == ["notes.txt"]  # only the merged shards removed
    merged = read_metadata(root, contracts.USER_SEQUENCE, day)
    assert merged["merged_from"] == str(staging)
    capsys.readouterr()
    # Merged twice (the CLI again, or a retry of a merge that published before its worker was lost): what was published.
    assert build.main([*args, "--shards", "4", "--merge"]) == 0
    assert json.loads(capsys.readouterr().out) == {contracts.USER_SEQUENCE: merged}
    assert read_metadata(root, contracts.USER_SEQUENCE, day) == merged
    # A new build in the same folder, one shard built so far: not "merged" (the shard is kept for the rest).
    assert build.main([*args, "--shards", "4", "--run-shards", "0"]) == 0
    assert build.main([*args, "--shards", "4", "--merge"]) == ExitCode.INFRA
    assert "shard(s) [1, 2, 3] have no output" in capsys.readouterr().err
    assert build.missing_shards(str(staging), "sequences", 4) == [1, 2, 3]
    # Another staging folder's shards were never built: that merge still says what is missing, and what is published.
    assert build.main([*args, "--shards", "4", "--merge", "--staging", str(tmp_path / "other")]) == ExitCode.INFRA
    assert f"already merged: features/user_sequence ds={day} is published from 4 shard(s)" in capsys.readouterr().err


@pytest.mark.unit
def test_a_staging_folder_that_holds_data_and_run_shards_without_shards_are_refused(
    roots: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from features.spec import staging_problem

    _, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day = BUILT[-1]
    args = ["--root", str(root), "--ds", day, "--step", "daily", "--skip-validation", "--threads", "1"]
    published = read_metadata(root, contracts.USER_DAILY, day)
    for staging, says in ((root, "is the storage root"), (tmp_path, "is a folder above the storage root"),
                          (root / "features", "is inside the storage root")):
        assert build.main([*args, "--shards", "2", "--staging", str(staging), "--merge"]) == ExitCode.USER
        assert says in capsys.readouterr().err
    assert build.main([*args, "--run-shards", "1"]) == ExitCode.USER
    assert "--run-shards 1 picks shards of a sharded build: give --shards N > 1" in capsys.readouterr().err
    assert read_metadata(root, contracts.USER_DAILY, day) == published and (root / "raw").is_dir()
    assert staging_problem(str(root), str(root / "_staging" / "x")) == staging_problem(str(root), str(tmp_path / "s")) == ""
    assert staging_problem("s3://b/r", "s3://b/r/_staging/x") == "" != staging_problem("s3://b/r", "s3://b/r/_stagingx")

    def unwritable(*_: object) -> None:
        raise PermissionError(13, "Permission denied", str(root / "features"))

    monkeypatch.setattr(build, "run", unwritable)
    assert build.main(args) == ExitCode.USER
    assert f"Permission denied on {root / 'features'}: make it writable" in capsys.readouterr().err


@pytest.mark.unit
def test_a_merge_whose_shards_another_merge_published_meanwhile_fails_as_infra(
    roots: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day, staging = BUILT[-1], str(tmp_path / "staging")
    for index in range(2):
        build.build_step(root, day, "daily", FEATURES, require_validation=False, engine=ENGINE,
                         shard=sharding.Shard(index, 2, staging))
    published = read_metadata(root, contracts.USER_DAILY, day)
    copy = build.copy_file

    def other_merge_won(source: str, target: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)
        copy(source, target)

    monkeypatch.setattr(build, "copy_file", other_merge_won)
    with pytest.raises(InfraError, match="disappeared during the merge .*another merge of the same shards"):
        build.merge_shards(root, day, "daily", staging, 2)
    assert read_metadata(root, contracts.USER_DAILY, day) == published


@pytest.mark.unit
def test_sequence_shards_are_written_in_small_row_groups_the_next_shard_reads_in_parallel(
    roots: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow.parquet as pq

    whole, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day = BUILT[-1]
    monkeypatch.setitem(step_io.SHARD_ROW_GROUP_ROWS, contracts.USER_SEQUENCE, 4)
    for step in ("sequences", "examples"):
        build_sharded(root, day, step)
    for dataset, most in ((contracts.USER_SEQUENCE, 4), (contracts.EXAMPLES, step_io.ROW_GROUP_ROWS)):
        files = storage.data_files(root, dataset, day)
        metas = [pq.ParquetFile(f).metadata for f in files]
        sizes = [m.row_group(i).num_rows for m in metas for i in range(m.num_row_groups)]
        assert max(sizes) <= most and (len(sizes) > len(files)) == (dataset == contracts.USER_SEQUENCE), dataset
        assert sorted_by(read_table(root, dataset, day), KEYS[dataset]).equals(
            sorted_by(read_table(whole, dataset, day), KEYS[dataset])
        ), dataset


@pytest.mark.unit
def test_an_input_republished_during_the_build_publishes_nothing(roots: tuple[Path, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    whole, _ = roots
    root = tmp_path / "root"
    shutil.copytree(whole, root)
    day = BUILT[-1]
    folder = Path(partition(root, contracts.USER_DAILY, day))
    before = storage.read_json(str(folder / storage.METADATA_FILE))
    events = read_table(root, contracts.RAW_EVENTS, day)
    conform = step_io.conform

    def rebuild_input_then_conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
        monkeypatch.setattr(step_io, "conform", conform)
        storage.write_table(root, contracts.RAW_EVENTS, day, events)  # a concurrent rebuild: same rows, new version
        return conform(table, schema)

    monkeypatch.setattr(step_io, "conform", rebuild_input_then_conform)
    with pytest.raises(InfraError, match=f"raw/events/ds={day} was republished while features/user_daily ds={day}"):
        build_daily(root, day, require_validation=False, engine=ENGINE)
    assert storage.read_json(str(folder / storage.METADATA_FILE)) == before  # the old version stays, whole
    assert not [p.name for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    # The retry builds from the new version.
    assert build_daily(root, day, require_validation=False, engine=ENGINE)[contracts.USER_DAILY]["rows"] == before["rows"]


@pytest.fixture(scope="module")
def bucketed(roots: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same world built in 3 shards from events bucketed in 6 (what validation writes when the build is sharded),
    and one day of it in 4 shards (not a divisor of 6: shards read more buckets and filter them)."""
    whole, _ = roots
    root = tmp_path_factory.mktemp("bucketed")
    shutil.copytree(whole / "raw", root / "raw")
    for day in BUILT:
        meta = bucketed_events.write_event_buckets(root, day, 6, engine=ENGINE)
        assert meta[contracts.EVENTS_BY_USER]["rows"] == read_table(root, contracts.RAW_EVENTS, day).num_rows
        for job in spec.DAY_JOBS:
            build_sharded(root, day, job, shards=4 if day == BUILT[-1] else SHARDS)
    return root


@pytest.mark.unit
def test_the_first_jobs_shards_build_an_incremental_window_from_their_own_daily_aggregates(
    roots: tuple[Path, Path], bucketed: Path
) -> None:
    """With the day's events bucketed with their counts, the shards of daily_sequences_examples build the window too
    when it is incremental (the window job then has nothing to do); a full window is left to the window job. Either
    way the rows equal the unsharded build's (test above), and the day's published aggregates are the window's inputs,
    with their stamps: the next day's window is incremental over them."""
    whole, _ = roots
    staged = {day: bool(read_metadata(bucketed, contracts.USER_WINDOW, day).get("staged_day")) for day in BUILT}
    modes = {day: read_metadata(whole, contracts.USER_WINDOW, day)["mode"] for day in BUILT}
    assert staged == {day: modes[day] == "incremental" for day in BUILT} and any(staged.values()) and not all(staged.values())
    day = next(d for d in BUILT if staged[d])
    for window, daily in ((contracts.USER_WINDOW, contracts.USER_DAILY), (contracts.PIN_WINDOW, contracts.PIN_DAILY)):
        meta = read_metadata(bucketed, window, day)
        ref = step_io.partition_ref(daily, day)
        assert meta["inputs"] == read_metadata(whole, window, day)["inputs"]
        assert meta["input_versions"][ref] == step_io.input_versions(bucketed, [ref])[ref]
        assert meta["daily_versions"][day] == window_module.daily_version(bucketed, day)
    assert meta["totals"] == read_metadata(whole, contracts.PIN_WINDOW, day)["totals"]
    assert build.window_built_by_group(bucketed, day, SETTINGS)
    assert not build.window_built_by_group(bucketed, day, {**SETTINGS, "prior_impressions": 7.0})
    assert read_metadata(bucketed, contracts.USER_WINDOW, shift_ds(day, 1)).get("mode") == "incremental"


@pytest.mark.unit
@pytest.mark.parametrize("day", BUILT)
def test_shards_reading_bucketed_events_equal_the_unsharded_build(roots: tuple[Path, Path], bucketed: Path,
                                                                  day: str) -> None:
    whole, _ = roots
    for dataset, key in KEYS.items():
        expected, got = read_table(whole, dataset, day), read_table(bucketed, dataset, day)
        assert sorted_by(got, key).equals(sorted_by(expected, key)), f"{dataset} ds={day}"
        meta_whole, meta_bucketed = read_metadata(whole, dataset, day), read_metadata(bucketed, dataset, day)
        assert {k: v for k, v in meta_bucketed.items() if k not in LAYOUT_KEYS} == {
            k: v for k, v in meta_whole.items() if k not in LAYOUT_KEYS
        }, f"{dataset} ds={day}"


@pytest.mark.unit
def test_files_of_bucketed_layouts_are_lz4_without_list_statistics_and_unsharded_ones_unchanged(
    roots: tuple[Path, Path], bucketed: Path
) -> None:
    import pyarrow.parquet as pq

    whole, _ = roots
    day = BUILT[-1]

    def codecs_and_statistics(root: Path, dataset: str) -> tuple[set[str], set[str]]:
        codecs, with_statistics = set(), set()
        for f in storage.data_files(root, dataset, day):
            meta = pq.ParquetFile(f).metadata
            for i in range(meta.num_row_groups):
                for c in range(meta.num_columns):
                    column = meta.row_group(i).column(c)
                    codecs.add(column.compression)
                    if column.is_stats_set:
                        with_statistics.add(column.path_in_schema.split(".")[0])
        return codecs, with_statistics

    # A shard's output and the bucketed events (read whole by the next shards): LZ4, no statistics of list elements.
    for root, dataset in ((bucketed, contracts.USER_SEQUENCE), (bucketed, contracts.USER_DAILY),
                          (bucketed, contracts.EVENTS_BY_USER), (bucketed, contracts.EVENTS_BY_PIN)):
        codecs, with_statistics = codecs_and_statistics(root, dataset)
        assert codecs == {"LZ4"}, dataset  # pyarrow's name of LZ4_RAW
        lists = {f.name for f in pq.read_schema(storage.data_files(root, dataset, day)[0]) if pa.types.is_list(f.type)}
        assert with_statistics and not with_statistics & lists, dataset
    # The unsharded build's files as they were: Snappy, statistics on every column (lists included).
    codecs, with_statistics = codecs_and_statistics(whole, contracts.USER_SEQUENCE)
    assert codecs == {"SNAPPY"} and with_statistics == set(contracts.USER_SEQUENCE_SCHEMA.names)


@pytest.mark.unit
def test_a_shard_reads_only_its_buckets_and_never_stale_ones(bucketed: Path, tmp_path: Path) -> None:
    day = BUILT[1]
    names = lambda files: [storage.name_of(f) for f in files]  # noqa: E731
    # 6 buckets, shard 1 of 3: buckets 1 and 4; of 2: 1, 3, 5; of 4 (gcd 2): the odd ones, filtered.
    assert names(bucketed_events.events_part(bucketed, day, sharding.Shard(1, 3, "s")).files) == ["part-00001.parquet", "part-00004.parquet"]
    assert names(bucketed_events.events_part(bucketed, day, sharding.Shard(1, 2, "s"), "pin_id").files) == [
        "part-00001.parquet", "part-00003.parquet", "part-00005.parquet"]
    assert len(bucketed_events.events_part(bucketed, day, sharding.Shard(1, 4, "s")).files) == 3
    # Exactly its rows when the shard count divides the buckets' (no hash per row), else filtered.
    assert bucketed_events.events_part(bucketed, day, sharding.Shard(1, 3, "s")).keeps == "TRUE"
    assert bucketed_events.events_part(bucketed, day, sharding.Shard(1, 4, "s")).keeps == "hash(user_id) % 4 = 1"
    # The previous day's state merged from 3 shards: shard i of 3 reads part-i only; unsharded readers read all.
    assert names(sharding.shard_files(bucketed, contracts.USER_SEQUENCE, day, sharding.Shard(2, 3, "s"))) == ["part-00002.parquet"]
    assert len(sharding.shard_files(bucketed, contracts.USER_SEQUENCE, day, None)) == 3
    assert len(sharding.shard_files(bucketed, contracts.USER_SEQUENCE, day, sharding.Shard(0, 2, "s"))) == 3
    # Unsharded readers never read the buckets; a raw partition re-landed since it was bucketed is read whole.
    raw = storage.data_files(bucketed, contracts.RAW_EVENTS, day)
    assert bucketed_events.events_part(bucketed, day, None).files == raw
    root = tmp_path / "root"
    shutil.copytree(bucketed, root)
    storage.write_table(root, contracts.RAW_EVENTS, day, read_table(root, contracts.RAW_EVENTS, day))
    assert bucketed_events.events_part(root, day, sharding.Shard(1, 3, "s")) == (storage.data_files(root, contracts.RAW_EVENTS, day),
                                                                    "hash(user_id) % 3 = 1")
    # Re-landed by a producer that keeps its marker's text (an empty _SUCCESS): the files' fingerprint tells.
    other = BUILT[2]
    assert bucketed_events.day_counts(root, other)[0] is not None
    raw_folder = Path(partition(root, contracts.RAW_EVENTS, other))
    marker = (raw_folder / storage.MARKER).read_text()
    events = read_table(root, contracts.RAW_EVENTS, other)
    for old_file in raw_folder.glob("*.parquet"):
        old_file.unlink()
    pq.write_table(events.slice(0, events.num_rows // 2), raw_folder / "part-00000.parquet")
    assert (raw_folder / storage.MARKER).read_text() == marker
    counts, why = bucketed_events.day_counts(root, other)
    assert counts is None and "was made from another version of raw/events/ds=" in why
    assert bucketed_events.events_part(root, other, sharding.Shard(1, 3, "s")).keeps == "hash(user_id) % 3 = 1"
    # A DuckDB whose hash() differs from the one that wrote the layout reads every file.
    meta_path = storage.join(partition(root, contracts.EVENTS_BY_USER, BUILT[-1]), storage.METADATA_FILE)
    meta = dict(storage.read_json(meta_path))
    storage.write_json(meta_path, meta | {"hash_buckets": meta["hash_buckets"] | {"probe": -1}})
    assert len(bucketed_events.events_part(root, BUILT[-1], sharding.Shard(1, 3, "s")).files) == 6


@pytest.mark.unit
def test_window_shards_take_pin_totals_from_the_recorded_ones_or_every_pins_parts(
    roots: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An incremental window shard adds the previous window's recorded totals and the days' pin_daily sums (no pin
    read); parts that record none (built before) are summed over every pin's rows: the same totals, the same rows."""
    from features.steps import window

    whole, sharded = roots
    day = BUILT[-1]
    meta = read_metadata(sharded, contracts.PIN_WINDOW, day)
    assert meta["mode"] == "incremental"
    assert meta["totals"] == read_metadata(whole, contracts.PIN_WINDOW, day)["totals"]
    assert read_metadata(sharded, contracts.PIN_DAILY, day)["sums"] == read_metadata(whole, contracts.PIN_DAILY, day)["sums"]
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    with monkeypatch.context() as patched:  # the recorded totals: every pin's parts are not read
        patched.setattr(window, "PIN_TOTALS_OF_ALL_PARTS", "(SELECT no_such_column FROM pin_parts_all)")
        assert build_sharded(root, day, "window")[contracts.PIN_WINDOW]["totals"] == meta["totals"]
    daily_meta = Path(partition(root, contracts.PIN_DAILY, day)) / storage.METADATA_FILE
    recorded = storage.read_json(daily_meta)
    storage.write_json(daily_meta, {k: v for k, v in recorded.items() if k != "sums"})
    rebuilt = build_sharded(root, day, "window")[contracts.PIN_WINDOW]
    assert rebuilt["totals"] == meta["totals"] and rebuilt["global_rates"] == meta["global_rates"]
    assert read_table(root, contracts.PIN_WINDOW, day).equals(read_table(sharded, contracts.PIN_WINDOW, day))


@pytest.mark.unit
def test_the_first_connection_of_a_process_takes_the_hash_probe_and_stays_usable() -> None:
    import subprocess
    import sys

    # A fresh process: the probe is taken on its first connection (once per process), whose next query must work.
    code = ("from features import sharding, step_io\n"
            "with step_io.connect() as con:\n"
            "    assert con.sql('SELECT 42').fetchall() == [(42,)]\n"
            "assert sharding.hash_probe() == sharding._HASH_PROBE[0]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.unit
def test_a_shard_of_the_dags_first_job_counts_as_built_only_with_all_three_steps(roots: tuple[Path, Path],
                                                                                  tmp_path: Path) -> None:
    """daily_sequences_examples (the DAG's first job) builds three steps per shard: a shard killed after its daily step
    is still missing (a retry builds it again), and nothing of the day is published until every shard has all four."""
    _, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day, staging, job = BUILT[-1], str(tmp_path / "staging"), "daily_sequences_examples"
    published = {d: read_metadata(root, d, day) for d in build.step_datasets(job)}
    assert build.step_datasets(job) == (contracts.USER_DAILY, contracts.PIN_DAILY, contracts.USER_SEQUENCE, contracts.EXAMPLES)
    build.build_step(root, day, job, FEATURES, require_validation=False, engine=ENGINE, shard=sharding.Shard(0, 2, staging))
    build.build_step(root, day, "daily", FEATURES, require_validation=False, engine=ENGINE, shard=sharding.Shard(1, 2, staging))
    assert build.missing_shards(staging, job, 2) == [1]
    with pytest.raises(InfraError, match=r"shard\(s\) \[1\] have no output"):
        build.merge_shards(root, day, job, staging, 2)
    assert {d: read_metadata(root, d, day) for d in published} == published
    build.build_step(root, day, job, FEATURES, require_validation=False, engine=ENGINE, shard=sharding.Shard(1, 2, staging))
    merged = build.merge_shards(root, day, job, staging, 2)
    assert sorted(merged) == sorted(published) and all(m["shards"] == 2 for m in merged.values())
    for dataset in published:
        assert sorted_by(read_table(root, dataset, day), KEYS[dataset]).equals(
            sorted_by(read_table(sharded, dataset, day), KEYS[dataset])), dataset
    assert not Path(staging).exists()


@pytest.mark.unit
def test_a_failed_step_of_a_shard_fails_the_shard_after_the_others_end(
    roots: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's steps run side by side: one step's error is the shard's (its class kept), once the others have
    published theirs; the shard stays missing, so the retry builds it again."""
    from core.failures import DataError

    _, sharded = roots
    root = tmp_path / "root"
    shutil.copytree(sharded, root)
    day, staging, job = BUILT[-1], str(tmp_path / "staging"), "daily_sequences_examples"

    def broken(*_: object, **__: object) -> dict:
        raise DataError("sequences: an input was unreadable")

    monkeypatch.setattr(build, "build_sequences", broken)
    with pytest.raises(DataError, match="an input was unreadable"):
        build.build_step(root, day, job, FEATURES, require_validation=False, engine=ENGINE, shard=sharding.Shard(1, 2, staging))
    for dataset in (contracts.USER_DAILY, contracts.PIN_DAILY, contracts.EXAMPLES):
        assert (Path(sharding.shard_folder(staging, dataset, 1)) / storage.MARKER).exists(), dataset
    assert not Path(sharding.shard_folder(staging, contracts.USER_SEQUENCE, 1)).exists()
    assert build.missing_shards(staging, job, 2) == [0, 1]


@pytest.mark.unit
def test_a_staged_window_is_kept_only_while_every_input_is_as_it_was_built_from(
    roots: tuple[Path, Path], bucketed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The window task skips a staged window only while every input it summed is unchanged: a day of its window rebuilt
    since makes it stale (the task builds it again). Staged shards whose inputs were rebuilt before their merge are not
    published: the merge leaves the window to its job, and publishes the rest."""
    whole, _ = roots
    root = tmp_path / "root"
    shutil.copytree(bucketed, root)
    day = BUILT[-1]
    assert build.window_built_by_group(root, day, SETTINGS)
    # Re-landed raw events of a day before, its aggregates rebuilt (the same rows, a new publish stamp).
    build.build_step(root, shift_ds(day, -1), "daily", FEATURES, require_validation=False, engine=ENGINE)
    assert not build.window_built_by_group(root, day, SETTINGS)
    stale = build.stale_inputs(root, read_metadata(root, contracts.USER_WINDOW, day))
    assert f"the daily aggregates of {shift_ds(day, -1)}" in stale

    # Shards staged, then an input rebuilt before their merge.
    root = tmp_path / "second"
    shutil.copytree(bucketed, root)
    staging = str(tmp_path / "staging")
    for index in range(SHARDS):
        build.build_step(root, day, "daily_sequences_examples", FEATURES, require_validation=False, engine=ENGINE,
                         shard=sharding.Shard(index, SHARDS, staging))
    assert not build.missing_shards(staging, "daily_sequences_examples", SHARDS)
    assert (Path(sharding.shard_folder(staging, contracts.USER_WINDOW, 0)) / storage.MARKER).exists()
    build.build_step(root, shift_ds(day, -1), "window", FEATURES, require_validation=False, engine=ENGINE)
    with caplog.at_level("WARNING", logger="features.build"):
        merged = build.merge_shards(root, day, "daily_sequences_examples", staging, SHARDS, SETTINGS)
    assert contracts.USER_WINDOW not in merged and contracts.USER_DAILY in merged
    assert "window of the shards left to its own job: built from inputs rebuilt since" in caplog.text
    assert not Path(staging).exists()  # its shards removed with the rest
    assert not build.window_built_by_group(root, day, SETTINGS)
    build_sharded(root, day, "window")  # the window task's job
    for dataset in (contracts.USER_WINDOW, contracts.PIN_WINDOW):
        assert sorted_by(read_table(root, dataset, day), KEYS[dataset]).equals(
            sorted_by(read_table(whole, dataset, day), KEYS[dataset])), dataset


@pytest.mark.unit
def test_a_shard_that_cannot_stage_the_window_leaves_none_behind_and_builds_the_rest(
    bucketed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried shard that does not stage the window (it failed there, or the window cannot be incremental now)
    removes the window an earlier try staged, so the merge never mixes them: the window is left to its job."""
    from features.steps import window

    root = tmp_path / "root"
    shutil.copytree(bucketed, root)
    day, staging, job = BUILT[-1], str(tmp_path / "staging"), "daily_sequences_examples"
    for index in range(2):
        build.build_step(root, day, job, FEATURES, require_validation=False, engine=ENGINE,
                         shard=sharding.Shard(index, 2, staging))
    staged = Path(sharding.shard_folder(staging, contracts.USER_WINDOW, 1)) / storage.MARKER
    assert staged.exists()

    def broken(*_: object, **__: object) -> dict:
        raise OSError("no space left on device")

    monkeypatch.setattr(window, "write_query", broken)
    built = build.build_step(root, day, job, FEATURES, require_validation=False, engine=ENGINE,
                             shard=sharding.Shard(1, 2, staging))  # the retry of shard 1: its window fails
    assert contracts.USER_WINDOW not in built and contracts.EXAMPLES in built
    assert not staged.exists()
    monkeypatch.undo()
    merged = build.merge_shards(root, day, job, staging, 2, SETTINGS)
    assert set(merged) == set(build.step_datasets(job))
