"""The training input pipeline (issue 31): input workers sized from the node, each row group decoded once per epoch,
batches handed over packed in items and resumed exactly at any position, the Ray engine's cut of a rank's batches,
the trainer-side end of encode, and the data-bound verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from core.failures import ConfigError
from operators.backends.resources import input_workers
from training import data
from training.data import ExampleStream, ItemBuffers, PinEmbeddings, lockstep, pack_item, unpack_item
from training.models.pin_ranker.inputs import EXAMPLE_COLUMNS, encode_batch, encode_ids, with_sequence_embeddings
from training.ray_input import batch_pieces
from training.runtime import input_verdict, progress_line
from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.unit

DAYS = ["2026-01-01", "2026-01-02", "2026-01-03"]


@pytest.fixture
def world(tmp_path: Path) -> Path:
    write_tiny_world(tmp_path, DAYS, rows_per_day=150, pins=60, row_group_size=20, max_sequence=12)
    return tmp_path


def stream(root: Path, **options: Any) -> ExampleStream:
    pins = PinEmbeddings.from_snapshot(root, DAYS[-1])
    kwargs = {"batch_size": 16, "seed": 5, "columns": EXAMPLE_COLUMNS, **options}
    return ExampleStream(root, DAYS, lambda t: encode_batch(t, pins, 8), **kwargs)


# --- workers and threads from the node ----------------------------------------------------------------------
@pytest.mark.parametrize(("cpus", "procs", "gpus", "expected"), [
    (192, 8, 8, (16, 2)),  # p5.48xlarge: 24 vCPUs a GPU, 2 trainer threads, the rest but one read (at most 16)
    (96, 8, 8, (9, 2)),  # p4d.24xlarge: 12 a GPU
    (48, 4, 4, (9, 2)),  # g5.12xlarge
    (8, 1, 0, (2, 6)),  # m5.2xlarge, CPU training: a quarter reads, the rest computes
    (2, 2, 0, (0, 1)),  # this machine's demo: one CPU a process, no input worker
    (16, 2, 0, (2, 6)),
])
def test_input_workers_and_threads_derive_from_the_node(cpus, procs, gpus, expected):
    assert input_workers(cpus, procs, gpus) == expected


def test_a_given_value_is_kept_and_more_workers_than_cpus_is_a_user_error():
    assert input_workers(8, 1, 0, num_workers=1, num_threads=3) == (1, 3)
    with pytest.raises(ConfigError, match=r"num_workers=4 x 2 training process\(es\) per node is 8 input workers on "
                                          r"a node of 2 CPUs \(this machine\): give at most 1"):
        input_workers(2, 2, 0, num_workers=4, where="this machine")


# --- decoding and resuming ---------------------------------------------------------------------------------
def test_units_are_whole_row_groups_each_decoded_once_per_epoch_over_ranks_and_workers(world: Path, monkeypatch):
    reads: list[tuple[str, int]] = []
    real = data.UnitReader.read

    def counting(self: data.UnitReader, unit: data.WorkUnit, epoch: int, key: int) -> Any:
        reads.append((unit.path, unit.row_group))
        return real(self, unit, epoch, key)

    monkeypatch.setattr(data.UnitReader, "read", counting)
    ranks = [stream(world, rank=r, world_size=2, num_workers=3) for r in range(2)]
    groups = {(str(p), rg) for p in world.rglob("*.parquet") if "examples" in str(p)
              for rg in range(pq.ParquetFile(p).num_row_groups)}
    assert {(u.path, u.row_group) for u in ranks[0].units} == groups
    for unit in ranks[0].units:
        assert unit.start == 0 and unit.stop == pq.ParquetFile(unit.path).metadata.row_group(unit.row_group).num_rows
    for s in ranks:  # what every worker of every rank reads in an epoch, as the workers run it
        for units in s.plan(1)[s.rank]:
            list(s.iter_tables(units, 1))
    assert sorted(reads) == sorted(groups)  # each row group once, by one reader


def test_resume_with_workers_is_exact_at_every_position(world: Path, monkeypatch):
    monkeypatch.setattr(data, "ITEM_ROWS", 48)  # items of 3 batches of 16: restarts fall inside items too
    full = stream(world, num_workers=2)
    assert full.batches_per_item == 3
    full.set_epoch(1)
    expected = [b["impression_id"].tolist() for b in full.loader()]
    assert sorted(i for b in expected for i in b) == list(range(1, 451))
    # Inside the first items of each worker, at their ends, and near the end (each a new pair of workers).
    for skip in (1, 2, 3, 4, 5, 7, len(expected) - 2, len(expected) - 1):
        resumed = stream(world, num_workers=2)
        resumed.load_position(full.position(1, skip))
        assert [b["impression_id"].tolist() for b in resumed.loader()] == expected[skip:], skip


def test_a_checkpoint_taken_with_another_item_size_resumes_in_its_own_order(world: Path, monkeypatch):
    monkeypatch.setattr(data, "ITEM_ROWS", 48)  # the version that took the checkpoint: items of 3 batches of 16
    before = stream(world, num_workers=2)
    before.set_epoch(1)
    expected = [b["impression_id"].tolist() for b in before.loader()]
    monkeypatch.setattr(data, "ITEM_ROWS", 96)  # this version: items of 6 batches, another order with workers
    now = stream(world, num_workers=2)
    now.set_epoch(1)
    assert [b["impression_id"].tolist() for b in now.loader()] != expected
    for skip in (4, 8):
        resumed = stream(world, num_workers=2)
        resumed.load_position(before.position(1, skip))
        assert resumed.batches_per_item == resumed.encode_batches == 3
        assert [b["impression_id"].tolist() for b in resumed.loader()] == expected[skip:], skip
        assert resumed.position(1, skip + 1)["batches_per_item"] == 3  # its next checkpoints keep it


def test_the_loaders_workers_serve_every_epoch_in_its_own_order(world: Path):
    persistent = stream(world, num_workers=2)
    loader = persistent.loader()
    for epoch in (0, 1, 2):
        fresh = stream(world, num_workers=2)
        fresh.set_epoch(epoch)
        persistent.set_epoch(epoch, skip=epoch)
        expected = [b["impression_id"].tolist() for b in fresh.loader()]
        assert [b["impression_id"].tolist() for b in loader] == expected[epoch:]


def test_a_packed_item_comes_back_as_its_batches_views_of_one_buffer():
    rows = {"f": torch.randn(13, 3), "i": torch.arange(13, dtype=torch.int64), "m": torch.rand(13, 7) < 0.5,
            "e": torch.zeros(13, 0)}
    item = pack_item(rows, [5, 5, 3])
    back, origin = unpack_item(item)
    assert [len(b["i"]) for b in back] == [5, 5, 3] and origin == (-1, -1)
    for name, tensor in rows.items():
        joined = torch.cat([b[name] for b in back])
        assert joined.dtype == tensor.dtype and torch.equal(joined, tensor), name
    assert back[2]["f"].untyped_storage().data_ptr() == item[data.PACKED].untyped_storage().data_ptr()
    plain = {"x": torch.ones(2)}
    assert unpack_item(plain) == ([plain], (-1, -1))


def test_a_workers_buffers_are_reused_only_once_the_trainer_is_done_with_their_item():
    released = torch.full((1,), -1, dtype=torch.int64)
    buffers = ItemBuffers(released, 0, count=2, patience_s=0.05)
    first, second = buffers.next(100), buffers.next(100)
    assert [first[2], second[2]] == [(0, 0), (0, 1)] and [first[3], second[3]] == [0, 1]
    # Item 0 is still in use: item 2 gets a buffer of its own after the wait instead of overwriting it.
    third = buffers.next(100)
    assert third[2] == (0, 2) and not third[0].is_shared() and third[1] is third[0] and third[3] == -1
    released[0] = 1  # items 0 and 1 done: item 3 reuses item 1's buffer
    assert buffers.next(80)[0].data_ptr() == second[0].data_ptr()
    released[0] = 2  # item 2 (in a buffer of its own) done too: item 4 reuses item 0's
    assert buffers.next(100)[0].data_ptr() == first[0].data_ptr()
    # A new epoch: the items made before are free (the ones past the last epoch's end were dropped unmarked).
    buffers.next(100)  # item 5, never marked
    buffers.new_epoch()
    reused = buffers.next(100)  # item 6 takes item 4's slot at once, no wait
    assert reused[2] == (0, 6) and reused[0].is_shared()


def test_a_reused_buffer_crosses_once_an_epoch_and_the_trainer_reads_the_next_items_from_its_copy():
    released = torch.full((1,), -1, dtype=torch.int64)
    buffers = ItemBuffers(released, 0, count=2)
    held = data.HeldBuffers()
    rows = [{"x": torch.arange(6, dtype=torch.int64) + 10 * i} for i in range(7)]

    def cross(i: int) -> tuple[Any, list[int]]:
        item = pack_item(rows[i], [4, len(rows[i]["x"]) - 4], buffers)
        released[0] = i
        batches, _ = unpack_item(item, held)
        return item[data.PACKED], torch.cat([b["x"] for b in batches]).tolist()

    sent = [cross(i) for i in range(4)]
    assert [s is not None for s, _ in sent] == [True, True, False, False]  # each slot's buffer crossed once
    assert [x for _, x in sent] == [r["x"].tolist() for r in rows[:4]]
    rows[4] = {"x": torch.arange(9, dtype=torch.int64)}  # a larger item: a new buffer, which crosses
    grown, x = cross(4)
    assert grown is not None and x == list(range(9))
    buffers.new_epoch()  # the last epoch's tail may have been dropped unseen: every buffer crosses again
    assert all(s is not None and x == r["x"].tolist() for (s, x), r in zip([cross(5), cross(6)], rows[5:], strict=True))
    with pytest.raises(RuntimeError, match="without its buffer"):  # never read as another buffer
        unpack_item(pack_item(rows[0], [6], buffers), data.HeldBuffers())
    pinned = ItemBuffers(released, 0, count=2, trainer_holds=False)  # the trainer gets a pinned copy of each
    assert all(pinned.next(10)[1] is not None for _ in range(3))
    with pytest.raises(RuntimeError, match="pin_memory"):  # a slot's buffer that is a copy is never kept
        data.HeldBuffers().buffer(torch.empty(8, dtype=torch.uint8), 0, 1)


def test_an_item_encoded_into_its_buffer_is_not_copied_and_equals_the_plain_encode(world: Path):
    from training.data import read_examples

    pins = PinEmbeddings.from_snapshot(world, DAYS[-1])
    table = read_examples(world, DAYS[1], EXAMPLE_COLUMNS)
    released = torch.full((1,), -1, dtype=torch.int64)
    buffers, held = ItemBuffers(released, 0, count=1), data.HeldBuffers()

    def cross(rows: Any) -> tuple[data.Placement, Any, dict[str, torch.Tensor]]:
        """One item through the worker's one buffer; compared at once (the next item reuses the buffer)."""
        item = buffers.reserve()
        placement = data.Placement(item.buffer)
        packed = pack_item(encode_ids(rows, pins, 8, alloc=placement), [len(rows)], buffers, item, placement)
        released[0] = item.number
        (got,), _ = unpack_item(packed, held)
        want = encode_ids(rows, pins, 8)
        assert list(got) == list(want)
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
        return placement, packed, got

    first, _, _ = cross(table)  # the slot has no buffer yet: made as usual, then copied into a new one
    assert first.end == 0
    second, packed, got = cross(table)  # the slot's buffer: every tensor written where it crosses
    layout = json.loads(packed[data.LAYOUT])["tensors"]
    assert second.end > 0 and all(second.offset_of(t) == start for t, (*_, start, _) in zip(got.values(), layout, strict=True))
    smaller, _, _ = cross(table.slice(0, 40))  # the last item of an epoch: fewer rows, the same buffer
    assert 0 < smaller.end < second.end
    more = pa.concat_tables([read_examples(world, DAYS[0], EXAMPLE_COLUMNS), table])
    grown, _, big = cross(more)  # does not fit: a bigger buffer, everything copied into it
    assert grown.end < sum(t.numel() * t.element_size() for t in big.values())


