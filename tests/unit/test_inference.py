"""Corpus inference, exact under any re-run: plans keyed by their shards, parts never reused across plans, publish
checks every pin is in exactly one part; shards sized by the work; the scoring task submits one job for what is
missing and defers. A stand-in scorer (a pure function of the pin id) replaces the model here; the real models,
processes and Ray are in ``tests/integration/test_corpus_inference*.py``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core import arrays, config, storage
from core.config import PlatformConfig
from core.contracts import RAW_PINS
from core.failures import DataError, FailureClass, InfraError, UserError
from operators.backends import JobState, JobStatus
from training import inference
from training.inference import (
    MANIFEST,
    PLANS_DIR,
    MissingPartsError,
    Scorer,
    checksum_hex,
    ids_checksum,
    make_plan,
    missing_shards,
    publish_plan,
    score_plan_shard,
    write_plan,
)

pytestmark = pytest.mark.unit
DS = "2026-11-02"
SCHEMA = pa.schema([pa.field("pin_id", pa.int64(), nullable=False), pa.field("score", pa.float32(), nullable=False)])


class StandIn(Scorer):
    """A scorer without a model: each pin's score is a function of its id alone."""

    def __init__(self) -> None:
        super().__init__(family=None, module=None, spec={})
        self.batches: list[int] = []

    @property
    def schema(self) -> pa.Schema:
        return SCHEMA

    def score(self, pins: pa.Table, root: str, ds: str) -> pa.Table:
        self.batches.append(pins.num_rows)
        ids = pins.column("pin_id").to_numpy()
        return pa.table({"pin_id": ids, "score": (ids % 97).astype(np.float32) / 97}, schema=SCHEMA)


