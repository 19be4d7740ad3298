"""A tiny corpus and registered models of both families, for the corpus-inference tests (no training: the
models are freshly initialised, exported and registered the way ``training.train`` does it, through
``training.tracking.Tracker``, in a SQLite MLflow under the test's folder)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

DAYS = ["2026-11-01", "2026-11-02"]
PINS = 630  # the corpus of the report
# Small models: scoring a few hundred pins takes milliseconds; export and registration a second or two.
PARAMS: dict[str, dict[str, Any]] = {
    "pin_content": {"width": 8, "embedding_dim": 8, "max_tokens": 8, "category_buckets": 31},
    "pin_ranker": {"sequence_length": 4, "d_model": 8, "n_heads": 2, "ff_dim": 16, "first_k": 2, "sparse_dim": 4,
                   "pin_buckets": 101, "user_buckets": 101, "creator_buckets": 31, "category_buckets": 31,
                   "mlp_hidden": [8], "cross_layers": 1, "ablation": False},
}


def write_world(root: Path, *, pins: int = PINS, row_group_size: int = 100) -> None:
    """Examples and pin snapshots of ``DAYS`` (the last day's snapshot is the corpus), several row groups."""
    import pyarrow.parquet as pq

    from core import contracts, storage
    from training.smoke_data import write_tiny_world

    write_tiny_world(root, DAYS, rows_per_day=120, pins=pins)
    # Rewrite the corpus with several row groups, so that shards start and stop inside and across them.
    table = storage.read_table(root, contracts.RAW_PINS, DAYS[-1])
    with storage.write_partition(root, contracts.RAW_PINS, DAYS[-1]) as staging:
        pq.write_table(table.slice(0, pins // 2), storage.join(staging, "part-00000.parquet"),
                       row_group_size=row_group_size)
        pq.write_table(table.slice(pins // 2), storage.join(staging, "part-00001.parquet"),
                       row_group_size=row_group_size)


def feature_spec(family: Any, root: Path, days: list[str] = DAYS) -> dict[str, Any]:
    """The feature spec ``training.train`` logs with a model of ``family`` trained on the world at ``root`` (on
    ``days`` but the last, evaluated on the last)."""
    context = family.prepare(str(root), days[:-1], days[-1])
    return {"family": family.name, "family_module": "", "params": dataclasses.asdict(family.params),
            "serving_inputs": list(family.serving_inputs), "outputs": list(family.outputs),
            **family.feature_spec(str(root), days[:-1], days[-1], context)}


def register(family_name: str, root: Path, scratch: Path, tracking_uri: str) -> str:
    """Export and register a freshly initialised model of the family (seeded); its ``models:/`` URI."""
    import torch

    from training.config import RunConfig
    from training.sdk import load_family
    from training.tracking import Tracker

    config = RunConfig.from_dict({
        "root": str(root), "train_days": DAYS[:-1], "eval_ds": DAYS[-1], "output_dir": str(scratch / "job"),
        "checkpoint_dir": str(scratch / f"checkpoints-{family_name}"), "mlflow_tracking_uri": tracking_uri,
        "mlflow_artifact_location": str(scratch / "artifacts" / family_name), "family": family_name,
        "params": PARAMS[family_name],
    })
    family = load_family(family_name, "", PARAMS[family_name])
    spec = feature_spec(family, root)
    torch.manual_seed(0)
    tracker = Tracker(config)
    try:
        uri, _ = tracker.log_model(family, family.build_model().eval(), spec, examples_seen=0)
    finally:
        tracker.end("FINISHED")
    return uri


def register_sharded(root: Path, scratch: Path, tracking_uri: str) -> str:
    """A freshly initialised ranker built sharded row-wise by a 2-rank torchrun world (each rank its rows),
    exported sharded (``training.sharded_export``: two files per table) and registered as
    ``pin_ranker_sharded`` the way ``training.train`` registers one (a pointer, tagged with its pin table's
    rows); its ``models:/`` URI."""
    import json
    import os
    import subprocess
    import sys

    from training.config import RunConfig
    from training.sdk import load_family
    from training.tracking import Tracker

    here = Path(__file__).resolve()
    out = scratch / "sharded-export"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(here.with_name("sharded_tables_worker.py")), "export", str(out), str(root), DAYS[0], DAYS[-1], "0",
         json.dumps(PARAMS["pin_ranker"]), "row_wise"],
        cwd=here.parents[2], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(here.parents[2]), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    config = RunConfig.from_dict({
        "root": str(root), "train_days": DAYS[:-1], "eval_ds": DAYS[-1], "output_dir": str(scratch / "job-sharded"),
        "checkpoint_dir": str(scratch / "checkpoints-sharded"), "mlflow_tracking_uri": tracking_uri,
        "mlflow_artifact_location": str(scratch / "artifacts" / "sharded"), "family": "pin_ranker",
        "model_name": "pin_ranker_sharded", "params": PARAMS["pin_ranker"],
    })
    family = load_family("pin_ranker", "", PARAMS["pin_ranker"])
    spec = feature_spec(family, root)
    tracker = Tracker(config)
    try:
        uri, _ = tracker.log_model(family, None, spec, sharded=str(out / "row_wise" / "model"), examples_seen=0)
    finally:
        tracker.end("FINISHED")
    return uri


@dataclasses.dataclass(frozen=True)
class World:
    root: Path  # the storage root: examples and pin snapshots of DAYS, PINS pins in the corpus
    tracking_uri: str  # a SQLite MLflow holding version 1 of each family registered so far
    pin_ids: list[int]  # the corpus, sorted
    base: Path = Path()  # the world's folder (the MLflow database and artifacts)
    families: set[str] = dataclasses.field(default_factory=set)  # registered so far


_WORLD: dict[str, World] = {}


def shared_world(tmp_path_factory: Any, families: tuple[str, ...] = ("pin_content",)) -> World:
    """One world and registry per test session (creating an MLflow database costs seconds): copy ``root`` before
    writing under it. ``families``: registered (version 1) if not yet, each once per session."""
    if "world" not in _WORLD:
        from core import contracts, storage

        base = tmp_path_factory.mktemp("corpus-world")
        root = base / "storage"
        write_world(root)
        ids = storage.read_table(root, contracts.RAW_PINS, DAYS[-1], columns=["pin_id"]).column("pin_id").to_pylist()
        _WORLD["world"] = World(root, f"sqlite:///{base / 'mlflow.db'}", sorted(ids), base)
    world = _WORLD["world"]
    for family in families:
        if family not in world.families:
            register(family, world.root, world.base, world.tracking_uri)
            world.families.add(family)
    return world


def copy_root(world: World, target: Path) -> Path:
    """A storage root of this test's own, with the world's data."""
    import shutil

    shutil.copytree(world.root, target)
    return target
