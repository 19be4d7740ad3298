"""The sharded export (training.sharded_export): its manifest, its checks, and the corpus plan by table rows."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from core.failures import DataError
from training import inference, sharded_export
from training.sdk import load_family
from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.unit

DAYS = ["2026-01-01", "2026-01-02"]
SMALL = {
    "sequence_length": 8, "d_model": 16, "n_heads": 2, "ff_dim": 32, "first_k": 2, "sparse_dim": 8,
    "pin_buckets": 21, "user_buckets": 11, "creator_buckets": 11, "category_buckets": 17, "mlp_hidden": [32],
    "ablation": False, "id_tables": "managed",
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A managed-id ranker sharded by TorchRec on a world of one, exported sharded and gathered, and a batch."""
    import torch.distributed as dist

    from training import torchrec_sharding as ts
    from training.data import ExampleStream

    root = tmp_path_factory.mktemp("world")
    write_tiny_world(root, DAYS, rows_per_day=120, pins=60, users=30, row_group_size=60, max_sequence=12)
    family = load_family("pin_ranker", params=SMALL)
    context = family.prepare(str(root), DAYS[:-1], DAYS[-1])
    names = family.sparse_features()
    folder = str(tmp_path_factory.mktemp("export") / "model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=dt.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = ts.to_torchrec(ts.build_meta(family.build_model, names), names, seed=0,
                               init_std=family.sparse_init_std())
        dmp = ts.shard(ts.to_device(model, torch.device("cpu")), sharding="row_wise", device=torch.device("cpu"),
                       lr=0.1, weight_decay=0.0)
        manifest = sharded_export.export(dmp, names, folder)
        full = ts.gather_full(dmp, names, load_family("pin_ranker", params=SMALL).build_model)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    stream = ExampleStream(str(root), DAYS[:1], lambda t: family.encode(t, context), batch_size=32,
                           dataset=family.dataset, columns=family.columns, seed=1)
    batch = family.finish(next(iter(stream)), context)
    return {"folder": folder, "manifest": manifest, "full": full, "batch": batch, "names": names}


def test_the_export_has_a_manifest_of_row_ranges_with_checksums_and_serves_what_the_gathered_model_does(exported):
    folder, manifest = str(exported["folder"]), exported["manifest"]
    assert isinstance(manifest, dict) and manifest["format"] == sharded_export.FORMAT
    # What a retry of the same step asks before exporting again (a published export is never rewritten).
    assert sharded_export.published(folder) and not sharded_export.published(f"{folder}-never-exported")
    assert json.loads((Path(folder) / sharded_export.MANIFEST_FILE).read_text()) == manifest
    assert set(manifest["tables"]) == set(exported["names"])  # type: ignore[arg-type]
    pin = manifest["tables"]["pin_emb"]
    assert (pin["rows"], pin["dim"], pin["dtype"]) == (21, 8, "float32")
    assert [(s["row_start"], s["row_end"], s["col_start"], s["col_end"]) for s in pin["shards"]] == [(0, 21, 0, 8)]
    shard = pin["shards"][0]
    assert sharded_export.sha256_of(str(Path(folder) / shard["file"])) == shard["sha256"]
    # The managed-id mapping travels in the dense part, not in any table file.
    assert "managed_pin_id" in torch.load(Path(folder) / sharded_export.DENSE_FILE, weights_only=True)

    family = load_family("pin_ranker", params=SMALL)  # unprepared: the mapping comes from the export
    model = sharded_export.load(folder, family, sha256=sharded_export.manifest_sha256(folder))
    full = exported["full"].eval()  # type: ignore[union-attr]
    with torch.no_grad():
        got, want = model(exported["batch"]), full(exported["batch"])
    for label in want:
        assert torch.equal(got[label], want[label]), label
    assert torch.equal(model.managed_pin_id, full.managed_pin_id)
    # Only the files of the tables looked up were opened, each once.
    assert len(sharded_export.opened_files(model)) == len(set(sharded_export.opened_files(model)))


