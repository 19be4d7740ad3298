"""The ranker, its data stream, the AUC, the run config and the checkpoint round trip (CPU, tiny sizes)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core.contracts import DENSE_FEATURES, EMBEDDING_DIM, LABELS
from core.failures import ConfigError, DataError, ExitCode, NanLossError, exit_code_for
from training.config import RunConfig, fields_help
from training.data import ExampleStream, PinEmbeddings, balance, example_units
from training.evaluate import auc
from training.models.pin_ranker.evaluate import evaluate
from training.models.pin_ranker.ids import hash_ids
from training.models.pin_ranker.inputs import EXAMPLE_COLUMNS, encode_batch
from training.models.pin_ranker.model import ModelConfig, PinRanker, multitask_loss
from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.unit

DAYS = ["2026-01-01", "2026-01-02"]
SMALL = ModelConfig(
    sequence_length=8,
    d_model=16,
    n_heads=2,
    ff_dim=32,
    first_k=2,
    sparse_dim=8,
    pin_buckets=101,
    user_buckets=101,
    creator_buckets=31,
    category_buckets=17,
    mlp_hidden=(32,),
)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_batch(lengths: list[int], steps: int = SMALL.sequence_length, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    mask = torch.arange(steps)[None, :] < torch.tensor(lengths)[:, None]
    return {
        "seq_pin_emb": torch.randn(b, steps, EMBEDDING_DIM, generator=g) * mask[..., None],
        "seq_actions": torch.where(mask, torch.randint(1, 5, (b, steps), generator=g), 0),
        "seq_categories": torch.where(mask, torch.randint(0, 12, (b, steps), generator=g), -1),
        "seq_age_hours": torch.where(mask, torch.rand(b, steps, generator=g) * 100, 0.0),
        "seq_mask": mask,
        "cand_pin_emb": torch.randn(b, EMBEDDING_DIM, generator=g),
        "pin_id": torch.randint(1, 10**6, (b,), generator=g),
        "user_id": torch.randint(1, 10**6, (b,), generator=g),
        "category": torch.randint(0, 12, (b,), generator=g),
        "creator_id": torch.randint(1, 1000, (b,), generator=g),
        "surface": torch.randint(0, 4, (b,), generator=g),
        "dense": torch.rand(b, len(DENSE_FEATURES), generator=g) * 50,
        "labels": (torch.rand(b, len(LABELS), generator=g) < 0.3).float(),
    }


# --- model ---------------------------------------------------------------------------------------


def test_outputs_have_one_logit_per_example_per_label_for_empty_and_full_sequences():
    torch.manual_seed(0)
    model = PinRanker(SMALL)
    batch = make_batch([0, 3, SMALL.sequence_length, 0, 1])
    out = model(batch)
    assert set(out) == set(LABELS)
    for logits in out.values():
        assert logits.shape == (5,)
        assert torch.isfinite(logits).all()


def test_all_padding_sequences_give_finite_outputs_and_gradients():
    torch.manual_seed(0)
    model = PinRanker(SMALL)
    batch = make_batch([0, 0, 0])
    labels = batch.pop("labels")
    loss, _ = multitask_loss(model(batch), labels, {})
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()  # the transformer's inference fast path too
    with torch.no_grad():
        assert all(torch.isfinite(v).all() for v in model(batch).values())


def test_an_empty_sequence_scores_the_same_whatever_its_padding_holds():
    torch.manual_seed(0)
    model = PinRanker(SMALL).eval()
    batch = make_batch([0, 0])
    noisy = dict(batch)
    noisy["seq_age_hours"] = torch.full_like(batch["seq_age_hours"], 1e6)
    with torch.no_grad():
        a, b = model(batch), model(noisy)
    for label in LABELS:
        torch.testing.assert_close(a[label], b[label])


def test_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    model = PinRanker(SMALL)
    batch = make_batch([0, 2, 5, 8] * 8, seed=1)
    labels = batch.pop("labels")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = multitask_loss(model(batch), labels, {"click": 1.0, "repin": 1.0, "hide": 1.0})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_hash_ids_stay_in_the_table_and_reserve_row_zero_for_absent_ids():
    ids = torch.tensor([-1, 0, 1, 2**40, 2**62, 123456789])
    rows = hash_ids(ids, 101)
    assert rows[0] == 0
    assert ((rows[1:] >= 1) & (rows[1:] <= 100)).all()
    assert torch.equal(rows, hash_ids(ids.clone(), 101))


# --- AUC -----------------------------------------------------------------------------------------


def brute_force_auc(scores, labels) -> float:
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize(
    ("scores", "labels", "expected"),
    [
        ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),
        ([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1], 1.0),
        ([0.4, 0.3, 0.2, 0.1], [0, 0, 1, 1], 0.0),
        ([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1], 0.5),  # all tied
        ([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1], 0.875),  # one positive ties one negative
        ([1, 1, 0, 0, 1], [1, 0, 0, 1, 1], 3.5 / 6),  # ties on both sides
    ],
)
def test_auc_hand_cases(scores, labels, expected):
    assert auc(np.array(scores), np.array(labels)) == pytest.approx(expected)
    assert auc(np.array(scores), np.array(labels)) == pytest.approx(brute_force_auc(scores, labels))


def test_auc_matches_pairwise_counting_with_many_ties():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, 200) / 4.0
    labels = rng.random(200) < 0.3
    assert auc(scores, labels) == pytest.approx(brute_force_auc(scores.tolist(), labels.tolist()))


def test_auc_of_a_single_class_is_undefined():
    assert math.isnan(auc(np.array([0.1, 0.2]), np.array([1, 1])))
    assert math.isnan(auc(np.array([0.1, 0.2]), np.array([0, 0])))


# --- data ----------------------------------------------------------------------------------------


@pytest.fixture
def world(tmp_path: Path) -> Path:
    write_tiny_world(tmp_path, DAYS, rows_per_day=150, pins=60, row_group_size=20, max_sequence=12)
    return tmp_path


def stream(root: Path, rank: int = 0, world_size: int = 2, **kwargs) -> ExampleStream:
    pins = PinEmbeddings.from_snapshot(root, DAYS[-1])
    options = {"batch_size": 16, "seed": 5, "columns": EXAMPLE_COLUMNS, **kwargs}
    return ExampleStream(root, DAYS, lambda t: encode_batch(t, pins, 8), rank=rank, world_size=world_size, **options)


def impression_ids(s: ExampleStream) -> list[int]:
    return [int(i) for batch in s for i in batch["impression_id"]]


def test_ranks_read_disjoint_row_groups_that_cover_every_row(world: Path):
    ranks = [stream(world, rank=r) for r in range(2)]
    units = [set(s.rank_units(0)) for s in ranks]
    assert units[0].isdisjoint(units[1])
    assert units[0] | units[1] == set(ranks[0].units)
    seen = [impression_ids(s) for s in ranks]
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(1, 301))  # every row of both days exactly once


def test_every_rank_has_the_same_step_count(world: Path):
    ranks = [stream(world, rank=r, world_size=3) for r in range(3)]
    for epoch in range(3):
        for s in ranks:
            s.set_epoch(epoch)
        counts = ranks[0].batches_per_rank(epoch)
        assert counts == [sum(1 for _ in s) for s in ranks]  # the plan predicts what each rank reads
        assert all(s.steps_per_epoch(epoch) == min(counts) for s in ranks)


def test_drop_last_gives_every_rank_only_full_batches_and_resumes_exactly(world: Path):
    # TorchRec's lookups need one batch size on every rank at every step: each worker's short tail is dropped.
    for workers in (0, 2):
        ranks = [stream(world, rank=r, world_size=2, num_workers=workers, drop_last=True) for r in range(2)]
        for s in ranks:
            s.set_epoch(1)
        sizes = [[len(b["impression_id"]) for b in s.loader()] for s in ranks]
        assert all(size == 16 for rank in sizes for size in rank), sizes
        assert [len(rank) for rank in sizes] == ranks[0].batches_per_rank(1)
        kept = stream(world, rank=0, world_size=2, num_workers=workers)
        kept.set_epoch(1)
        assert sum(ranks[0].batches_per_rank(1)) < sum(kept.batches_per_rank(1))  # the world has short tails
        full = [b["impression_id"].tolist() for b in ranks[0].loader()]
        resumed = stream(world, rank=0, world_size=2, num_workers=workers, drop_last=True)
        resumed.load_position(ranks[0].position(1, 2))
        assert [b["impression_id"].tolist() for b in resumed.loader()] == full[2:], workers


def test_workers_split_a_ranks_share_disjointly(world: Path):
    s = stream(world, num_workers=2)
    plan = s.plan(0)
    assert set(plan[0][0]).isdisjoint(plan[0][1])
    assert set(plan[0][0]) | set(plan[0][1]) | set(plan[1][0]) | set(plan[1][1]) == set(s.units)


def test_order_is_a_function_of_seed_and_epoch(world: Path):
    first, again, other_seed = stream(world), stream(world), stream(world, seed=6)
    assert impression_ids(first) == impression_ids(again)
    assert impression_ids(first) != impression_ids(other_seed)
    again.set_epoch(1)
    assert impression_ids(first) != impression_ids(again)


def test_batches_carry_padded_sequences_and_known_pin_embeddings(world: Path):
    batch = next(iter(stream(world, world_size=1)))
    assert batch["seq_pin_emb"].shape == (16, 8, EMBEDDING_DIM)
    assert batch["seq_mask"].dtype == torch.bool
    assert (batch["seq_actions"][~batch["seq_mask"]] == 0).all()
    assert (batch["seq_actions"][batch["seq_mask"]] >= 1).all()
    assert (batch["cand_pin_emb"].abs().sum(1) > 0).all()  # every candidate is in the snapshot
    assert batch["dense"].shape == (16, len(DENSE_FEATURES))


def test_unknown_pins_get_zero_embeddings():
    pins = PinEmbeddings(np.array([5, 3]), np.ones((2, EMBEDDING_DIM), dtype=np.float32))
    out = pins.lookup(np.array([[3, 4], [5, 99]]))
    assert out.shape == (2, 2, EMBEDDING_DIM)
    assert out[0, 0].sum() == EMBEDDING_DIM and out[0, 1].sum() == 0 and out[1, 1].sum() == 0


def test_a_missing_partition_is_a_data_error(world: Path):
    with pytest.raises(DataError, match="ds=2026-02-01"):
        example_units(world, ["2026-02-01"])


def test_balance_deals_to_the_lightest_bin():
    from training.data import WorkUnit

    units = [WorkUnit("f", i, 0, rows) for i, rows in enumerate([10, 10, 5, 5, 1])]
    bins = balance(units, 2)
    assert [sum(u.rows for u in b) for b in bins] == [16, 15]


def test_evaluate_reports_every_metric_per_head(world: Path):
    torch.manual_seed(0)
    metrics = evaluate(PinRanker(SMALL), world, DAYS[1], sequence_length=8, batch_size=64)
    assert metrics["examples"] == 150
    for key in ("auc", "baseline_auc", "oracle_auc", "logloss", "calibration"):
        assert set(metrics[key]) == set(LABELS), key
    assert metrics["oracle_auc"]["click"] > 0.6  # the truth predicts its own labels
    assert metrics["oracle_coverage"] == 1.0


# --- config, exit codes, checkpoints -------------------------------------------------------------

REQUIRED = {
    "root": "/data",
    "train_days": ["2026-01-01"],
    "eval_ds": "2026-01-02",
    "output_dir": "/out",
    "checkpoint_dir": "/ckpt",
    "mlflow_tracking_uri": "sqlite:////tmp/m.db",
}


def test_config_rejects_an_unknown_key_by_name(tmp_path: Path):
    path = tmp_path / "RUN.json"
    path.write_text(json.dumps({**REQUIRED, "batchsize": 64}))
    with pytest.raises(ConfigError, match="unknown key.*'batchsize' \\(did you mean 'batch_size'\\?\\)"):
        RunConfig.from_json(path)


def test_config_checks_types_and_values():
    with pytest.raises(ConfigError, match="batch_size: expected an integer"):
        RunConfig.from_dict({**REQUIRED, "batch_size": "64"})
    with pytest.raises(ConfigError, match="missing required key.*eval_ds"):
        RunConfig.from_dict({k: v for k, v in REQUIRED.items() if k != "eval_ds"})
    with pytest.raises(ConfigError, match="unknown label 'like'"):
        RunConfig.from_dict({**REQUIRED, "params": {"loss_weights": {"like": 1.0}}}).family_instance()
    with pytest.raises(ConfigError, match="params of model family pin_ranker: unknown key.*'dmodel' \\(did you mean 'd_model'"):
        RunConfig.from_dict({**REQUIRED, "params": {"dmodel": 8}}).family_instance()
    with pytest.raises(ConfigError, match="unknown model family 'pin_rnaker'"):
        RunConfig.from_dict({**REQUIRED, "family": "pin_rnaker"}).family_instance()
    config = RunConfig.from_dict({**REQUIRED, "lr": 1})
    assert config.lr == 1.0 and config.family == "pin_ranker" and config.max_steps == 0
    assert config.family_instance().params.sequence_length == 50


def test_constructing_a_run_config_validates_it_and_names_the_source():
    run = RunConfig.checked("RUN.json of job-1", **REQUIRED, lr=1)
    assert run.lr == 1.0 and isinstance(run.lr, float) and RunConfig.from_dict(run.to_dict()) == run
    with pytest.raises(ConfigError, match=r"^RUN.json of job-1 is invalid: epochs=0 must be positive; lr=-1.0 must be positive \(and finite\)$"):
        RunConfig.checked("RUN.json of job-1", **REQUIRED, lr=-1, epochs=0)
    for bad, says in (({"lr": float("nan")}, "lr=nan must be positive"), ({"lr": float("inf")}, "lr=inf must be positive"),
                      ({"grad_clip": -1}, r"grad_clip=-1.0 must not be negative \(and finite\) \(0 = no clipping\)"),
                      ({"weight_decay": -1}, "weight_decay=-1.0 must not be negative"),
                      ({"train_days": ["2026-01-01", "2026-01-01"]}, "train_days repeats 2026-01-01: give each day once"),
                      ({"train_days": ["2026-01-01", "2026-01-02", "2026-01-03"]},
                       "train_days 2026-01-02, 2026-01-03 not before eval_ds 2026-01-02: a model evaluated on a day it trained on")):
        with pytest.raises(ConfigError, match=says):
            RunConfig.checked("RUN.json of job-1", **{**REQUIRED, **bad})
    with pytest.raises(ConfigError, match=r"RUN.json of job-1: unknown key\(s\) 'batchsize' \(did you mean 'batch_size'"):
        RunConfig.checked("RUN.json of job-1", **REQUIRED, batchsize=8)
    with pytest.raises(ConfigError, match=r"trial 3 is invalid: strategy: 'zero3' is not one of"):
        run.replace("trial 3", strategy="zero3")
    with pytest.raises(ConfigError, match=r"the run.s settings are invalid: batch_size: expected an integer"):
        RunConfig(**REQUIRED, batch_size="64")  # type: ignore[arg-type]


def test_help_documents_every_field():
    import dataclasses

    text = fields_help()
    for f in dataclasses.fields(RunConfig):
        assert f"  {f.name} (" in text
        assert f.metadata["help"] in text


def test_exceptions_map_to_documented_exit_codes():
    assert exit_code_for(NanLossError("nan")) is ExitCode.NAN_LOSS
    assert exit_code_for(DataError("gone")) is ExitCode.DATA
    assert exit_code_for(ConfigError("bad")) is ExitCode.USER
    assert exit_code_for(torch.OutOfMemoryError("CUDA out of memory")) is ExitCode.OOM
    assert exit_code_for(MemoryError()) is ExitCode.OOM
    assert exit_code_for(torch.distributed.DistBackendError("NCCL watchdog")) is ExitCode.INFRA
    assert exit_code_for(RuntimeError("[gloo] Timed out waiting 1800000ms for recv")) is ExitCode.INFRA
    assert exit_code_for(RuntimeError("Connection closed by peer [10.0.0.2]:1234")) is ExitCode.INFRA
    assert exit_code_for(ValueError("shape mismatch")) is ExitCode.USER
    assert exit_code_for(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is ExitCode.USER


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in a single process
def test_checkpoint_round_trip_restores_model_optimizer_and_position(tmp_path: Path):
    from training import checkpoint
    from training.train import lr_lambda

    def build():
        torch.manual_seed(0)
        model = PinRanker(SMALL)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(20, 3, 0.1))
        return model, opt, sched

    model, opt, sched = build()
    batch = make_batch([0, 4, 8])
    labels = batch.pop("labels")
    for _ in range(3):
        loss, _ = multitask_loss(model(batch), labels, {})
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    torch.manual_seed(42)
    checkpoint.save(
        tmp_path,
        step=3,
        epoch=1,
        examples_seen=9,
        parts={"model": (model, opt, sched)},
        data={"epoch": 1, "batches": 2},
        is_main=True,
    )
    after_save = torch.rand(3)
    (tmp_path / "step-00000007").mkdir()  # a save that died before its marker is ignored
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest is not None and latest["step"] == 3

    fresh, fresh_opt, fresh_sched = build()
    torch.manual_seed(7)
    position = checkpoint.load(latest["path"], parts={"model": (fresh, fresh_opt, fresh_sched)})
    assert position == {"step": 3, "epoch": 1, "examples_seen": 9, "data": {"epoch": 1, "batches": 2}}
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where it was saved
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert fresh_sched.get_last_lr() == pytest.approx(sched.get_last_lr())
    state, fresh_state = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    torch.testing.assert_close(state[0]["exp_avg"], fresh_state[0]["exp_avg"])


# --- issue 5: match features, ablation, resume position, HIT@3 ------------------------------------


def test_the_ablation_model_has_no_sequence_tower_and_ignores_the_sequence():
    torch.manual_seed(0)
    import dataclasses

    model = PinRanker(dataclasses.replace(SMALL, use_sequence=False))
    assert not hasattr(model, "encoder") and not hasattr(model, "action_emb")
    batch = make_batch([0, 4, 8])
    batch.pop("labels")
    other = {
        **batch,
        "seq_pin_emb": torch.randn_like(batch["seq_pin_emb"]),
        "seq_mask": torch.ones_like(batch["seq_mask"]),
    }
    a, b = model(batch), model(other)
    for label in LABELS:
        assert torch.equal(a[label], b[label])


def test_match_features_see_the_candidate_category_in_the_sequence():
    torch.manual_seed(0)
    model = PinRanker(SMALL)
    batch = make_batch([4, 4])
    batch["category"] = torch.tensor([3, 99])
    batch["seq_categories"] = torch.where(batch["seq_mask"], 3, -1)
    feats = model.match_features(batch)
    from core.contracts import ACTIONS

    a = len(ACTIONS)
    same_count = feats[:, 3 * a : 4 * a].sum(1)
    assert same_count[0] > 0 and same_count[1] == 0


def test_a_resumed_stream_yields_exactly_the_remaining_batches(world: Path):
    for workers in (0, 2):
        full = stream(world, rank=0, world_size=1, num_workers=workers)
        full.set_epoch(1)
        expected = [b["impression_id"].tolist() for b in full.loader()]
        for skip in (1, 3, len(expected) - 1):
            resumed = stream(world, rank=0, world_size=1, num_workers=workers)
            resumed.load_position(full.position(1, skip))
            assert [b["impression_id"].tolist() for b in resumed.loader()] == expected[skip:], (workers, skip)


def test_a_position_from_another_layout_is_refused(world: Path):
    position = stream(world, world_size=2).position(0, 1)
    with pytest.raises(ValueError, match="world_size: saved 2, now 1"):
        stream(world, world_size=1).load_position(position)


def test_hit_at_3_per_user():
    from training.evaluate import hit_at_k

    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.1, 0.2, 0.3])
    labels = np.array([0, 0, 0, 1, 1, 0, 0])
    users = np.array([1, 1, 1, 1, 2, 2, 2])
    assert hit_at_k(scores, labels, users) == 0.5  # user 1's positive is 4th; user 2's is in its top 3
    assert hit_at_k(-scores, labels, users) == 1.0
    assert math.isnan(hit_at_k(scores, np.zeros(7), users))


def test_preflight_verdict_data_wins_over_infra():
    from training.preflight import verdict

    ok = {"ok": True}
    assert verdict([{"devices": ok}]) == (ExitCode.OK, None)
    infra = {"ok": False, "failure_class": "INFRA"}
    data = {"ok": False, "failure_class": "DATA"}
    assert verdict([{"disk": infra}, {"devices": ok}])[0] == ExitCode.INFRA
    assert verdict([{"disk": infra}, {"data": data}])[0] == ExitCode.DATA


def test_preflight_alone_reports_missing_data_as_data(world: Path, tmp_path: Path):
    from training.preflight import REPORT_FILE
    from training.preflight import main as preflight_main

    config = {
        **REQUIRED,
        "root": str(world),
        "train_days": DAYS,
        "eval_ds": "2026-03-01",
        "output_dir": str(tmp_path / "out"),
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'm.db'}",
        "params": {"ablation": False, **TINY_RUN},
    }
    path = tmp_path / "RUN.json"
    path.write_text(json.dumps(config))
    assert preflight_main(["--config", str(path), "--allreduce-mb", "0.1"]) == ExitCode.DATA
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    checks = report["ranks"][0]["checks"]
    assert report["failure_class"] == "DATA" and not checks["data"]["ok"] and "2026-03-01" in checks["data"]["error"]
    assert checks["allreduce"]["ok"] and checks["disk"]["ok"] and checks["mlflow"]["ok"]


TINY_RUN = {
    "sequence_length": 8,
    "first_k": 2,
    "d_model": 16,
    "ff_dim": 32,
    "pin_buckets": 101,
    "user_buckets": 101,
    "creator_buckets": 31,
    "category_buckets": 17,
    "mlp_hidden": [32],
}