def test_the_ranker_cuts_each_sequence_to_its_first_steps_and_pads_the_rest(world: Path):
    from training.data import read_examples

    pins = PinEmbeddings.from_snapshot(world, DAYS[-1])
    table = read_examples(world, DAYS[1], EXAMPLE_COLUMNS)
    steps = 8
    got = encode_ids(table, pins, steps)
    lengths = [len(v) for v in table.column("seq_pin_ids").to_pylist()]
    assert min(lengths) < steps < max(lengths)  # both padded and cut rows
    for r, row in enumerate(table.select(["seq_pin_ids", "seq_actions", "seq_categories", "seq_age_hours"]).to_pylist()):
        n, pad = min(lengths[r], steps), steps - min(lengths[r], steps)
        rows = pins.table_rows(np.array(row["seq_pin_ids"][:n], dtype=np.int64)).tolist()
        assert got["seq_pin_rows"][r].tolist() == rows + [len(pins)] * pad  # the zero row after the table's
        assert got["seq_actions"][r].tolist() == [a + 1 for a in row["seq_actions"][:n]] + [0] * pad
        assert got["seq_categories"][r].tolist() == row["seq_categories"][:n] + [-1] * pad
        ages = np.array(row["seq_age_hours"][:n] + [0.0] * pad, dtype=np.float32)
        assert got["seq_age_hours"][r].numpy().tobytes() == ages.tobytes()
        assert got["seq_mask"][r].tolist() == [True] * n + [False] * pad


