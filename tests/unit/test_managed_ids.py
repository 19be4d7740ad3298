"""Managed id tables (pin_ranker ``id_tables: managed``): the mapping, its save/load, its export and serving."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from core.failures import ConfigError
from training.models.pin_ranker.ids import MANAGED_FEATURES, hash_ids, managed_layout, managed_rows, select_managed
from training.models.pin_ranker.inputs import id_counts
from training.models.pin_ranker.model import ModelConfig, PinRanker
from training.models.pin_ranker.params import RankerParams
from training.sdk import load_family
from training.smoke_data import write_tiny_world
from training.train import LOCAL_MODEL_FILE, export_serving

pytestmark = pytest.mark.unit

DAYS = ["2026-01-01", "2026-01-02", "2026-01-03"]
SMALL = {
    "sequence_length": 8, "d_model": 16, "n_heads": 2, "ff_dim": 32, "first_k": 2, "sparse_dim": 8,
    "pin_buckets": 21, "user_buckets": 11, "creator_buckets": 11, "category_buckets": 17, "mlp_hidden": [32],
    "ablation": False,
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def buffer_of(ids: list[int], own: int) -> torch.Tensor:
    out = torch.full((own + 1,), torch.iinfo(torch.int64).max, dtype=torch.int64)
    out[: len(ids)] = torch.tensor(sorted(ids))
    return out


def test_the_most_frequent_ids_are_chosen_ties_by_id_and_never_an_absent_id():
    ids = np.array([-1, 5, 7, 9, 11, 13])
    counts = np.array([100, 3, 9, 3, 1, 9])
    assert select_managed(ids, counts, 3).tolist() == [5, 7, 13]  # 7 and 13 (9 each), then 5 before 9 (3 each)
    assert select_managed(ids, counts, 10).tolist() == [5, 7, 9, 11, 13]
    assert select_managed(ids[::-1].copy(), counts[::-1].copy(), 3).tolist() == [5, 7, 13]  # order-free


def test_managed_ids_get_distinct_own_rows_others_the_hashed_tail_absent_row_zero():
    own, tail = managed_layout(21, 0.1)
    assert (own, tail) == (18, 2)
    managed = buffer_of([3, 10**12, 77, 5_000_000_000], own)
    rows = managed_rows(torch.tensor([77, 3, 5_000_000_000, 10**12]), managed, tail)
    assert sorted(rows.tolist()) == [1, 2, 3, 4]  # each its own row, 1 + its rank among the managed ids
    unseen = torch.arange(1000, 1500)
    tail_rows = managed_rows(unseen, managed, tail)
    assert tail_rows.min() >= own + 1 and tail_rows.max() <= own + tail  # the shared rows, all of them used
    assert set(tail_rows.tolist()) == {own + 1, own + 2}
    assert torch.equal(tail_rows, own + hash_ids(unseen, tail + 1))  # the defined fallback: the hash, deterministic
    assert managed_rows(torch.tensor([-1, -7]), managed, tail).tolist() == [0, 0]
    assert managed_rows(torch.tensor([torch.iinfo(torch.int64).max]), managed, tail).item() > own  # never a slot
    empty = buffer_of([], own)
    assert managed_rows(torch.tensor([3]), empty, tail).item() > own


def test_bad_id_tables_or_tail_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"id_tables='lfu' must be one of hashed, managed"):
        RankerParams(id_tables="lfu")
    with pytest.raises(ConfigError, match=r"id_tables"):
        load_family("pin_ranker", params={"id_tables": "lru"})
    with pytest.raises(ConfigError, match=r"managed_tail=1.5"):
        RankerParams(id_tables="managed", managed_tail=1.5)
    with pytest.raises(ConfigError, match=r"pin_buckets=2 must be at least 3"):
        RankerParams(id_tables="managed", pin_buckets=2)


def test_the_hashed_default_is_the_model_it_was():
    params = RankerParams()
    assert params.id_tables == "hashed"
    config = params.model_config()
    assert "id_tables" not in config.to_dict() and "managed_tail" not in config.to_dict()  # the spec as before
    model = PinRanker(ModelConfig(pin_buckets=101))
    assert not any(name.startswith("managed_") for name, _ in model.named_buffers())
    ids = torch.tensor([-1, 0, 5, 10**9])
    assert torch.equal(model.rows("pin_id", ids), hash_ids(ids, 101))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("world")
    write_tiny_world(root, DAYS, rows_per_day=150, pins=60, users=30, row_group_size=50, max_sequence=12)
    return root


def test_a_managed_model_trains_saves_loads_exports_and_serves_the_same(world: Path, tmp_path: Path):
    family = load_family("pin_ranker", params={**SMALL, "id_tables": "managed"})
    train, eval_ds = DAYS[:-1], DAYS[-1]
    context = family.prepare(str(world), train, eval_ds)
    model = family.build_model()
    assert isinstance(model, PinRanker)

    # The training days' most frequent pins each own a row; every other pin shares one of the tail rows.
    ids, counts = id_counts(str(world), train)["pin_id"]
    own, tail = managed_layout(21, 0.1)
    chosen = family.managed_ids["pin_id"]
    assert len(chosen) == own and set(chosen.tolist()) <= set(ids.tolist())
    assert counts[np.isin(ids, chosen)].min() >= counts[~np.isin(ids, chosen)].max()
    rows = model.rows("pin_id", torch.from_numpy(chosen))
    assert sorted(rows.tolist()) == list(range(1, own + 1))
    others = model.rows("pin_id", torch.from_numpy(ids[~np.isin(ids, chosen)]))
    assert ((others > own) & (others <= own + tail)).all()
    # Deterministic: another process (rank) choosing from the same days picks the same ids.
    again = load_family("pin_ranker", params={**SMALL, "id_tables": "managed"})
    again.prepare(str(world), train, eval_ds)
    for feature in MANAGED_FEATURES:
        assert np.array_equal(again.managed_ids[feature], family.managed_ids[feature])

    # A few steps of training on the examples.
    from training.data import ExampleStream

    stream = ExampleStream(str(world), train, lambda t: family.encode(t, context), batch_size=32, dataset=family.dataset,
                           columns=family.columns, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in stream:
        batch = family.finish(batch, context)
        loss, _ = family.loss(model(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    # Save / load: the mapping is in the state dict; a model built without prepare (a scorer, a resume) gets it.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert "managed_pin_id" in model.state_dict()
    fresh = load_family("pin_ranker", params={**SMALL, "id_tables": "managed"}).build_model()
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    fresh.eval()
    example = family.example_inputs()
    example["pin_id"] = np.concatenate([chosen[:1], [123_456_789]]).astype(np.int64)  # a managed and an unseen pin
    inputs = tuple(torch.from_numpy(example[name]) for name in family.serving_inputs)
    serving = family.serving(model).eval()
    with torch.no_grad():
        expected = serving(*inputs)
        for name, value in family.serving(fresh).eval()(*inputs).items():
            assert torch.equal(value, expected[name])

    # The exported program gives the trained module's outputs: the local export (training.train.export_serving, the
    # example's batch size) and the one MLflow registers (pt2: the batch dimension Dim.AUTO, as mlflow.pytorch
    # exports it), which corpus inference runs.
    path = export_serving(family, model, str(tmp_path))
    assert path.endswith(LOCAL_MODEL_FILE)
    local = torch.export.load(path).module()
    batch = [{0: torch.export.Dim.AUTO} for _ in family.serving_inputs]
    program = torch.export.export(family.serving(model).eval(), inputs, dynamic_shapes=batch).module()
    with torch.no_grad():
        for module in (local, program):
            for name, value in module(*inputs).items():
                torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    restored = family.model_from_serving(program)  # the promotion gate's way back to a trainable model
    assert torch.equal(restored.managed_pin_id, model.managed_pin_id)

    # Corpus inference with the exported program scores every pin of the snapshot as the eager module does.
    import pyarrow.parquet as pq

    from core.contracts import RAW_PINS
    from core.storage import data_files

    pins = pq.read_table(data_files(str(world), RAW_PINS, eval_ds)[0])
    spec = {  # as training.train registers it, and training.inference.Scorer reads it
        "params": dataclasses.asdict(family.params), "serving_inputs": list(family.serving_inputs),
        **family.feature_spec(str(world), train, eval_ds, context),
    }
    assert spec["model_config"]["id_tables"] == "managed"
    scorer = load_family("pin_ranker", params=spec["params"])  # the scorer's family: no prepare, no training data
    scored = scorer.score_corpus(program, pins, spec, str(world), eval_ds)
    eager = family.score_corpus(serving, pins, spec, str(world), eval_ds)
    assert scored.num_rows == pins.num_rows
    for column in ("p_click", "p_repin", "p_hide"):
        np.testing.assert_allclose(scored.column(column).to_numpy(), eager.column(column).to_numpy(), rtol=1e-5,
                                   atol=1e-6)


def test_a_managed_model_shards_under_torchrec_and_gathers_with_its_mapping(world: Path):
    """Strategy torchrec: the mapping is a dense (replicated) buffer beside the sharded tables; the gathered model,
    what is exported, holds it and computes what the sharded one computes."""
    import datetime as dt

    import torch.distributed as dist

    from training import torchrec_sharding as ts

    family = load_family("pin_ranker", params={**SMALL, "id_tables": "managed"})
    context = family.prepare(str(world), DAYS[:-1], DAYS[-1])
    names = family.sparse_features()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=dt.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = ts.to_torchrec(ts.build_meta(family.build_model, names), names, seed=0,
                               init_std=family.sparse_init_std())
        dmp = ts.shard(ts.to_device(model, torch.device("cpu")), sharding="row_wise", device=torch.device("cpu"),
                       lr=0.1, weight_decay=0.0)
        from training.data import ExampleStream

        stream = ExampleStream(str(world), DAYS[:-1], lambda t: family.encode(t, context), batch_size=32,
                               dataset=family.dataset, columns=family.columns, seed=1, drop_last=True)
        batch = family.finish(next(iter(stream)), context)
        with torch.no_grad():
            sharded = dmp(batch)
        # Gathered into a model built without the training days (all slots empty): the mapping comes from the state.
        unprepared = load_family("pin_ranker", params={**SMALL, "id_tables": "managed"})
        full = ts.gather_full(dmp, names, unprepared.build_model)
    finally:
        dist.destroy_process_group()
    assert full is not None
    for feature in MANAGED_FEATURES:
        own = getattr(full, f"managed_{feature}")
        assert torch.equal(own[: len(family.managed_ids[feature])], torch.from_numpy(family.managed_ids[feature]))
    with torch.no_grad():
        for label, value in full.eval()(batch).items():
            torch.testing.assert_close(value, sharded[label], rtol=1e-5, atol=1e-6)