def write_corpus(root: Path, pins: int = 630, seed: int = 0) -> np.ndarray:
    """A raw/pins snapshot of ``pins`` pins in two files of several row groups; its pin ids."""
    ids = np.random.default_rng(seed).choice(np.arange(1_000, 10_000_000), size=pins, replace=False).astype(np.int64)
    table = pa.table({"pin_id": ids, "category": (ids % 12).astype(np.int32)})
    with storage.write_partition(root, RAW_PINS, DS) as staging:
        pq.write_table(table.slice(0, pins // 3), storage.join(staging, "part-00000.parquet"), row_group_size=100)
        pq.write_table(table.slice(pins // 3), storage.join(staging, "part-00001.parquet"), row_group_size=100)
    return ids


def plan_of(root: Path, out: Path, shards: int, batch_size: int = 64, model: str = "models:/pin_ranker/3") -> inference.ScoringPlan:
    plan = make_plan(model_uri=model, tracking_uri="sqlite:///unused.db", root=str(root), ds=DS, out_dir=out,
                     num_shards=shards, batch_size=batch_size)
    write_plan(plan)
    return plan


def registry_with_versions(tmp_path: Path, name: str, versions: int) -> str:
    """A SQLite MLflow registry holding ``versions`` versions of model ``name`` (no artifacts: only looked up)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model(name)
    for _ in range(versions):
        client.create_model_version(name, str(tmp_path / "model"))
    return uri


def published_ids(out: Path) -> list[int]:
    return pq.read_table(sorted(out.glob("part-*.parquet"))).column("pin_id").to_pylist()


def test_reruns_with_4_then_3_then_8_shards_each_publish_every_pin_exactly_once(tmp_path: Path):
    """The issue's report: a 3-shard rerun reused the 4-shard parts (473 of 630 pins published), an 8-shard one
    listed 945 rows (315 pins twice). Each plan now scores and publishes its own parts only."""
    corpus = sorted(write_corpus(tmp_path / "root").tolist())
    out = tmp_path / "inference/pin_ranker/3/ds=2026-11-02"
    plan_ids = set()
    for shards in (4, 3, 8):
        plan = plan_of(tmp_path / "root", out, shards)
        plan_ids.add(plan.plan_id)
        # The last run's parts lie in the output folder under the same names: none counts for this plan.
        assert missing_shards(plan) == list(range(shards))
        scorer = StandIn()
        for shard in range(shards):
            assert score_plan_shard(plan, shard, scorer)["skipped"] is False
        manifest = publish_plan(plan)
        ids = published_ids(out)
        assert len(ids) == len(set(ids)) == 630 and sorted(ids) == corpus
        assert [p.name for p in sorted(out.glob("part-*.parquet"))] == [f"part-{i:05d}.parquet" for i in range(shards)]
        assert manifest["num_shards"] == shards and manifest["rows"] == manifest["pins"] == 630
        assert [p["rows"] for p in manifest["parts"]] == [630 * (i + 1) // shards - 630 * i // shards for i in range(shards)]
        assert manifest["ids_checksum"] == checksum_hex(ids_checksum(np.array(corpus)))
        assert json.loads((out / MANIFEST).read_text()) == manifest
        assert not (out / PLANS_DIR).exists()  # staging is gone once published
        assert max(scorer.batches) <= 64  # the plan's batch size
    assert len(plan_ids) == 3


def test_publishing_one_plan_keeps_the_parts_of_another_plan_scoring_into_the_same_output(tmp_path: Path):
    corpus = sorted(write_corpus(tmp_path / "root").tolist())
    out = tmp_path / "out"
    three, four = plan_of(tmp_path / "root", out, 3), plan_of(tmp_path / "root", out, 4)
    scorer = StandIn()
    score_plan_shard(three, 0, scorer)  # the 3-shard run is part-way when the 4-shard one publishes
    for shard in range(4):
        score_plan_shard(four, shard, scorer)
    publish_plan(four)
    assert missing_shards(three) == [1, 2] and (out / PLANS_DIR / three.plan_id / "_PLAN.json").exists()
    for shard in (1, 2):
        score_plan_shard(three, shard, scorer)
    assert publish_plan(three)["num_shards"] == 3 and sorted(published_ids(out)) == corpus
    assert not (out / PLANS_DIR).exists()  # the last plan's publish leaves no staging


def test_a_retry_scores_only_the_missing_shards_and_a_rerun_of_the_same_plan_nothing(tmp_path: Path):
    write_corpus(tmp_path / "root")
    out = tmp_path / "out"
    plan = plan_of(tmp_path / "root", out, 4)
    scorer = StandIn()
    for shard in (0, 2):
        score_plan_shard(plan, shard, scorer)
    assert missing_shards(plan) == [1, 3]
    before = (out / PLANS_DIR / plan.plan_id / "part-00000.parquet").stat().st_mtime_ns
    assert score_plan_shard(plan, 0, scorer)["skipped"] is True  # an existing part is never scored again
    assert (out / PLANS_DIR / plan.plan_id / "part-00000.parquet").stat().st_mtime_ns == before
    for shard in (1, 3):
        score_plan_shard(plan, shard, scorer)
    first = publish_plan(plan)
    # The same plan again (a cleared task, a rerun): every part is found published, nothing scored.
    again = plan_of(tmp_path / "root", out, 4)
    assert again.plan_id == plan.plan_id and missing_shards(again) == []
    assert all(score_plan_shard(again, s, scorer)["skipped"] for s in range(4))
    second = publish_plan(again)
    assert {k: v for k, v in first.items() if k != "created"} == {k: v for k, v in second.items() if k != "created"}


def test_the_plan_id_keys_model_snapshot_shards_and_batch_size(tmp_path: Path):
    write_corpus(tmp_path / "root")
    base = plan_of(tmp_path / "root", tmp_path / "out", 4)
    assert plan_of(tmp_path / "root", tmp_path / "out", 4).plan_id == base.plan_id
    others = [plan_of(tmp_path / "root", tmp_path / "out", 5), plan_of(tmp_path / "root", tmp_path / "out", 4, 128),
              plan_of(tmp_path / "root", tmp_path / "out", 4, model="models:/pin_ranker/4")]
    assert len({base.plan_id, *(p.plan_id for p in others)}) == 4
    write_corpus(tmp_path / "root", seed=1)  # the day's snapshot landed again
    assert plan_of(tmp_path / "root", tmp_path / "out", 4).plan_id != base.plan_id
    # Contiguous row ranges: shard 1 of 4 starts in the first file and ends in the second.
    assert [(s.start, s.stop) for s in base.shards] == [(0, 157), (157, 315), (315, 472), (472, 630)]
    pieces = inference.shard_pieces(base, 1)
    assert [(p.file_index, p.row_group, p.start, p.stop) for p in pieces] == [(0, 1, 57, 100), (0, 2, 0, 10),
                                                                                (1, 0, 0, 100), (1, 1, 0, 5)]


def test_a_second_scorer_of_a_shard_waits_for_the_first_and_takes_its_part(tmp_path: Path, caplog, monkeypatch):
    """Two scorers given the same plan and shard (a job started twice by hand): the second waits while the first
    holds the shard's claim, saying so now and then (a hung first scorer shows), then finds its part instead of
    scoring it again. The first is another process here."""
    import subprocess
    import sys
    import threading
    import time

    write_corpus(tmp_path / "root")
    plan = plan_of(tmp_path / "root", tmp_path / "out", 2)
    lock = storage.join(plan.parts_dir, ".shard-00000.lock")
    first = subprocess.Popen(
        [sys.executable, "-c", f"from core import claims; claims.hold({lock!r}); print('held', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        second, outcome = StandIn(), {}
        monkeypatch.setattr(inference, "CLAIM_WAIT_LOG_S", 0.0)  # a line at every poll (a second apart), not a minute
        caplog.set_level("INFO", logger=inference.log.name)
        waiting = threading.Thread(target=lambda: outcome.update(score_plan_shard(plan, 0, second)))
        waiting.start()
        time.sleep(1.5)
        assert waiting.is_alive() and not second.batches  # waits, scoring nothing
        said = [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]
        assert len(said) >= 2 and "if that scorer hangs, stop it" in said[-1], said
        # What the first scorer does while it holds the claim: score the shard (here, past the claim).
        summary = {"plan_id": plan.plan_id, "shard": 0, "num_shards": 2, "ds": DS, "path": inference.staged_part(plan, 0)}
        written = inference._score_shard(plan, 0, StandIn(), "processes", time.monotonic(), summary)
        first.communicate("\n", timeout=30)  # the first scorer ends: its claim goes with it
        waiting.join(timeout=30)
        assert not waiting.is_alive()
    finally:
        first.kill()
        first.wait()
    assert outcome["skipped"] is True and outcome["path"] == written["path"] and not second.batches
    assert score_plan_shard(plan, 1, StandIn())["skipped"] is False  # a shard nobody holds is scored at once


def test_publish_refuses_a_missing_a_foreign_or_a_wrong_part_and_removes_the_wrong_ones(tmp_path: Path):
    write_corpus(tmp_path / "root")
    out = tmp_path / "out"
    plan = plan_of(tmp_path / "root", out, 3)
    scorer = StandIn()
    score_plan_shard(plan, 0, scorer)
    score_plan_shard(plan, 1, scorer)
    with pytest.raises(MissingPartsError, match=r"1 of 3 part\(s\) missing \(part-00002.parquet\)") as err:
        publish_plan(plan)
    assert err.value.failure_class is FailureClass.DATA
    assert not (out / MANIFEST).exists()
    staged = out / PLANS_DIR / plan.plan_id
    # A part of another shard copied in, and one with a pin swapped for another: both refused and removed.
    (staged / "part-00002.parquet").write_bytes((staged / "part-00000.parquet").read_bytes())
    part1 = pq.read_table(staged / "part-00001.parquet")
    ids = part1.column("pin_id").to_numpy().copy()
    ids[5] = ids[6]  # one pin twice, one missing: the count is right, the checksum is not
    writer = inference.PartWriter(plan, 1, SCHEMA)  # as a scorer with that bug would write it
    writer.add(part1.set_column(0, "pin_id", pa.array(ids)).cast(SCHEMA))
    (staged / "part-00001.parquet").write_bytes(writer.finish()[0])
    with pytest.raises(MissingPartsError) as err:
        publish_plan(plan)
    message = str(err.value)
    assert "part-00002.parquet (made for plan" in message and "shard 0" in message
    assert "part-00001.parquet (pin-id checksum" in message and "part-00001.parquet (made for" not in message
    assert sorted(p.name for p in staged.glob("part-*")) == ["part-00000.parquet"]
    for shard in (1, 2):
        score_plan_shard(plan, shard, scorer)
    assert publish_plan(plan)["rows"] == 630


def test_a_snapshot_landed_again_after_planning_is_not_published_with_the_old_parts(tmp_path: Path):
    write_corpus(tmp_path / "root")
    plan = plan_of(tmp_path / "root", tmp_path / "out", 2)
    for shard in range(2):
        score_plan_shard(plan, shard, StandIn())
    write_corpus(tmp_path / "root", seed=1)
    with pytest.raises(DataError, match="changed since plan"):
        publish_plan(plan)


def test_more_shards_than_pins_gives_empty_parts_that_publish(tmp_path: Path):
    write_corpus(tmp_path / "root", pins=3)
    plan = plan_of(tmp_path / "root", tmp_path / "out", 5)
    for shard in range(5):
        score_plan_shard(plan, shard, StandIn())
    manifest = publish_plan(plan)
    assert [p["rows"] for p in manifest["parts"]] == [0, 1, 0, 1, 1] and manifest["rows"] == 3


def test_an_incremental_snapshot_is_merged_once_and_every_pin_of_the_view_published(tmp_path: Path):
    """raw/pins of DS holds only the pins that changed or appeared since the full snapshot of the day before:
    the plan scores the merged view (``core.storage.read_snapshot``), not the increment alone."""
    root = tmp_path / "root"
    full = pa.table({"pin_id": np.arange(1, 631, dtype=np.int64), "category": np.zeros(630, dtype=np.int32)})
    storage.write_table(root, RAW_PINS, "2026-11-01", full)
    changed = pa.table({"pin_id": np.array([5, 7, 700, 701], dtype=np.int64), "category": np.ones(4, dtype=np.int32)})
    storage.write_table(root, RAW_PINS, DS, changed, metadata={"snapshot": "incremental"})
    out = tmp_path / "out"
    plan = plan_of(root, out, 3)
    assert plan.pins == 632 and plan.snapshot["days"] == ["2026-11-01", DS]
    seen: list[pa.Table] = []

    class Recording(StandIn):
        def score(self, pins: pa.Table, root: str, ds: str) -> pa.Table:
            seen.append(pins)
            return super().score(pins, root, ds)

    for shard in range(3):
        score_plan_shard(plan, shard, Recording())
    merged = pa.concat_tables(seen)
    assert dict(zip(merged.column("pin_id").to_pylist(), merged.column("category").to_pylist(), strict=True))[7] == 1
    manifest = publish_plan(plan)
    assert sorted(published_ids(out)) == [*range(1, 631), 700, 701] and manifest["rows"] == 632
    assert not (out / PLANS_DIR).exists()  # the merged view went with the staging
    assert plan_of(root, out, 3).plan_id == plan.plan_id  # merged again: the same plan
    storage.write_table(root, RAW_PINS, DS, changed.slice(0, 3), metadata={"snapshot": "incremental"})
    assert plan_of(root, out, 3).plan_id != plan.plan_id  # the increment landed again


def test_checksums_do_not_depend_on_order_and_see_a_swapped_pin():
    ids = np.arange(1, 1001, dtype=np.int64)
    assert ids_checksum(ids) == ids_checksum(ids[::-1]) == ids_checksum(ids[500:], ids_checksum(ids[:500]))
    swapped = ids.copy()
    swapped[0] = 2
    assert ids_checksum(swapped) != ids_checksum(ids)
    assert ids_checksum(np.array([], dtype=np.int64)) == 0


def test_shard_lists_and_array_indexes():
    assert arrays.parse_shards("0,3,5-7") == [0, 3, 5, 6, 7]
    for typo in ("1-x", "7-5", "-1", "a"):
        with pytest.raises(ValueError, match="is not a shard number or a range like 5-7"):
            arrays.parse_shards(typo)
    assert arrays.format_shards([7, 0, 5, 3, 6]) == "0,3,5-7"
    assert arrays.shards_of_this_process([3, 5, 9], {}) == [3, 5, 9]
    assert arrays.shards_of_this_process([3, 5, 9], {"AWS_BATCH_JOB_ARRAY_INDEX": "1"}) == [5]
    assert arrays.shards_of_this_process([3, 5, 9], {"JOB_COMPLETION_INDEX": "2"}) == [9]
    assert arrays.shards_of_this_process([3, 5, 9], {"PINFLOW_ARRAY_INDEX": "0", "JOB_COMPLETION_INDEX": "2"}) == [3]
    with pytest.raises(UserError, match="array index 3 is outside"):
        arrays.shards_of_this_process([3, 5, 9], {"PINFLOW_ARRAY_INDEX": "3"})
    with pytest.raises(UserError, match="PINFLOW_ARRAY_INDEX='abc' is not an array index"):
        arrays.shards_of_this_process([3, 5, 9], {"PINFLOW_ARRAY_INDEX": "abc"})


def test_the_entry_point_scores_its_array_index_and_publishes(tmp_path: Path, monkeypatch, capsys):
    write_corpus(tmp_path / "root")
    plan = plan_of(tmp_path / "root", tmp_path / "out", 4)
    location = inference.plan_location(plan)
    loads = []
    monkeypatch.setattr(Scorer, "load", classmethod(lambda cls, uri, tracking: loads.append(uri) or StandIn()))
    monkeypatch.setenv("PINFLOW_ARRAY_INDEX", "1")
    assert inference.main(["--plan", location, "--shards", "0,2"]) == 0  # index 1 of [0, 2]: shard 2
    assert [json.loads(line)["shard"] for line in capsys.readouterr().out.splitlines()] == [2]
    assert missing_shards(plan) == [0, 1, 3] and loads == ["models:/pin_ranker/3"]
    assert inference.main(["--plan", location, "--publish"]) == 65  # DATA: parts missing, named in the log
    monkeypatch.delenv("PINFLOW_ARRAY_INDEX")
    assert inference.main(["--plan", location, "--shards", "0-3"]) == 0
    assert inference.main(["--plan", location, "--shards", "7"]) == 1  # USER: not a shard of the plan
    assert inference.main(["--plan", location, "--publish"]) == 0
    assert len(published_ids(tmp_path / "out")) == 630


def test_the_entry_point_says_what_is_wrong_with_a_plan_in_one_line_and_writes_no_plan_it_cannot_score(
    tmp_path: Path, monkeypatch, capsys
):
    """A hand-run scorer given a damaged plan, a path that never held one, a published plan, a shard outside the
    plan or a model the registry does not have: one line naming it (no traceback), and no _PLAN.json left behind."""
    write_corpus(tmp_path / "root")
    plan = plan_of(tmp_path / "root", tmp_path / "out", 2)
    location = inference.plan_location(plan)

    def failed(argv: list[str], code: int, says: str) -> None:
        capsys.readouterr()
        assert inference.main(argv) == code
        errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(errors) == 1 and " ERROR " in errors[0] and says in errors[0], errors  # one line, no traceback

    saved = Path(location).read_text()
    Path(location).write_text(saved[: len(saved) // 2])  # cut short
    failed(["--plan", location, "--shard", "0"], 1, "is not a plan file")
    Path(location).write_text(json.dumps({"plan_id": plan.plan_id}))  # not a plan
    failed(["--plan", location, "--shard", "0"], 1, "is not a plan file (KeyError")
    edited = json.loads(saved)
    failed_edit = {**edited, "model_uri": "models:/pin_ranker/2"}  # another model scoring this plan's parts
    Path(location).write_text(json.dumps(failed_edit))
    failed(["--plan", location, "--shard", "0"], 1, "does not match its id")
    Path(location).write_text(json.dumps({**edited, "num_shards": 5}))  # shards it does not have
    failed(["--plan", location, "--shard", "4"], 1, "does not match its id")
    Path(location).write_text(saved)
    failed(["--plan", str(tmp_path / "elsewhere" / PLANS_DIR / "abc" / "_PLAN.json"), "--shard", "0"], 1,
           "does not exist; check --plan")
    failed(["--plan", str(tmp_path / "out" / "plan.json"), "--shard", "0"], 1, "a plan is <out-dir>/_plans/")

    monkeypatch.setattr(Scorer, "load", classmethod(lambda cls, uri, tracking: StandIn()))
    assert inference.main(["--plan", location, "--shards", "0-1"]) == 0
    assert inference.main(["--plan", location, "--publish"]) == 0
    failed(["--plan", location, "--shard", "0"], 65, f"scoring plan {plan.plan_id} was published")

    tracking = registry_with_versions(tmp_path, "pin_ranker", 1)
    options = ["--tracking-uri", tracking, "--root", str(tmp_path / "root"), "--ds", DS, "--num-shards", "3",
               "--out-dir", str(tmp_path / "other")]
    failed([*options, "--model-uri", "models:/pin_ranker/1", "--shard", "3"], 1, "shard(s) [3] not in [0, 3)")
    failed([*options, "--model-uri", "models:/pin_ranker/9", "--shard", "0"], 1,
           "model pin_ranker has no version or alias '9' in the registry")
    failed([*options, "--model-uri", "models:/pin_ranker/1", "--shard", "0", "--threads", "0"], 1,
           "--threads 0: need at least one thread")
    failed([*options[:4], "--ds", "2026-13-01", *options[6:], "--model-uri", "models:/pin_ranker/1", "--shard", "0"], 1,
           "--ds '2026-13-01' is not a day")
    failed(["--plan", str(tmp_path / "out"), "--shard", "0"], 1, "cannot read scoring plan")
    assert not list((tmp_path / "other").rglob("_PLAN.json"))


def test_a_plan_made_by_hand_scores_the_version_an_alias_names_when_it_is_made(tmp_path: Path, monkeypatch):
    """An alias (or latest) given to the scoring CLI is the version it names when the plan is made: moving the alias
    between two scorers of the plan no longer mixes two models' scores in one published output."""
    from mlflow import MlflowClient

    tracking = registry_with_versions(tmp_path, "pin_ranker", 2)
    client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    client.set_registered_model_alias("pin_ranker", "champion", "1")
    assert inference.pinned_model("models:/pin_ranker@champion", tracking) == ("models:/pin_ranker/1", 0)
    assert inference.pinned_model("models:/pin_ranker/latest", tracking) == ("models:/pin_ranker/2", 0)
    assert inference.pinned_model("runs:/abc/model", tracking) == ("runs:/abc/model", 0)
    with pytest.raises(UserError, match="no MLflow database at"):
        inference.pinned_model("models:/pin_ranker/1", f"sqlite:///{tmp_path / 'typo.db'}")
    assert not (tmp_path / "typo.db").exists()

    write_corpus(tmp_path / "root")
    loads: list[str] = []
    monkeypatch.setattr(Scorer, "load", classmethod(lambda cls, uri, tracking: loads.append(uri) or StandIn()))
    options = ["--model-uri", "models:/pin_ranker@champion", "--tracking-uri", tracking, "--root",
               str(tmp_path / "root"), "--ds", DS, "--num-shards", "2", "--out-dir", str(tmp_path / "out")]
    assert inference.main([*options, "--shard", "0"]) == 0
    client.set_registered_model_alias("pin_ranker", "champion", "2")  # moved while the plan is half scored
    assert inference.main([*options, "--shard", "1"]) == 0  # another plan: version 2's
    assert loads == ["models:/pin_ranker/1", "models:/pin_ranker/2"]
    plans = {json.loads(p.read_text())["model_uri"] for p in (tmp_path / "out" / PLANS_DIR).glob("*/_PLAN.json")}
    assert plans == {"models:/pin_ranker/1", "models:/pin_ranker/2"}
    assert inference.main([*options[:2], *options[4:], "--publish"]) == 1  # an alias without its registry: refused
    client.set_model_version_tag("pin_ranker", "2", inference.SHARDED_ROWS_TAG, "1000")  # exported sharded
    assert inference.pinned_model("models:/pin_ranker/2", tracking) == ("models:/pin_ranker/2", 1000)


# --- sizing ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pins", "rate", "parallelism", "expected"), [
    (1_000_000, 10_000, 1, 1),      # 100 s of work, 600 s a shard: one shard
    (1_000_000, 10_000, 2, 2),      # ... but two processes can run at once
    (100_000_000, 10_000, 2, 17),   # 10,000 s of work: shards of 600 s
    (30_000, 10_000, 8, 3),         # shards of at least 10,000 pins, even with 8 at once
    (3, 10_000, 8, 1),
    (10**10, 1, 1, 1000),           # capped
])
def test_shards_are_sized_by_the_work(pins, rate, parallelism, expected):
    from operators.inference import size_shards

    shards, why = size_shards(pins, pins_per_s=rate, target_seconds=600, max_shards=1000, min_pins_per_shard=10_000,
                              parallelism=parallelism)
    assert shards == expected and f"{pins} pins" in why


def test_the_plan_uses_the_throughput_earlier_runs_measured(tmp_path: Path, monkeypatch):
    from core import model_versions
    from operators import inference as stage
    from services import model_registry as registry

    write_corpus(tmp_path / "storage", pins=630)
    cfg = PlatformConfig(storage_root=str(tmp_path / "storage"),
                         inference={"min_pins_per_shard": 100, "target_shard_seconds": 1, "parallelism": 1})
    monkeypatch.setattr(config, "load", lambda: cfg)
    monkeypatch.setattr(registry, "client", lambda mlflow: None)
    monkeypatch.setattr(model_versions, "model_version", lambda client, name, version: SimpleNamespace(version=3))
    first = stage.plan_inference("pin_ranker", "champion", None)
    assert first["shards"] == 1 and "assumed" in first["sizing"]  # 630 pins at the assumed 2,000/s: one shard
    for rate in (100.0, 90.0, 5000.0):
        stage.record_throughput(cfg.storage_root, "pin_ranker", {
            "throughput": {"pins_per_s_per_process": rate, "parts": 1}, "model_uri": "models:/pin_ranker/2",
            "ds": DS, "plan_id": "x", "created": "now"})
    planned = stage.plan_inference("pin_ranker", "champion", None)
    assert planned["shards"] == 7 and "measured" in planned["sizing"]  # median 100 pins/s, 1 s a shard
    assert stage.plan_inference("pin_ranker", "champion", None, 3)["shards"] == 3  # the form's value wins
    assert planned["model_uri"] == "models:/pin_ranker/3" and planned["out_dir"].endswith("pin_ranker/3/ds=2026-11-02")


def test_a_sharded_version_is_planned_by_its_pin_table_rows_for_either_engine(tmp_path: Path, monkeypatch):
    from core import model_versions
    from operators import inference as stage
    from services import model_registry as registry

    write_corpus(tmp_path / "storage", pins=630)
    monkeypatch.setattr(config, "load", lambda: PlatformConfig(storage_root=str(tmp_path / "storage")))
    monkeypatch.setattr(registry, "client", lambda mlflow: None)
    monkeypatch.setattr(model_versions, "model_version", lambda client, name, version: SimpleNamespace(
        version=3, tags={inference.SHARDED_ROWS_TAG: "1009"}))
    for engine in ("processes", "ray"):
        planned = stage.plan_inference("pin_ranker", "3", None, 2, engine=engine)
        plan = inference.read_plan(planned["plan_file"])
        assert (planned["engine"], planned["table_rows"], plan.sharding) == (engine, 1009, inference.PIN_ROWS)
        assert [(s.start, s.stop) for s in plan.shards] == [(0, 505), (505, 1009)]


# --- the scoring task ------------------------------------------------------------------------------------------


class Store:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)


class FakeBackend:
    name = "local"

    def __init__(self) -> None:
        self.submitted: list[Any] = []
        self.states: dict[str, JobStatus] = {}

    def dry_run(self, spec: Any) -> dict[str, Any]:
        return {}

    def find(self, name: str) -> str | None:
        return None

    def submit(self, spec: Any) -> str:
        self.submitted.append(spec)
        self.states[spec.name] = JobStatus(spec.name, JobState.RUNNING)
        return str(spec.name)

    def status(self, job_id: str) -> JobStatus:
        return self.states[job_id]

    def logs(self, job_id: str, tail: int = 50) -> str:
        return "(log)"

    def cancel(self, job_id: str) -> None:
        self.states[job_id] = JobStatus(job_id, JobState.FAILED, FailureClass.INFRA, "cancelled")

    def console_url(self, job_id: str) -> str:
        return f"file:///jobs/{job_id}"


def test_the_scoring_task_submits_one_job_for_the_missing_shards_defers_and_a_retry_scores_what_is_left(
    tmp_path: Path, monkeypatch
):
    from airflow.sdk.exceptions import TaskDeferred

    import operators.backends
    from operators.inference import CorpusScoringOperator, publish

    write_corpus(tmp_path / "storage")
    cfg = PlatformConfig(storage_root=str(tmp_path / "storage"), inference={"parallelism": 2})
    monkeypatch.setattr(config, "load", lambda: cfg)
    backend = FakeBackend()
    monkeypatch.setattr(operators.backends, "get_backend", lambda name, cfg=None, home=None: backend)
    out = tmp_path / "storage/inference/pin_ranker/3/ds=2026-11-02"
    plan = plan_of(tmp_path / "storage", out, 4)
    summary = {"plan_file": inference.plan_location(plan), "plan_id": plan.plan_id, "model_uri": plan.model_uri,
               "model_name": "pin_ranker", "ds": DS, "out_dir": str(out), "shards": 4, "batch_size": 64, "threads": 1,
               "backend": "local", "engine": "processes"}
    store = Store()

    def context(try_number: int) -> dict[str, Any]:
        return {"ti": SimpleNamespace(dag_id="pin_corpus_inference", run_id="manual__1", try_number=try_number),
                "task_state_store": store}

    score_plan_shard(plan, 2, StandIn())  # scored by an earlier run of the same plan
    task = CorpusScoringOperator(task_id="score_shards", plan=summary)
    with pytest.raises(TaskDeferred) as deferred:
        task.execute(context(1))
    job = backend.submitted[0]
    assert job.array_size == 3 and job.array_parallelism == 2
    assert job.command == ["-m", "training.inference", "--plan", summary["plan_file"], "--shards", "0-1,3",
                           "--threads", "1"]
    assert store.data["scoring_job"] == {"backend": "local", "job_id": job.name, "name": job.name, "output_dir": None,
                                         "shards": [0, 1, 3]}
    trigger = deferred.value.trigger
    assert trigger.serialize()[1]["job_id"] == job.name and deferred.value.method_name == "execute_complete"
    # While the job runs, a restarted try reattaches instead of submitting a second job.
    with pytest.raises(TaskDeferred):
        task.execute(context(1))
    assert len(backend.submitted) == 1

    # Shard 3's process was killed; 0 and 1 finished: the job failed as INFRA, the task raises it for a retry.
    score_plan_shard(plan, 0, StandIn())
    score_plan_shard(plan, 1, StandIn())
    backend.states[job.name] = JobStatus(job.name, JobState.FAILED, FailureClass.INFRA,
                                         "child-2 was killed by SIGKILL")
    with pytest.raises(InfraError, match="SIGKILL"):
        task.execute_complete(context(1), event={"state": "FAILED", "backend": "local", "job_id": job.name},
                              job=deferred.value.kwargs["job"])
    assert "scoring_job" not in store.data
    # The retry scores shard 3 alone.
    with pytest.raises(TaskDeferred):
        task.execute(context(2))
    retry = backend.submitted[1]
    assert retry.name != job.name and retry.array_size == 1 and retry.command[-3:] == ["3", "--threads", "1"]
    score_plan_shard(plan, 3, StandIn())
    backend.states[retry.name] = JobStatus(retry.name, JobState.SUCCEEDED)
    done = task.execute_complete(context(2), event={"state": "SUCCEEDED"}, job=store.data["scoring_job"])
    assert done["scored_shards"] == 1 and done["job_id"] == retry.name
    published = publish(summary)
    assert published["rows"] == 630 and published["manifest"].endswith("_MANIFEST.json")
    # Nothing missing any more: a cleared task submits nothing (the plan file is gone: made again).
    assert task.execute(context(3))["scored_shards"] == 0 and len(backend.submitted) == 2


def test_a_job_that_succeeds_without_writing_its_parts_is_retried(tmp_path: Path, monkeypatch):
    import operators.backends
    from operators.inference import CorpusScoringOperator

    write_corpus(tmp_path / "storage")
    monkeypatch.setattr(config, "load", lambda: PlatformConfig(storage_root=str(tmp_path / "storage")))
    backend = FakeBackend()
    monkeypatch.setattr(operators.backends, "get_backend", lambda name, cfg=None, home=None: backend)
    plan = plan_of(tmp_path / "storage", tmp_path / "out", 2)
    task = CorpusScoringOperator(task_id="score_shards", plan={"plan_file": inference.plan_location(plan)},
                                 deferrable=False, poll_seconds=0.01)
    backend.submit = lambda spec: (backend.states.__setitem__(spec.name, JobStatus(spec.name, JobState.SUCCEEDED))
                                   or spec.name)  # type: ignore[method-assign]
    context = {"ti": SimpleNamespace(dag_id="d", run_id="r", try_number=1), "task_state_store": Store()}
    with pytest.raises(InfraError, match=r"shard\(s\) \[0, 1\] .* have no part"):
        task.execute(context)
