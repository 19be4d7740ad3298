"""Strategy ``torchrec``: the config choice, the tables' TorchRec form, the sharding plans, the export round trip.

CPU, tiny tables, no subprocess: plans are computed for a world of 2 without a process group, and the
sharded round trip runs in a world of one (an in-process gloo group). The 2-rank kill-and-resume test is in
``tests/integration/test_train_torchrun.py``.
"""

from __future__ import annotations

import datetime as dt

import pytest
import torch
from torch import nn

from core.failures import ConfigError
from training.config import RunConfig

pytest.importorskip("torchrec", reason="torchrec is installed by make install (pip install --no-deps torchrec)")

from training import torchrec_sharding as ts  # noqa: E402
from training.sdk import embedding_configs, load_family  # noqa: E402

pytestmark = pytest.mark.unit

BASE = {
    "root": "/tmp/x", "train_days": ["2026-01-01"], "eval_ds": "2026-01-02", "output_dir": "/tmp/o",
    "checkpoint_dir": "/tmp/c", "mlflow_tracking_uri": "sqlite:////tmp/m.db",
}
SMALL_RANKER = {
    "sequence_length": 4, "first_k": 2, "d_model": 8, "ff_dim": 16, "sparse_dim": 4, "pin_buckets": 53,
    "user_buckets": 47, "creator_buckets": 13, "category_buckets": 11, "mlp_hidden": [8], "embedding_dim": 8,
}


class Tiny(nn.Module):
    def __init__(self, rows: int = 40, dim: int = 4) -> None:
        super().__init__()
        self.ids = nn.Embedding(rows, dim, padding_idx=0)
        self.seq = nn.Embedding(9, dim, padding_idx=0)
        with torch.no_grad():
            self.ids.weight[0].zero_()
            self.seq.weight[0].zero_()
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        return self.out(self.ids(ids) + self.seq(seq).sum(1)).squeeze(-1)


# --- the config choice ------------------------------------------------------------------------------------
def test_strategy_torchrec_and_its_sharding_are_config_choices():
    config = RunConfig.from_dict({**BASE, "strategy": "torchrec", "sharding": "table_wise", "sparse_lr": 0.1})
    assert (config.strategy, config.sharding, config.sparse_lr) == ("torchrec", "table_wise", 0.1)
    assert RunConfig.from_dict(BASE).strategy == "ddp"  # the default stays DDP
    assert RunConfig.from_dict({**BASE, "strategy": "torchrec"}).sharding == "row_wise"
    with pytest.raises(ConfigError, match="'grid' is not one of 'table_wise', 'column_wise', 'row_wise'"):
        RunConfig.from_dict({**BASE, "sharding": "grid"})
    with pytest.raises(ConfigError, match="sparse_lr=0.0 must be positive"):
        RunConfig.from_dict({**BASE, "sparse_lr": 0})
    with pytest.raises(ConfigError, match="embedding_memory_mb=-1.0 must not be negative"):
        RunConfig.from_dict({**BASE, "embedding_memory_mb": -1})


# --- the tables' TorchRec form ---------------------------------------------------------------------------
def test_a_table_lookup_computes_what_the_padded_embedding_computes_forward_and_backward():
    torch.manual_seed(0)
    plain = Tiny()
    converted = Tiny()
    converted.load_state_dict(plain.state_dict())
    ts.to_torchrec(converted, ["ids", "seq"])  # the tables keep their weights
    assert set(converted.state_dict()) == {*ts.lookup_key_map(["ids", "seq"]), "out.weight", "out.bias"}
    ids = torch.tensor([0, 3, 39, 3])
    seq = torch.tensor([[0, 0, 0], [1, 2, 0], [8, 8, 8], [0, 5, 0]])
    a, b = plain(ids, seq), converted(ids, seq)
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    grad_plain = plain.ids.weight.grad
    grad_lookup = converted.ids.ebc.embedding_bags["ids"].weight.grad
    assert torch.equal(grad_plain, grad_lookup)
    assert not grad_lookup[0].any()  # row 0 (absent) never trains, as padding_idx=0
    assert torch.equal(converted.seq(torch.tensor([[0, 0]])), torch.zeros(1, 2, 4))