def test_worker_batches_equal_the_batches_encoded_one_at_a_time(world: Path):
    """Rows are encoded an item at a time (a worker's, or ITEM_ROWS without workers; a worker's into the buffer its
    item crosses in where the encode can): the batches equal those encoded batch by batch, because encode is
    row-wise."""
    pins = PinEmbeddings.from_snapshot(world, DAYS[-1])
    for workers in (0, 2, "2, encode_into"):
        s = stream(world, num_workers=int(str(workers)[0]))
        if workers == "2, encode_into":
            s = stream(world, num_workers=2, encode_into=lambda t, alloc: encode_ids(t, pins, 8, alloc=alloc))
            s.encode = lambda t: encode_ids(t, pins, 8)
        s.set_epoch(2)
        one_at_a_time = [s.encode(t) for units in s.plan(2)[0] for t in s.iter_tables(units, 2)]
        got = sorted((b for b in s.loader()), key=lambda b: int(b["impression_id"][0]))
        want = sorted(one_at_a_time, key=lambda b: int(b["impression_id"][0]))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b), workers


def test_lockstep_gives_every_rank_as_many_full_batches_each_real_row_once_and_zeros_after(world: Path):
    """The batches of an evaluation through a TorchRec-sharded model (its lookups are collectives): every rank as many
    batches as the rank with the most, each of batch_size rows, its own rows first (once, in order), zeros after."""
    streams = [stream(world, shuffle=False, rank=rank, world_size=3) for rank in range(3)]
    counts = streams[0].batches_per_rank(0)
    assert len(set(counts)) > 1 and min(counts) > 0  # uneven, and no rank without data (that one needs a world)
    for s in streams:
        plain = list(s)
        padded = list(lockstep(s))
        assert len(plain) == counts[s.rank] and len(padded) == max(counts)
        assert [rows for _, rows in padded] == [len(b["impression_id"]) for b in plain] + [0] * (max(counts) - len(plain))
        for key in plain[0]:
            assert all(batch[key].shape[0] == 16 for batch, _ in padded), key
            assert torch.equal(torch.cat([batch[key][:rows] for batch, rows in padded]),
                               torch.cat([b[key] for b in plain])), key
            assert not any(batch[key][rows:].any() for batch, rows in padded), key
    # A rank dealt no row group (more ranks than units) runs padding only, in the shapes of the others' batches.
    idle = stream(world, shuffle=False, rank=len(streams[0].units), world_size=len(streams[0].units) + 1)
    steps = max(idle.batches_per_rank(0))
    padding = list(lockstep(idle))
    assert idle.batches_per_rank(0)[idle.rank] == 0 and len(padding) == steps > 0
    assert all(rows == 0 for _, rows in padding)
    for key, tensor in plain[0].items():
        assert all(batch[key].shape == (16, *tensor.shape[1:]) and batch[key].dtype == tensor.dtype
                   and not batch[key].any() for batch, _ in padding), key