def test_a_changed_or_missing_shard_or_manifest_is_a_data_error_naming_the_file(exported, tmp_path: Path):
    import shutil

    source = Path(str(exported["folder"]))
    folder = tmp_path / "copy"
    shutil.copytree(source, folder)
    digest = sharded_export.manifest_sha256(str(folder))
    family = load_family("pin_ranker", params=SMALL)
    pin_file = folder / exported["manifest"]["tables"]["pin_emb"]["shards"][0]["file"]  # type: ignore[index]
    array = np.load(pin_file)
    array[3, 0] += 1.0
    np.save(pin_file, array)
    model = sharded_export.load(str(folder), family, sha256=digest)  # files are checked when first opened
    with pytest.raises(DataError, match=f"{pin_file}.*SHA-256"):
        model.pin_emb(torch.tensor([3]))
    pin_file.unlink()
    with pytest.raises(DataError, match=f"{pin_file} is missing"):
        sharded_export.load(str(folder), family, sha256=digest).pin_emb(torch.tensor([3]))
    manifest = folder / sharded_export.MANIFEST_FILE
    manifest.write_text(manifest.read_text().replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(DataError, match=f"{manifest} is not the one the model was registered with"):
        sharded_export.load(str(folder), family, sha256=digest)


def test_an_export_on_an_object_store_is_read_from_one_local_copy_per_file_removed_with_the_model(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The in-memory filesystem stands for S3 (moto in tests/integration): a looked-up table's file is fetched once
    into a local cache, checked there, and the cache goes when the model does; a missing file names its URL."""
    import gc
    import tempfile
    import uuid

    import fsspec

    # The caches under the test's folder: the model of the failed lookup below lives on in the error's frames, and
    # its cache would outlive the test.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    fs = fsspec.filesystem("memory")
    url = f"memory://sharded-{uuid.uuid4().hex}/model"
    fs.put(str(exported["folder"]), url.removeprefix("memory://"), recursive=True)
    try:
        family = load_family("pin_ranker", params=SMALL)
        model = sharded_export.load(url, family, sha256=sharded_export.manifest_sha256(url))
        local = sharded_export.load(str(exported["folder"]), load_family("pin_ranker", params=SMALL))
        with torch.no_grad():
            got, want = model(exported["batch"]), local(exported["batch"])
        for label in want:
            assert torch.equal(got[label], want[label]), label
        assert all(f.startswith(url) for f in sharded_export.opened_files(model))
        cache = next(m.cache for m in model.modules() if isinstance(m, sharded_export.ShardedRows))
        assert Path(cache).is_dir() and sorted(p.name for p in Path(cache).iterdir())
        del model
        gc.collect()
        assert not Path(cache).exists()
        pin = exported["manifest"]["tables"]["pin_emb"]["shards"][0]["file"]  # type: ignore[index]
        fs.rm(f"{url.removeprefix('memory://')}/{pin}")
        with pytest.raises(DataError, match=f"{url}/{pin} is missing"):
            sharded_export.load(url, family).pin_emb(torch.tensor([3]))
    finally:
        fs.rm(url.removeprefix("memory://").split("/")[0], recursive=True)


def test_a_pin_rows_plan_gives_each_pin_to_the_shard_of_its_table_row_and_publishes_them_all(tmp_path: Path):
    from tests.unit.test_inference import DS, StandIn, published_ids, write_corpus

    corpus = write_corpus(tmp_path / "root", pins=500)
    out = tmp_path / "out"
    rows = 1009
    plan = inference.make_plan(model_uri="models:/pin_ranker/3", tracking_uri="sqlite:///unused.db",
                               root=str(tmp_path / "root"), ds=DS, out_dir=out, num_shards=3, batch_size=64,
                               table_rows=rows)
    assert plan.sharding == inference.PIN_ROWS
    assert [(s.start, s.stop) for s in plan.shards] == [(0, 337), (337, 674), (674, 1009)]
    rows_plan = inference.make_plan(model_uri="models:/pin_ranker/3", tracking_uri="sqlite:///unused.db",
                                    root=str(tmp_path / "root"), ds=DS, out_dir=out, num_shards=3, batch_size=64)
    assert rows_plan.plan_id != plan.plan_id
    inference.write_plan(plan)

    class ByRow(StandIn):
        def table_rows(self, pins: pa.Table) -> np.ndarray:
            return pins.column("pin_id").to_numpy() % rows

    for shard in range(3):
        record = inference.score_plan_shard(plan, shard, ByRow())
        ids = np.array(inference.pq.read_table(record["path"]).column("pin_id"))
        lo, hi = plan.shards[shard].start, plan.shards[shard].stop
        assert ((ids % rows >= lo) & (ids % rows < hi)).all() and record["rows"] == len(ids)
    manifest = inference.publish_plan(plan)
    assert sorted(published_ids(out)) == sorted(corpus.tolist())
    assert manifest["sharding"] == inference.PIN_ROWS and manifest["rows"] == 500
    assert all(p["rows"] > 0 for p in manifest["parts"])


def test_pin_rows_parts_that_miss_a_pin_are_refused(tmp_path: Path):
    from tests.unit.test_inference import DS, StandIn, write_corpus

    write_corpus(tmp_path / "root", pins=200)
    plan = inference.make_plan(model_uri="models:/pin_ranker/3", tracking_uri="sqlite:///unused.db",
                               root=str(tmp_path / "root"), ds=DS, out_dir=tmp_path / "out", num_shards=2,
                               batch_size=64, table_rows=100)
    inference.write_plan(plan)

    class Lossy(StandIn):  # rows outside every shard's range: its pins are scored by no shard
        def table_rows(self, pins: pa.Table) -> np.ndarray:
            return np.where(pins.column("pin_id").to_numpy() % 7 == 0, 100, 5)

    for shard in range(2):
        inference.score_plan_shard(plan, shard, Lossy())
    with pytest.raises(inference.MissingPartsError, match="a pin is missing or scored twice"):
        inference.publish_plan(plan)