def test_a_table_without_padding_idx_looks_up_row_0_like_any_other():
    plain = nn.Embedding(5, 3)
    holder = nn.Module()
    holder.table = nn.Embedding(5, 3)
    holder.table.load_state_dict(plain.state_dict())
    ts.to_torchrec(holder, ["table"])
    rows = torch.tensor([[0, 4], [0, 0]])
    assert torch.equal(holder.table(rows), plain(rows))


def test_the_content_familys_tables_keep_every_row():
    family = load_family("pin_content")
    assert {c.name for c in embedding_configs(family)} == {"tokens", "category"}
    model = ts.to_torchrec(family.build_model(), family.sparse_features())
    assert not model.tokens.padded and not model.category.padded


def test_to_torchrec_refuses_what_torchrec_cannot_hold():
    with pytest.raises(ConfigError, match="declares no sparse_features"):
        ts.to_torchrec(Tiny(), [])
    with pytest.raises(ConfigError, match="'out' is a Linear, not an nn.Embedding"):
        ts.to_torchrec(Tiny(), ["out"])
    model = Tiny()
    model.ids = nn.Embedding(40, 4, padding_idx=3)
    with pytest.raises(ConfigError, match="padding_idx=3; TorchRec supports 0 only"):
        ts.to_torchrec(model, ["ids"])


def test_the_rankers_sparse_features_map_onto_embedding_bag_configs():
    family = load_family("pin_ranker", params=SMALL_RANKER)
    configs = {c.name: c for c in embedding_configs(family, "model")}
    assert set(configs) == {"pin_emb", "user_emb", "category_emb", "creator_emb", "user_taste", "seq_category_emb"}
    assert (configs["pin_emb"].num_embeddings, configs["pin_emb"].embedding_dim) == (53, 4)
    assert configs["user_taste"].embedding_dim == 8 and configs["pin_emb"].feature_names == ["pin_emb"]
    assert "seq_category_emb" not in {c.name for c in embedding_configs(family, "ablation")}


# --- plans ------------------------------------------------------------------------------------------------
def plan_of(model: nn.Module, sharding: str, **kwargs) -> dict[str, str]:
    plan = ts.build_plan(model, sharding, world_size=2, device_type="cpu", **kwargs)
    return {
        f"{module}.{table}": p.sharding_type
        for module, module_plan in plan.plan.items()
        for table, p in module_plan.items()
    }


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise"])
def test_every_sharding_type_has_a_plan_on_cpu(sharding):
    model = ts.to_torchrec(Tiny(rows=1000, dim=8), ["ids", "seq"])
    assert plan_of(model, sharding) == {"ids.ebc.ids": sharding, "seq.ebc.seq": sharding}


def test_row_wise_splits_the_rows_over_the_ranks():
    model = ts.to_torchrec(Tiny(rows=1000, dim=8), ["ids"])
    plan = ts.build_plan(model, "row_wise", world_size=2, device_type="cpu")
    shards = plan.plan["ids.ebc"]["ids"].sharding_spec.shards
    assert [(s.shard_offsets, s.shard_sizes) for s in shards] == [([0, 0], [500, 8]), ([500, 0], [500, 8])]