# --- the Ray engine's cut, and encode in two halves ----------------------------------------------------------
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_ray_engine_cuts_a_ranks_rows_into_the_local_engines_batches(drop_last):
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows = rng.integers(1, 60, rng.integers(1, 6)).tolist()
        size = int(rng.integers(1, 20))
        total = sum(rows)
        last = total // size if drop_last else -(-total // size)
        skip, limit = int(rng.integers(0, last + 1)), int(rng.integers(0, last + 2))
        pieces = batch_pieces(rows, size, drop_last, skip, limit)
        got: dict[int, list[int]] = {}
        offset = 0
        for unit_rows, unit in zip(rows, pieces, strict=True):
            for batch, lo, hi, batch_rows in unit:
                got.setdefault(batch, []).extend(range(offset + lo, offset + hi))
                assert batch_rows == min(size, total - batch * size)
            offset += unit_rows
        want = {b: list(range(b * size, min(total, (b + 1) * size))) for b in range(skip, min(limit, last))}
        assert got == want, (rows, size, skip, limit)


def test_encode_in_two_halves_equals_the_whole_batch_and_is_row_wise(world: Path):
    from training.data import read_examples

    pins = PinEmbeddings.from_snapshot(world, DAYS[-1])
    table = read_examples(world, DAYS[1], EXAMPLE_COLUMNS)
    whole = encode_batch(table, pins, 8)
    halves = with_sequence_embeddings(encode_ids(table, pins, 8), pins)
    pieces = [with_sequence_embeddings(encode_ids(table.slice(a, 37), pins, 8), pins) for a in range(0, 150, 37)]
    assert list(whole) == list(halves)
    for name in whole:
        assert torch.equal(whole[name], halves[name]), name
        assert torch.equal(whole[name], torch.cat([p[name] for p in pieces])), name


