"""The validation gate on a synthetic world: 30 good days pass, and a corpus of corruptions of a good day
each fail on the check that names them, are quarantined, and leave everything else untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from core import contracts, storage
from core.config import ValidationConfig
from features import validate
from features.synthetic import WorldConfig, generate_world
from features.validation.report import quarantine_records

pytestmark = pytest.mark.unit

DAYS = 30
WORLD = WorldConfig(start="2026-11-01", days=DAYS, users=120, pins=150, seed=11)
LAST = WORLD.day_list[-1]
DATASETS = ("events", "pins", "users")
CONFIG = ValidationConfig()


def validate_partition(root: Path, dataset: str, ds: str = LAST) -> validate.ValidationReport:
    """As the daily DAG runs it by default: quarantine on, default thresholds (no Data Docs: they take time)."""
    return validate.validate_partition(root, dataset, ds, config=CONFIG, data_docs=False, quarantine=True)


def partition(root: Path, dataset: str) -> Path:
    return Path(storage.partition(root, f"raw/{dataset}", LAST))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[validate.ValidationReport]]]:
    """A 30-day world, every partition validated in day order (as the daily DAG would), plus the daily
    aggregates of the last day, standing for downstream outputs of an earlier run."""
    root = tmp_path_factory.mktemp("world")
    generate_world(root, WORLD)
    reports: dict[str, list[validate.ValidationReport]] = {d: [] for d in DATASETS}
    for ds in WORLD.day_list:
        for dataset in DATASETS:
            reports[dataset].append(validate_partition(root, dataset, ds))
    from features.steps.daily import build_daily

    build_daily(root, LAST)
    return root, reports


def test_thirty_good_days_in_a_row_all_pass(world) -> None:
    root, reports = world
    for dataset in DATASETS:
        failures = {r.ds: r.failure_message() for r in reports[dataset] if not r.success}
        assert not failures, failures
        # The first days have no history: they pass with a warning, and later days are compared.
        assert reports[dataset][0].warnings and not reports[dataset][-1].warnings
        last = {c.name: c for c in reports[dataset][-1].checks}
        assert len(last["history.volume"].observed["history_days"]) == 7
    mix = {c.name: c for c in reports["events"][-1].checks}["history.action_mix"]
    assert mix.success and mix.observed["psi"] < 0.1
    assert not (root / "quarantine").exists()


# --- the corpus --------------------------------------------------------------------------------------------


def _events(root: Path) -> pa.Table:
    return storage.read_table(root, "raw/events", LAST)


def _pins(root: Path) -> pa.Table:
    return storage.read_table(root, "raw/pins", LAST)


def _users(root: Path) -> pa.Table:
    return storage.read_table(root, "raw/users", LAST)


def _write(root: Path, dataset: str, table: pa.Table) -> None:
    storage.write_table(root, f"raw/{dataset}", LAST, table)


def _set(table: pa.Table, name: str, values: pa.Array | pa.ChunkedArray, nullable: bool = False) -> pa.Table:
    index = table.schema.get_field_index(name)
    return table.set_column(index, pa.field(name, values.type, nullable=nullable), values)


def _rows(table: pa.Table, mask: np.ndarray) -> pa.Table:
    return table.filter(pa.array(mask))


def _engagement_mask(table: pa.Table) -> np.ndarray:
    return table.column("action").to_numpy(zero_copy_only=False) != "impression"


def wrong_type(root: Path) -> None:
    t = _events(root)
    _write(root, "events", _set(t, "user_id", pc.cast(t.column("user_id"), pa.string())))


def missing_column(root: Path) -> None:
    _write(root, "events", _events(root).drop_columns(["surface"]))


def null_ids(root: Path) -> None:
    t = _events(root)
    pins = t.column("pin_id").to_numpy().astype(object)
    pins[np.flatnonzero(_engagement_mask(t))[::40]] = None  # a few engagements: under the null-rate jump
    _write(root, "events", _set(t, "pin_id", pa.array(pins, pa.int64()), nullable=True))


def unknown_action(root: Path) -> None:
    t = _events(root)
    actions = t.column("action").to_numpy(zero_copy_only=False).copy()
    clicks = np.flatnonzero(actions == "click")[:5]
    actions[clicks] = "like"
    _write(root, "events", _set(t, "action", pa.array(actions, pa.string())))


def duplicated_events(root: Path) -> None:
    t = _events(root)
    _write(root, "events", pa.concat_tables([t, t.slice(0, t.num_rows // 20)]))


def ts_other_day(root: Path) -> None:
    t = _events(root)
    ts = t.column("ts").to_numpy().copy()
    ts[::31] -= np.timedelta64(1, "D")
    _write(root, "events", _set(t, "ts", pa.array(ts, contracts.TS)))


def volume_drop(root: Path) -> None:
    t = _events(root)  # whole impressions with their engagements: the mix stays
    _write(root, "events", _rows(t, t.column("impression_id").to_numpy() % 10 == 0))


def action_mix_shift(root: Path) -> None:
    t = _events(root)
    actions = t.column("action").to_numpy(zero_copy_only=False).copy()
    actions[np.isin(actions, ["repin", "hide", "closeup"])] = "click"
    _write(root, "events", _set(t, "action", pa.array(actions, pa.string())))


def nan_embeddings(root: Path) -> None:
    t = _pins(root)
    emb = np.stack(t.column("embedding").to_numpy(zero_copy_only=False)).astype(np.float32)
    emb[::10, 3] = np.nan
    values = pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel(), pa.float32()), contracts.EMBEDDING_DIM)
    _write(root, "pins", _set(t, "embedding", values))


def short_embeddings(root: Path) -> None:
    t = _pins(root)
    emb = np.stack(t.column("embedding").to_numpy(zero_copy_only=False))[:, :16]
    _write(root, "pins", _set(t, "embedding", pa.array(list(emb), pa.list_(pa.float32()))))


def ragged_image_embedding(root: Path) -> None:
    t = _pins(root)
    images = [list(v) for v in t.column("image_embedding").to_pylist()]
    images[3] = images[3][:10]  # one row of another width
    _write(root, "pins", _set(t, "image_embedding", pa.array(images, pa.list_(pa.float32()))))


def tokens_outside_the_vocabulary(root: Path) -> None:
    t = _pins(root)
    tokens = [list(v) for v in t.column("text_tokens").to_pylist()]
    tokens[5] = [*tokens[5], contracts.TEXT_VOCAB + 3]
    tokens[6] = [-1]
    _write(root, "pins", _set(t, "text_tokens", pa.array(tokens, pa.list_(pa.int32()))))


def dangling_pins(root: Path) -> None:
    t = _events(root)  # every event of some pins, so that engagements still match their impression
    pins = t.column("pin_id").to_numpy().copy()
    pins[pins % 7 == 0] += 10**12
    _write(root, "events", _set(t, "pin_id", pa.array(pins, pa.int64())))


def engagements_without_impressions(root: Path) -> None:
    t = _events(root)
    drop = (~_engagement_mask(t)) & (t.column("event_id").to_numpy() % 5 == 0)
    _write(root, "events", _rows(t, ~drop))


def malformed_ids(root: Path) -> None:
    t = _events(root)  # engagements' own ids: nothing references them
    ids = t.column("event_id").to_numpy().copy()
    eng = np.flatnonzero(_engagement_mask(t))[:3]
    ids[eng] = -ids[eng]
    _write(root, "events", _set(t, "event_id", pa.array(ids, pa.int64())))


def bad_country(root: Path) -> None:
    t = _users(root)
    country = t.column("country").to_numpy(zero_copy_only=False).copy()
    country[:4] = "usa"
    _write(root, "users", _set(t, "country", pa.array(country, pa.string())))


def truncated_file(root: Path) -> None:
    data = partition(root, "events") / storage.DATA_FILE
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def not_parquet(root: Path) -> None:
    data = partition(root, "pins") / storage.DATA_FILE
    data.write_text("pin_id,embedding\n1,[0.1]\n")


def empty_partition(root: Path) -> None:
    _write(root, "events", _events(root).slice(0, 0))


def no_data_files(root: Path) -> None:
    (partition(root, "users") / storage.DATA_FILE).unlink()


# name -> (dataset, corruption, the check that names it, other checks it may also fail)
CORPUS: dict[str, tuple[str, Callable[[Path], None], str, set[str]]] = {
    "wrong type": ("events", wrong_type, "schema.types", set()),
    "missing column": ("events", missing_column, "schema.columns", {"table.columns_match_set"}),
    "null ids": ("events", null_ids, "pin_id.not_null", set()),
    "unknown action": ("events", unknown_action, "action.in_set", set()),
    "duplicated events": ("events", duplicated_events, "event_id.unique", set()),
    "timestamps from another day": ("events", ts_other_day, "ts.in_partition_day", set()),
    "90% volume drop": ("events", volume_drop, "history.volume", set()),
    "sudden action-mix shift": ("events", action_mix_shift, "history.action_mix", set()),
    "NaN embeddings": ("pins", nan_embeddings, "embedding.finite", set()),
    "short embeddings": ("pins", short_embeddings, "embedding.length", {"schema.types"}),
    "a ragged image embedding": ("pins", ragged_image_embedding, "image_embedding.one_width", set()),
    "text tokens outside the vocabulary": ("pins", tokens_outside_the_vocabulary, "text_tokens.in_vocabulary", set()),
    "dangling pin ids": ("events", dangling_pins, "pin_id.in_pins_snapshot", set()),
    "engagements without impressions": ("events", engagements_without_impressions, "engagement.has_impression", set()),
    "malformed event ids": ("events", malformed_ids, "event_id.well_formed", set()),
    "malformed country codes": ("users", bad_country, "country.well_formed", set()),
    "truncated file": ("events", truncated_file, "files.readable", set()),
    "not a Parquet file": ("pins", not_parquet, "files.readable", set()),
    "empty partition": ("events", empty_partition, "table.row_count", {"history.volume"}),  # mix: not run
    "marker without data files": ("users", no_data_files, "partition.files", set()),
}


def _digests(root: Path, skip: tuple[Path, ...]) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(p.is_relative_to(s) for s in skip)
    }


@pytest.mark.parametrize("name", list(CORPUS))
def test_corruption_fails_its_check_and_is_quarantined(world, tmp_path: Path, name: str) -> None:
    dataset, corrupt, expected, also = CORPUS[name]
    root = tmp_path / "root"
    shutil.copytree(world[0], root)
    part = partition(root, dataset)
    own = (part, Path(validate.report_dir(root, dataset, LAST)), root / "quarantine")
    corrupt(root)
    before = _digests(root, own)

    report = validate_partition(root, dataset)

    failed = {c.name for c in report.failed_checks}
    assert expected in failed, report.failure_message()
    assert failed <= {expected} | also, f"{name}: unexpected failures {sorted(failed - {expected} - also)}"
    assert expected in report.failure_message() and f"ds={LAST}" in report.failure_message()
    # Quarantined: moved aside with its report and a record, never deleted.
    assert not part.exists()
    [location] = quarantine_records(root, dataset, LAST)
    assert report.quarantine == location
    record = Path(location)
    assert (record / "data" / storage.MARKER).exists()
    assert json.loads((record / "report" / "result.json").read_text())["success"] is False
    assert expected in json.loads((record / "QUARANTINE.json").read_text())["failed_checks"]
    # Every other partition, report and downstream output is untouched.
    assert _digests(root, own) == before
    assert storage.is_complete(root, "features/user_daily", LAST)


def test_good_last_day_passes(world) -> None:
    root, reports = world
    assert all(reports[d][-1].success for d in DATASETS)


def test_relanded_partition_validates_again_and_the_record_stays(world, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(world[0], root)
    good = _events(root)
    volume_drop(root)
    assert not validate_partition(root, "events").success
    _write(root, "events", good)  # the data engineer lands the corrected partition

    report = validate_partition(root, "events")

    assert report.success, report.failure_message()
    [record] = quarantine_records(root, "events", LAST)
    assert (Path(record) / "data" / storage.DATA_FILE).exists() and (Path(record) / "QUARANTINE.json").exists()
    assert report.quarantine_history == [record]
    assert report.quarantine is None


def test_missing_marker_fails_but_is_not_moved(world, tmp_path: Path) -> None:
    """An incomplete partition may still be landing: it fails, and stays where its writer puts it."""
    root = tmp_path / "root"
    shutil.copytree(world[0], root)
    part = partition(root, "events")
    (part / storage.MARKER).unlink()

    report = validate_partition(root, "events")

    assert [c.name for c in report.failed_checks] == ["partition.marker"]
    assert part.exists() and report.quarantine is None
    assert not (root / "quarantine").exists()


def test_events_pass_when_the_pins_snapshot_is_quarantined(world, tmp_path: Path) -> None:
    """Referential checks need the day's snapshots; a quarantined snapshot is its own task's failure."""
    root = tmp_path / "root"
    shutil.copytree(world[0], root)
    nan_embeddings(root)
    assert not validate_partition(root, "pins").success

    report = validate_partition(root, "events")

    assert report.success, report.failure_message()
    ref = {c.name: c for c in report.checks}["pin_id.in_pins_snapshot"]
    assert ref.status == "skipped" and "validate_pins" in ref.details


def test_corpus_is_large_enough() -> None:
    assert len({check for _, _, check, _ in CORPUS.values()}) >= 12
