"""Strategy ``torchrec``: tables built sharded (no rank holds a whole one), checkpoints resharded bit for bit, and
the sharded exports of column-wise and table-wise plans served bit for bit.

Real ``torch.distributed.run`` worlds of 1, 2 and 3 CPU ranks on gloo (``--standalone``: a free port each), each
rank running ``sharded_tables_worker.py``; tiny tables, one thread per rank. The job-level resume at another world
size is in ``test_train_torchrun.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchrec", reason="torchrec is installed by make install (pip install --no-deps torchrec)")

import torch  # noqa: E402

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sharded_tables_worker.py")


def launch(ranks: int, *args: object) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(WORKER),
         *map(str, args)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]


def ranks_of(out: Path) -> list[dict[str, Any]]:
    found = sorted(out.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    return [torch.load(p, weights_only=False) for p in found]


def assemble(pieces: list[tuple[list[int], torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """A whole tensor from the pieces every rank holds, each element covered exactly once."""
    whole = torch.full_like(like, float("nan"))
    covered = torch.zeros(like.shape, dtype=torch.int32)
    for offsets, tensor in pieces:
        index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))
        whole[index] = tensor
        covered[index] += 1
    assert bool((covered == 1).all()), "the ranks' pieces do not cover the tensor exactly once"
    return whole


def test_each_rank_builds_only_its_rows_and_they_are_the_rows_one_rank_builds(tmp_path: Path):
    launch(2, "build", tmp_path / "two", "row_wise")
    launch(2, "build", tmp_path / "tables", "table_wise")  # rank 0 plans, every rank gets the plan
    launch(1, "build", tmp_path / "one", "table_wise")
    two, tables, (one,) = ranks_of(tmp_path / "two"), ranks_of(tmp_path / "tables"), ranks_of(tmp_path / "one")
    assert len(two) == len(tables) == 2
    for key, [(_, whole)] in one["tables"].items():  # table-wise over two ranks: each table whole on one of them
        assert [len(rank["tables"][key]) for rank in tables] in ([1, 0], [0, 1])
        assert torch.equal(assemble([p for rank in tables for p in rank["tables"][key]], whole), whole), key
    for key, [(offsets, whole)] in one["tables"].items():
        assert offsets == [0, 0]
        rows = [sum(t.shape[0] for _, t in rank["tables"][key]) for rank in two]
        assert sum(rows) == whole.shape[0] and max(rows) < whole.shape[0], key  # each rank: its rows only
        assembled = assemble([p for rank in two for p in rank["tables"][key]], whole)
        assert torch.equal(assembled, whole), f"{key}: the 2-rank rows differ from the 1-rank build's"
        if "user_taste" not in key and "pin_emb" in key:
            assert not whole[0].any() and abs(float(whole[1:].std()) - 0.05) < 0.005  # absent row; the ranker's std
    for rank in two:  # the dense part: the same on every rank, and the same as the 1-rank build's
        assert set(rank["dense"]) == set(one["dense"])
        assert all(torch.equal(rank["dense"][k], v) for k, v in one["dense"].items())
    # The guard (a dispatch mode refusing any tensor of a whole table's size) never fired: no rank made one.
    assert all(rank["largest"] < rank["limit"] for rank in two)


def test_a_table_larger_than_a_rank_takes_each_rank_only_its_rows_of_memory(tmp_path: Path):
    rows, dim = 1_500_000, 32  # 183 MiB of float32
    table_bytes = rows * dim * 4
    launch(2, "build", tmp_path / "big", "row_wise", rows, dim)
    for rank in ranks_of(tmp_path / "big"):
        grew = rank["rss_after"] - rank["rss_before"]
        (_, shard), = rank["tables"]["ids.ebc.embedding_bags.ids.weight"]
        assert shard.shape == (rows // 2, dim)
        # Its half of the table and the hashing's bounded temporaries; a whole table would be 183 MiB more.
        assert shard.numel() * 4 < grew < table_bytes * 0.8, f"peak RSS grew {grew / 2**20:.0f} MiB building a {table_bytes / 2**20:.0f} MiB table"
        print(f"peak RSS growth {grew / 2**20:.0f} MiB for a {table_bytes / 2**20:.0f} MiB table over 2 ranks")


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: state}


@pytest.mark.parametrize(("ranks", "sharding"), [(3, "row_wise"), (1, "table_wise")])
def test_a_two_rank_row_wise_checkpoint_reshards_bit_for_bit(tmp_path: Path, ranks: int, sharding: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from training.checkpoint import complete_checkpoints

    launch(2, "save", tmp_path / "ckpt", "row_wise")
    step, path = complete_checkpoints(tmp_path / "ckpt")[-1]
    # Saved in items of 5 rows (checkpoint.SAVE_ITEM_BYTES, set small by the worker): 41 rows, 21 + 20 per rank.
    chunks = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata[
        "model.ids.ebc.embedding_bags.ids.weight"].chunks
    assert sorted(c.offsets[0] for c in chunks) == [0, 5, 10, 15, 20, 21, 26, 31, 36], chunks
    dcp_to_torch_save(str(path), str(tmp_path / "saved.pt"))
    saved = flat(torch.load(tmp_path / "saved.pt", weights_only=False))
    launch(ranks, "load", tmp_path / "ckpt", sharding, tmp_path / "loaded")
    loaded = ranks_of(tmp_path / "loaded")
    assert len(loaded) == ranks
    keys = set(loaded[0]["pieces"])
    # The tables and the fused optimizer's per-row state, as the new world holds them.
    assert {"model.ids.ebc.embedding_bags.ids.weight", "model.tags.ebc.embedding_bags.tags.weight"} <= keys
    assert any("momentum" in k for k in keys)
    for key in keys:
        whole = assemble([p for rank in loaded for p in rank["pieces"][key]], saved[key])
        assert torch.equal(whole, saved[key]), f"{key} differs after resharding onto {ranks} rank(s) {sharding}"
    assert saved["model.ids.ebc.embedding_bags.ids.weight"].abs().sum() > 0
    for rank in loaded:  # the loop continues from the saved step
        assert rank["position"]["step"] == step == 3
        assert rank["scheduler"]["last_epoch"] == 3


# sparse_dim 256: TorchRec's planner cuts a column-wise table into blocks of 128 columns (MIN_CW_DIM), so the
# sparse tables are cut in two and the export has shards of column ranges.
WIDE_RANKER = {
    "sequence_length": 4, "first_k": 2, "d_model": 8, "n_heads": 2, "ff_dim": 16, "sparse_dim": 256,
    "pin_buckets": 53, "user_buckets": 31, "creator_buckets": 13, "category_buckets": 11, "mlp_hidden": [8],
    "cross_layers": 1, "ablation": False,
}


def test_column_and_table_wise_exports_load_the_trained_tables_bit_for_bit_and_score_as_the_gathered_model(
    tmp_path: Path,
):
    """Two ranks train the ranker 2 steps column-wise, then table-wise, and export it sharded: the manifest's shards
    are column ranges (column-wise) or whole tables (table-wise), the loaded tables are the gathered ones bit for
    bit, and the corpus scorer over the export scores what it scores over the gathered model."""
    import json

    from corpus_inference_world import feature_spec

    from core import contracts, storage
    from training.sdk import load_family
    from training.smoke_data import write_tiny_world

    days = ["2026-01-01", "2026-01-02"]
    root = tmp_path / "world"
    write_tiny_world(root, days, rows_per_day=120, pins=60, users=30)
    launch(2, "export", tmp_path / "out", root, days[0], days[1], 2, json.dumps(WIDE_RANKER), "column_wise",
           "table_wise")
    family = load_family("pin_ranker", params=WIDE_RANKER)
    spec = feature_spec(family, root, days)
    pins = storage.read_table(root, contracts.RAW_PINS, days[-1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_exports(tmp_path / "out", family, spec, pins, root, days[-1])
    finally:
        torch.set_num_threads(threads)


def check_exports(out: Path, family: Any, spec: dict[str, Any], pins: Any, root: Path, ds: str) -> None:
    import json

    from training import sharded_export
    from training.inference import Scorer

    for sharding in ("column_wise", "table_wise"):
        folder = out / sharding / "model"
        manifest = json.loads((folder / sharded_export.MANIFEST_FILE).read_text())
        assert manifest["world_size"] == 2 and set(manifest["tables"]) == set(family.sparse_features())
        gathered = family.build_model()
        gathered.load_state_dict(torch.load(out / sharding / "gathered.pt", weights_only=True))
        loaded = sharded_export.load(str(folder), family, sha256=sharded_export.manifest_sha256(str(folder)))
        for name, info in manifest["tables"].items():
            rows, dim = info["rows"], info["dim"]
            cuts = [(s["row_start"], s["row_end"], s["col_start"], s["col_end"]) for s in info["shards"]]
            if sharding == "table_wise":
                assert cuts == [(0, rows, 0, dim)], (name, cuts)
            elif dim == 256:
                assert cuts == [(0, rows, 0, 128), (0, rows, 128, 256)], (name, cuts)
            table = loaded.get_submodule(name)
            assert isinstance(table, sharded_export.ShardedRows)
            with torch.no_grad():
                got = table(torch.arange(rows))
            assert torch.equal(got, gathered.get_submodule(name).weight), f"{sharding} {name}"
        assert any(len(info["shards"]) == 2 for info in manifest["tables"].values()) == (sharding == "column_wise")
        want = Scorer(family, family.serving(gathered).eval(), spec).score(pins, str(root), ds)
        got = Scorer(family, family.serving(loaded).eval(), spec).score(pins, str(root), ds)
        assert got.num_rows == pins.num_rows and got.equals(want), sharding