def test_a_lookup_masks_and_treats_unknown_ids_as_zeros():
    pins = PinEmbeddings(np.array([3, 1, 7]), np.arange(6, dtype=np.float32).reshape(3, 2) + 1)
    ids = np.array([[1, 2, 7], [3, 0, -5]])
    mask = np.array([[True, True, False], [True, True, True]])
    out = pins.lookup(ids, mask=mask)
    assert out.tolist() == [[[3, 4], [0, 0], [0, 0]], [[1, 2], [0, 0], [0, 0]]]
    # The trainer's half (finish): the rows found in the workers, gathered where the batch is.
    gathered = pins.gather(torch.from_numpy(pins.table_rows(ids, mask)))
    assert gathered.dtype == torch.float32 and gathered.tolist() == out.tolist()
    far = PinEmbeddings(np.array([10**12, 5]), np.ones((2, 2), dtype=np.float32))  # no direct index: searched
    assert far.lookup(np.array([5, 10**12, 6])).tolist() == [[1, 1], [1, 1], [0, 0]]


def test_the_ranker_encodes_rows_of_the_content_table_and_finish_gathers_their_embeddings(world: Path):
    from training.data import read_examples

    pins = PinEmbeddings.from_snapshot(world, DAYS[-1])
    table = read_examples(world, DAYS[1], EXAMPLE_COLUMNS)
    encoded = encode_ids(table, pins, 8)
    assert "seq_pin_ids" not in encoded and encoded["seq_pin_rows"].shape == (table.num_rows, 8)
    lists = [(v + [0] * 8)[:8] for v in table.column("seq_pin_ids").to_pylist()]
    ids = np.array(lists, dtype=np.int64)
    mask = np.array([[i < len(v) for i in range(8)] for v in table.column("seq_pin_ids").to_pylist()])
    assert mask.any() and not mask.all()
    finished = with_sequence_embeddings(encoded, pins)
    assert np.array_equal(finished["seq_pin_emb"].numpy(), pins.lookup(ids, mask=mask))


# --- the data-bound verdict --------------------------------------------------------------------------------
def test_the_verdict_says_what_to_change():
    calm = input_verdict(1.0, 9.0, 0.12, threshold=0.2, engine="local", num_workers=2, cpus=12)
    assert not calm["data_bound"] and calm["advice"] is None and calm["wait_share"] == 0.1
    bound = input_verdict(4.0, 6.0, 0.45, threshold=0.2, engine="local", num_workers=2, cpus=12)
    assert bound["data_bound"] and bound["advice"] == (
        "data-bound: 45% of step time waiting for input; raise num_workers to 4 (the node has 12 CPUs per training "
        "process) or use input_engine ray")
    full = input_verdict(4.0, 6.0, 0.4, threshold=0.2, engine="local", num_workers=0, cpus=1)
    assert "no CPU to spare" in full["advice"] and "input_engine ray" in full["advice"]
    ray = input_verdict(4.0, 6.0, 0.4, threshold=0.2, engine="ray", num_workers=0, cpus=1)
    assert "Ray cluster more CPU workers" in ray["advice"]


def test_the_progress_line_shows_the_worst_ranks_wait_for_input():
    beats = [{"rank": 0, "step": 5, "total_steps": 10, "phase": "training", "input_wait_share": 0.1,
              "data_bound_share": 0.2},
             {"rank": 1, "step": 5, "total_steps": 10, "phase": "training", "input_wait_share": 0.38,
              "data_bound_share": 0.2}]
    assert "input wait 38% (data-bound)" in progress_line(beats)
    beats[1]["input_wait_share"] = 0.15
    assert progress_line(beats).endswith("input wait 15% (2 rank(s) reporting)")


def test_an_old_job_history_gains_the_new_column(tmp_path: Path):
    import sqlalchemy as sa

    from services import job_history

    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = sa.MetaData()
    sa.Table(job_history.TABLE, old, *[sa.Column(c.name, c.type) for c in job_history.jobs.columns
                                       if c.name != "input_wait_share"])
    old.create_all(sa.create_engine(url))
    eng = job_history.engine(url)
    assert "input_wait_share" in {c["name"] for c in sa.inspect(eng).get_columns(job_history.TABLE)}