def test_a_table_bigger_than_one_ranks_budget_is_refused_table_wise_and_planned_row_wise():
    rows, dim = 100_000, 16
    budget = int(ts.rows_bytes(rows, dim) * 0.6)  # more than half the table, less than all of it
    model = ts.to_torchrec(Tiny(rows=rows, dim=dim), ["ids"])
    with pytest.raises(ConfigError, match="no table_wise plan .* use row_wise"):
        plan_of(model, "table_wise", memory_per_rank=budget)
    assert plan_of(model, "row_wise", memory_per_rank=budget) == {"ids.ebc.ids": "row_wise"}
    with pytest.raises(ConfigError, match="more than the budget"):
        plan_of(model, "row_wise", memory_per_rank=budget // 2)


# --- sharded round trip in a world of one ---------------------------------------------------------------
@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=dt.timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_shard_trains_only_the_rows_looked_up_and_exports_a_plain_module(world_of_one, sharding):
    torch.manual_seed(0)
    plain = Tiny()
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    dmp = ts.shard(
        ts.to_torchrec(plain, ["ids", "seq"]), sharding=sharding, device=torch.device("cpu"), lr=0.1,
        weight_decay=0.0,
    )
    exported = ts.gather_full(dmp, ["ids", "seq"], Tiny)
    assert exported is not None and all(torch.equal(exported.state_dict()[k], v) for k, v in start.items())
    opt = ts.make_optimizer(dmp, lr=0.01, weight_decay=0.0)
    ids, seq = torch.tensor([3, 5]), torch.tensor([[1, 0], [2, 0]])
    dmp.fused_optimizer.step()
    opt.optimizer.zero_grad()
    dmp(ids, seq).sum().backward()  # the fused optimizer updates the tables here
    opt.optimizer.step()
    trained = ts.gather_full(dmp, ["ids", "seq"], Tiny)
    assert type(trained) is Tiny  # the family's own module: loads without TorchRec or a process group
    moved = (trained.ids.weight != start["ids.weight"]).any(dim=1).nonzero().flatten().tolist()
    assert moved == [3, 5] and not trained.ids.weight[0].any()
    assert not torch.equal(trained.out.weight, start["out.weight"])  # the dense part trained (AdamW)


# --- built sharded: tables on the meta device, rows initialised per global row ------------------------------
def test_row_values_depend_on_the_global_row_alone():
    init = ts.RowInit(seed=5, std=0.05)
    whole = ts.row_values("pins", init, (0, 2000), (0, 8), 8, padded=True)
    assert not whole[0].any() and abs(float(whole[1:].std()) - 0.05) < 0.002 and abs(float(whole.mean())) < 0.002
    assert float(whole.abs().max()) <= 0.05 * 3**0.5 * 2  # four uniforms: bounded
    # Any piece (a row-wise shard, a column-wise one, an uneven split) is the same rows of the whole, bit for bit.
    for rows, cols in [((0, 667), (0, 8)), ((667, 1334), (0, 8)), ((1999, 2000), (3, 8)), ((13, 14), (0, 4))]:
        assert torch.equal(ts.row_values("pins", init, rows, cols, 8, padded=True), whole[slice(*rows), slice(*cols)])
    out = torch.empty(10, 8)
    ts.row_values("pins", init, (100, 110), (0, 8), 8, out=out)
    assert torch.equal(out, whole[100:110])
    assert not torch.equal(ts.row_values("users", init, (1, 50), (0, 8), 8), whole[1:50])  # per table
    assert not torch.equal(ts.row_values("pins", ts.RowInit(seed=6, std=0.05), (1, 50), (0, 8), 8), whole[1:50])


def test_build_meta_puts_only_the_sparse_features_on_the_meta_device():
    family = load_family("pin_ranker", params=SMALL_RANKER)
    names = family.sparse_features()
    torch.manual_seed(3)
    model = ts.build_meta(family.build_model, names)
    after = torch.get_rng_state()
    assert {n for n, p in model.named_parameters() if p.is_meta} == {f"{n}.weight" for n in names}
    torch.manual_seed(3)
    again = ts.build_meta(family.build_model, names)
    assert torch.equal(after, torch.get_rng_state())  # the probe build drew nothing: the same RNG after each
    dense = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    assert dense and all(torch.equal(v, again.state_dict()[k]) for k, v in dense.items())
    assert not model.action_emb.weight.is_meta  # a table not declared sparse is built as the family builds it
    with pytest.raises(ConfigError, match="'out' is a Linear"):
        ts.build_meta(Tiny, ["out"])


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise", "column_wise"])
def test_a_meta_built_table_is_sharded_with_its_row_values_and_exports_whole(world_of_one, sharding):
    torch.manual_seed(0)
    model = ts.to_torchrec(ts.build_meta(Tiny, ["ids", "seq"]), ["ids", "seq"], seed=11, init_std={"ids": 0.5})
    assert model.ids.init == ts.RowInit(seed=11, std=0.5) and model.seq.init == ts.RowInit(seed=11, std=1.0)
    dmp = ts.shard(ts.to_device(model, torch.device("cpu")), sharding=sharding, device=torch.device("cpu"),
                   lr=0.1, weight_decay=0.0)
    exported = ts.gather_full(dmp, ["ids", "seq"], Tiny)
    assert exported is not None
    assert torch.equal(exported.ids.weight, ts.row_values("ids", ts.RowInit(11, 0.5), (0, 40), (0, 4), 4, True))
    assert torch.equal(exported.seq.weight, ts.row_values("seq", ts.RowInit(11, 1.0), (0, 9), (0, 4), 4, True))


# --- resumes: exact or not, and why; a checkpoint of another model ------------------------------------------
def test_a_resume_is_exact_only_on_the_layout_it_was_saved_with():
    from training.checkpoint_manager import resume_verdict

    marker = {"world_size": 2, "sharding": "row_wise"}
    exact, why = resume_verdict(marker, 2, "row_wise", has_position=True)
    assert exact and "same layout as saved (2 rank(s), row_wise)" in why
    exact, why = resume_verdict(marker, 3, "row_wise", has_position=True)
    assert not exact and "saved by 2 rank(s), resumed on 3" in why and "bit for bit" in why
    exact, why = resume_verdict(marker, 2, "table_wise", has_position=True)
    assert not exact and "saved row_wise, resumed table_wise" in why
    exact, why = resume_verdict(marker, 1, "table_wise", has_position=True)
    assert not exact and "resumed on 1" in why and "resumed table_wise" in why
    assert not resume_verdict(marker, 2, "row_wise", has_position=False)[0]
    assert resume_verdict({"world_size": 2}, 2, None, has_position=True)[0]  # ddp: no sharding to compare


def test_a_checkpoint_of_another_model_is_refused_naming_the_table_and_its_sizes(world_of_one, tmp_path):
    from training import checkpoint

    def part(rows: int):
        torch.manual_seed(0)
        model = ts.to_torchrec(ts.build_meta(lambda: Tiny(rows=rows), ["ids", "seq"]), ["ids", "seq"])
        dmp = ts.shard(model, sharding="row_wise", device=torch.device("cpu"), lr=0.1, weight_decay=0.0)
        opt = ts.make_optimizer(dmp, lr=0.01, weight_decay=0.0).optimizer
        for _, child in opt.optimizers:  # the state a step makes, as a trained run's checkpoint has it
            ts.init_optimizer_state(child)
        return dmp, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    path = checkpoint.save(tmp_path / "ckpt", step=1, epoch=0, examples_seen=1, parts={"model": part(40)},
                           is_main=True)
    assert checkpoint.load(path, parts={"model": part(40)})["step"] == 1
    with pytest.raises(ConfigError, match=r"not of this run's model .*model: ids is 40 x 4 in the checkpoint, "
                                          r"50 x 4 in this model"):
        checkpoint.load(path, parts={"model": part(50)})


def test_a_plan_that_cannot_hold_the_tables_fails_on_every_rank_with_the_numbers(world_of_one):
    import torch.distributed as dist

    model = ts.to_torchrec(ts.build_meta(lambda: Tiny(rows=100_000, dim=16), ["ids"]), ["ids"])
    with pytest.raises(ConfigError, match=r"no table_wise plan for the tables \(ids 100000x16\) on 1 cpu rank\(s\)"):
        ts.build_plan(model, "table_wise", world_size=1, device_type="cpu", memory_per_rank=2**20,
                      process_group=dist.group.WORLD)
