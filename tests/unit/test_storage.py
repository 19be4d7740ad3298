"""core.storage on a local folder and on an fsspec URL (fsspec's in-process ``memory://`` filesystem,
which goes through the same code as ``s3://``), and what the training job builds on it: partitions,
streamed examples and DCP checkpoints on a URL. The same against a real S3 API: tests/integration/test_train_s3.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

from core import storage
from training import checkpoint
from training.data import ExampleStream, PinEmbeddings
from training.models.pin_ranker.inputs import EXAMPLE_COLUMNS, encode_batch
from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.unit

DAYS = ["2026-01-01", "2026-01-02"]


@pytest.fixture(params=["local", "url"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "base")
        return
    url = f"memory:///{tmp_path.name}/base"
    yield url
    fs, path = storage.filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def tiny_world(tmp_path: Path) -> str:
    write_tiny_world(tmp_path / "storage", DAYS, rows_per_day=60, pins=30, row_group_size=16, max_sequence=8)
    return str(tmp_path / "storage")


def test_small_files_round_trip_and_are_listed(base: str):
    assert storage.is_remote(base) == base.startswith("memory://")
    path = storage.join(base, "job", "heartbeat-rank0.json")
    assert not storage.exists(path)
    storage.make_dirs(storage.join(base, "job"))
    storage.write_json(path, {"step": 3})
    storage.write_json(path, {"step": 4})  # replaced whole
    storage.write_json(storage.join(base, "job", "heartbeat-rank1.json"), {"step": 4})
    assert storage.exists(path)
    assert storage.read_text(path).replace(" ", "").replace("\n", "") == '{"step":4}'
    assert storage.glob(storage.join(base, "job"), "heartbeat-rank*.json") == [
        storage.join(base, "job", f"heartbeat-rank{r}.json") for r in (0, 1)
    ]
    assert storage.glob(storage.join(base, "nothing-here"), "*.json") == []
    storage.remove(path)
    storage.remove(path)  # not there: nothing happens
    assert not storage.exists(path)
    with pytest.raises(FileNotFoundError):
        storage.read_text(path)
    storage.remove_tree(storage.join(base, "job"))
    storage.remove_tree(storage.join(base, "job"))
    assert not storage.exists(storage.join(base, "job", "heartbeat-rank1.json"))


def test_local_paths_and_file_urls_stay_local(tmp_path: Path):
    assert not storage.is_remote(tmp_path) and not storage.is_remote(f"file://{tmp_path}")
    assert storage.is_remote("s3://bucket/prefix")
    assert storage.join(f"file://{tmp_path}", "a", "b") == str(tmp_path / "a" / "b")
    assert storage.join("s3://bucket/prefix/", "a", "b.json") == "s3://bucket/prefix/a/b.json"
    odd = tmp_path / "run[1]"  # glob characters in the folder name match themselves
    storage.write_json(str(odd / "x.json"), {})
    assert storage.glob(str(odd), "*.json") == [str(odd / "x.json")]


def test_partitions_and_the_example_stream_read_the_same_from_a_url(tiny_world: str, tmp_path: Path):
    url = f"memory:///{tmp_path.name}/storage"
    fs = fsspec.filesystem("memory")
    fs.put(f"{tiny_world}/", url, recursive=True)
    try:
        fs.rm(f"{url}/examples/ds=2026-01-02/_SUCCESS")  # an incomplete partition does not exist
        assert storage.complete_days(url, "examples") == ["2026-01-01"]
        assert not storage.is_complete(url, "examples", "2026-01-02")
        with pytest.raises(FileNotFoundError, match="ds=2026-01-02 is missing or incomplete"):
            storage.data_files(url, "examples", "2026-01-02")
        assert storage.data_files(url, "examples", "2026-01-01") == [
            f"{url}/examples/ds=2026-01-01/part-00000.parquet"
        ]

        def batches(root: str) -> list[dict[str, torch.Tensor]]:
            pins = PinEmbeddings.from_snapshot(root, DAYS[0])
            stream = ExampleStream(root, DAYS[:1], lambda t: encode_batch(t, pins, 8), batch_size=8,
                                   columns=EXAMPLE_COLUMNS, world_size=2, rank=1)
            stream.set_epoch(1, skip=1)
            return list(stream)

        local, remote = batches(tiny_world), batches(url)
        assert len(local) == len(remote) > 0
        for a, b in zip(local, remote, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        fs.rm(url, recursive=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in a single process
def test_checkpoints_on_a_url_save_prune_find_and_load(base: str):
    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    model, opt, sched = build(0)
    for step in (2, 4):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        sched.step()
        saved = checkpoint.save(
            base, step=step, epoch=0, examples_seen=3 * step, parts={"model": (model, opt, sched)},
            data={"epoch": 0, "batches": step}, is_main=True, keep=1,
        )
        assert saved == checkpoint.step_dir(base, step)
    storage.write_json(storage.join(checkpoint.step_dir(base, 6), ".metadata.tmp"), {})  # died unmarked
    assert checkpoint.complete_checkpoints(base) == [(4, checkpoint.step_dir(base, 4))]  # step 2 pruned
    assert not storage.exists(storage.join(checkpoint.step_dir(base, 2), checkpoint.MARKER))
    latest = checkpoint.latest_checkpoint(base)
    assert latest is not None and latest["step"] == 4 and latest["path"] == checkpoint.step_dir(base, 4)

    fresh, fresh_opt, fresh_sched = build(1)
    position = checkpoint.load(latest["path"], parts={"model": (fresh, fresh_opt, fresh_sched)})
    assert position == {"step": 4, "epoch": 0, "examples_seen": 12, "data": {"epoch": 0, "batches": 4}}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])


def test_an_object_store_that_does_not_answer_is_infra_a_denied_one_is_user():
    import errno

    from botocore.exceptions import ClientError, EndpointConnectionError

    from core.failures import ExitCode, exit_code_for

    def reply(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    def as_s3fs_raises(error: ClientError) -> OSError:
        translated = OSError(errno.EIO, str(error))
        translated.__cause__ = error
        return translated

    assert exit_code_for(EndpointConnectionError(endpoint_url="https://s3.amazonaws.com")) is ExitCode.INFRA
    assert exit_code_for(as_s3fs_raises(reply(503, "SlowDown"))) is ExitCode.INFRA
    assert exit_code_for(as_s3fs_raises(reply(500, "InternalError"))) is ExitCode.INFRA
    assert exit_code_for(reply(403, "AccessDenied")) is ExitCode.USER
    assert exit_code_for(PermissionError("Access Denied")) is ExitCode.USER


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_write_that_fails_in_storage_is_infra(base: str, monkeypatch: pytest.MonkeyPatch):
    import errno

    from core.failures import InfraError

    def failing_writer(path: str) -> object:
        writer = real_writer(path)

        def write_data(plan: object, planner: object) -> None:
            raise OSError(errno.EIO, "the storage went away")

        writer.write_data = write_data  # type: ignore[method-assign]
        return writer

    real_writer = checkpoint._writer
    monkeypatch.setattr(checkpoint, "_writer", failing_writer)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(InfraError, match="checkpoint save at .* failed on rank\\(s\\) \\[0\\]: OSError: .*went away"):
        checkpoint.save(base, step=1, epoch=0, examples_seen=1, parts={"model": (model, opt, sched)}, is_main=True)
    assert checkpoint.latest_checkpoint(base) is None


def test_a_partition_is_published_whole_and_a_rerun_replaces_exactly_it(base: str):
    import pyarrow as pa

    first = pa.table({"x": [1, 2, 3]})
    storage.write_table(base, "features/user_daily", "2026-01-01", first, {"rows": 3})
    with storage.write_partition(base, "features/user_daily", "2026-01-01") as staging:
        # Not visible while it is written: readers still see the complete old partition (locally the old folder, on
        # an object store the version folder its marker names).
        assert storage.read_table(base, "features/user_daily", "2026-01-01").equals(first)
        storage.write_bytes(storage.join(staging, "part-00000.parquet"), _parquet(pa.table({"x": [7]})))
        storage.write_bytes(storage.join(staging, "part-00001.parquet"), _parquet(pa.table({"x": [8]})))
    assert storage.read_table(base, "features/user_daily", "2026-01-01")["x"].to_pylist() == [7, 8]
    assert storage.read_metadata(base, "features/user_daily", "2026-01-01") == {}  # the old one went with it

    storage.write_table(base, "features/user_daily", "2026-01-02", first)
    with pytest.raises(RuntimeError), storage.write_partition(base, "features/user_daily", "2026-01-02") as staging:
        storage.write_bytes(storage.join(staging, "part-00000.parquet"), b"half a file")
        raise RuntimeError("the writer died")
    # A failed rewrite never shows half a partition: the old one stays, and the new one's folder goes.
    assert storage.read_table(base, "features/user_daily", "2026-01-02").equals(first)
    assert storage.list_names(storage.join(base, "features", "user_daily")) == ["ds=2026-01-01", "ds=2026-01-02"]
    if storage.is_remote(base):
        part = storage.partition(base, "features/user_daily", "2026-01-02")
        assert storage.list_names(part) == [storage.MARKER, storage.name_of(storage.resolve(part))]
    assert storage.complete_days(base, "features/user_daily")[0] == "2026-01-01"


def test_replaced_versions_stay_readable_for_the_grace_however_fast_a_partition_is_republished(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    import pyarrow as pa

    root = f"memory:///{tmp_path.name}/grace"
    dataset, day = "features/user_daily", "2026-01-01"
    part = storage.partition(root, dataset, day)

    def versions() -> list[str]:
        return [n for n in storage.list_names(part) if n.startswith(storage.VERSION_PREFIX)]

    try:
        storage.write_table(root, dataset, day, pa.table({"x": [0]}))
        resolved = storage.resolve(part)  # a reader resolves the first version, then reads slowly
        for x in (1, 2, 3):
            storage.write_table(root, dataset, day, pa.table({"x": [x]}))
        assert len(versions()) == 4  # three publishes within the grace: every version stays
        assert storage.read_parquet(storage.join(resolved, storage.DATA_FILE))["x"].to_pylist() == [0]

        # The store says the current version was published an hour ago (the marker as read before the switch): the
        # next publish removes what is older than it, keeping the one it replaces.
        real, calls = storage.publishing._marker_tag, []

        def an_hour_earlier_before_the_switch(path: str) -> tuple[str | None, float | None]:
            tag, written = real(path)
            calls.append(path)
            return tag, written - 3600 if len(calls) == 1 and written is not None else written

        monkeypatch.setattr(storage.publishing, "_marker_tag", an_hour_earlier_before_the_switch)
        storage.write_table(root, dataset, day, pa.table({"x": [4]}))
        assert len(calls) == 2  # before the switch, and the tidy-up's now
        monkeypatch.setattr(storage.publishing, "_marker_tag", real)
        kept = versions()
        assert len(kept) == 2 and storage.resolve(part) == storage.join(part, kept[1])
        assert not storage.exists(resolved)
        assert storage.read_table(root, dataset, day)["x"].to_pylist() == [4]
    finally:
        fs, path = storage.filesystem(root)
        fs.rm(path, recursive=True)


def test_a_folder_moves_and_copies_between_roots(base: str, tmp_path: Path):
    storage.write_json(storage.join(base, "a", "x.json"), {"k": 1})
    storage.write_json(storage.join(base, "a", "sub", "y.json"), {"k": 2})
    storage.copy_tree(storage.join(base, "a"), str(tmp_path / "copy"))
    assert storage.read_json(str(tmp_path / "copy" / "sub" / "y.json")) == {"k": 2}
    storage.move_tree(storage.join(base, "a"), storage.join(base, "b"))
    assert not storage.exists(storage.join(base, "a", "x.json"))
    assert storage.read_json(storage.join(base, "b", "sub", "y.json")) == {"k": 2}
    assert storage.list_names(storage.join(base, "b")) == ["sub", "x.json"]


def _parquet(table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue().to_pybytes())


def test_an_incremental_snapshot_resolves_to_the_full_view_as_of_a_day(base: str):
    import pyarrow as pa

    def pins(ids: list[int], category: int) -> pa.Table:
        return pa.table({"pin_id": pa.array(ids, pa.int64()), "category": pa.array([category] * len(ids), pa.int32())})

    storage.write_table(base, "raw/pins", "2026-11-01", pins([1, 2, 3], 0), {"snapshot": "full"})
    storage.write_table(base, "raw/pins", "2026-11-02", pins([2, 4], 1), {"snapshot": "incremental"})
    storage.write_table(base, "raw/pins", "2026-11-03", pins([4], 2), {"snapshot": "incremental"})

    assert storage.snapshot_days(base, "raw/pins", "2026-11-03") == ["2026-11-01", "2026-11-02", "2026-11-03"]
    view, newest = storage.read_snapshot(base, "raw/pins", "2026-11-03", "pin_id", ["category"])
    assert newest == "2026-11-03"
    # One row per pin, the newest partition's winning.
    assert dict(zip(view.column("pin_id").to_pylist(), view.column("category").to_pylist(), strict=True)) == {
        1: 0, 2: 1, 3: 0, 4: 2
    }
    as_of_2 = storage.read_snapshot(base, "raw/pins", "2026-11-02", "pin_id", ["category"])[0]
    assert sorted(as_of_2.column("pin_id").to_pylist()) == [1, 2, 3, 4]
    # A full snapshot starts the view afresh: pins absent from it are gone.
    storage.write_table(base, "raw/pins", "2026-11-04", pins([1, 4], 3))
    assert storage.snapshot_days(base, "raw/pins", "2026-11-04") == ["2026-11-04"]
    assert sorted(storage.read_snapshot(base, "raw/pins", "2026-11-04", "pin_id")[0].column("pin_id").to_pylist()) == [1, 4]
    assert storage.read_snapshot(base, "raw/pins", "2026-10-31", "pin_id")[1] is None


def test_day_spans_name_runs_of_consecutive_days_once():
    days = ["2026-06-07", "2026-06-01", "2026-06-02", "2026-06-03", "2026-06-30", "2026-07-01"]
    assert storage.day_spans(days) == ("2026-06-01 to 2026-06-03 (3 days), 2026-06-07, "
                                       "2026-06-30 to 2026-07-01 (2 days)")
    assert storage.day_spans(storage.day_range("2026-05-01", "2026-05-29")) == "2026-05-01 to 2026-05-29 (29 days)"
    assert storage.day_spans([]) == ""
