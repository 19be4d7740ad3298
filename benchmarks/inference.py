"""Benchmark of corpus inference: the whole stage and the Ray engine against the model's own forward pass.

    .venv/bin/python benchmarks/inference.py                      # 1,000,000 pins, the ranker
    .venv/bin/python benchmarks/inference.py --pins 100000        # a quick run

Setup (not timed): a ``raw/pins`` snapshot of ``--pins`` pins (the columns of ``core.contracts.PINS_SCHEMA``, in
``--files`` files with row groups of 64Ki rows, as they land from upstream) and a freshly initialised
model of ``--family`` (default ``pin_ranker``) of the family's default size, exported and registered in a SQLite MLflow under a temporary
folder the way ``training.train`` does it.

Measured in this one run, side by side (these machines are noisy; only ratios mean something):

* ``forward`` — the exported model's forward pass in this process on the same pins' inputs, prepared beforehand
  and held in memory as tensors, in the plan's batches, ``--threads`` torch threads: the ceiling of one scoring
  process (``--forward-pins`` of them: the rate does not depend on how many); timed before and after the stage,
  the faster of the two counts (noise from other processes must not flatter the stage);
* ``stage`` — the stage as the DAG runs it on the local backend: plan (``training.inference.make_plan``), one array
  job of ``--parallelism`` scoring processes (``operators.backends.local``; processes start, load the model,
  read, preprocess, score and write their parts), publish (every part checked against the snapshot, the
  manifest written last); wall time from planning to the manifest;
* ``ray`` — the same plan's shards scored by ``python -m training.ray_inference`` (a local Ray cluster of
  ``--ray-cpus`` CPUs it starts and stops: readers preprocess on CPU tasks, an actor pool scores), then published;
  wall time including the cluster's start.

The stage's ceiling is ``--parallelism`` processes at the forward rate: ``stage_vs_forward`` is the stage's pins/s
over ``parallelism x forward``; ``ray_vs_forward`` is Ray's pins/s over ``actors x forward``. The last line printed
is one JSON object: ``pins_per_s`` (the stage's), ``stage_vs_forward``, ``ray_vs_forward`` and every figure behind
them, with ``stage_vs_forward_cpu``: pins per CPU second of the scoring processes over the forward pass's (what the
stage costs beyond the model, less disturbed by other load than the wall-time ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.inference import ScoringPlan

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DAYS = ["2026-01-01", "2026-01-02"]  # the model's training day and the corpus day
FAMILIES = ("pin_ranker", "pin_content")


def write_corpus(root: Path, pins: int, files: int, seed: int = 0) -> None:
    """``pins`` pins of the ``raw/pins`` schema for the corpus day, replacing the tiny world's snapshot."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from core import contracts, storage

    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(1, pins * 8, dtype=np.int64), size=pins, replace=False)
    bounds = [pins * i // files for i in range(files + 1)]
    created = pa.scalar(0, pa.timestamp("us", tz="UTC"))
    with storage.write_partition(root, contracts.RAW_PINS, DAYS[-1]) as staging:
        for f in range(files):
            a, b = bounds[f], bounds[f + 1]
            n = b - a
            tokens = rng.integers(0, contracts.TEXT_VOCAB, size=n * 6).astype(np.int32)
            table = pa.table({
                "pin_id": ids[a:b],
                "embedding": pa.FixedSizeListArray.from_arrays(
                    pa.array(rng.normal(size=n * 32).astype(np.float32)), 32),
                "category": rng.integers(0, 12, size=n).astype(np.int32),
                "creator_id": rng.integers(1, 10_000, size=n).astype(np.int64),
                "created_at": pa.array(np.zeros(n, dtype=np.int64), pa.int64()).cast(created.type),
                "image_embedding": pa.FixedSizeListArray.from_arrays(
                    pa.array(rng.normal(size=n * contracts.IMAGE_DIM).astype(np.float32)), contracts.IMAGE_DIM),
                "text_tokens": pa.ListArray.from_arrays(pa.array(np.arange(0, n * 6 + 1, 6, dtype=np.int32)),
                                                        pa.array(tokens)),
            }).cast(contracts.PINS_SCHEMA)
            pq.write_table(table, storage.join(staging, f"part-{f:05d}.parquet"), row_group_size=64 * 1024)


def register_model(family_name: str, root: Path, scratch: Path, tracking_uri: str) -> str:
    """Export and register a freshly initialised model of the family's default size; its ``models:/`` URI."""
    import torch

    from training.config import RunConfig
    from training.sdk import load_family
    from training.tracking import Tracker

    config = RunConfig.from_dict({
        "root": str(root), "train_days": DAYS[:-1], "eval_ds": DAYS[-1], "output_dir": str(scratch / "job"),
        "checkpoint_dir": str(scratch / "checkpoints"), "mlflow_tracking_uri": tracking_uri,
        "mlflow_artifact_location": str(scratch / "artifacts"), "family": family_name, "params": {},
    })
    family = load_family(family_name, "", {})
    context = family.prepare(str(root), DAYS[:-1], DAYS[-1])
    spec = {"family": family.name, "family_module": "", "params": dataclasses.asdict(family.params),
            "serving_inputs": list(family.serving_inputs), "outputs": list(family.outputs),
            **family.feature_spec(str(root), DAYS[:-1], DAYS[-1], context)}
    torch.manual_seed(0)
    tracker = Tracker(config)
    try:
        uri, _ = tracker.log_model(family, family.build_model().eval(), spec, examples_seen=0)
    finally:
        tracker.end("FINISHED")
    return uri


def measure_forward(plan: ScoringPlan, pins: int, threads: int) -> dict[str, Any]:
    """The model's forward pass on in-memory tensors of the plan's first ``pins`` pins, in its batches."""
    import torch

    from training.inference import Scorer, shard_batches

    torch.set_num_threads(threads)
    scorer = Scorer.load(plan.model_uri, plan.tracking_uri)
    names = scorer.spec["serving_inputs"]
    batches, rows = [], 0
    for shard in range(plan.num_shards):
        for table in shard_batches(plan, shard):
            inputs = scorer.family.corpus_inputs(table, scorer.spec, plan.root, plan.ds)
            batches.append([torch.from_numpy(inputs[name]) for name in names])
            rows += table.num_rows
            if rows >= pins:
                break
        if rows >= pins:
            break
    with torch.no_grad():
        for tensors in batches[:2]:  # warm-up
            scorer.module(*tensors)
        started, cpu_from = time.perf_counter(), time.process_time()
        for tensors in batches:
            scorer.module(*tensors)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_from
    return {"pins": rows, "seconds": round(seconds, 3), "pins_per_s": round(rows / seconds, 1),
            "pins_per_cpu_s": round(rows / cpu, 1)}


def wait_for(backend: Any, job_id: str, poll: float = 0.2) -> Any:
    while True:
        status = backend.status(job_id)
        if status.state.terminal:
            return status
        time.sleep(poll)


def run_stage(args: argparse.Namespace, root: Path, home: Path, model_uri: str, tracking_uri: str) -> dict[str, Any]:
    """Plan → one local array job → publish, timed as a whole."""
    from core.config import PlatformConfig
    from operators.backends.local import LocalBackend
    from operators.inference import scoring_job_spec
    from training.inference import make_plan, publish_plan, write_plan

    cfg = PlatformConfig(storage_root=str(root), inference={
        "parallelism": args.parallelism, "threads": args.threads, "batch_size": args.batch_size})
    out = root / "inference" / "stage" / f"ds={DAYS[-1]}"
    started = time.perf_counter()
    plan = make_plan(model_uri=model_uri, tracking_uri=tracking_uri, root=str(root), ds=DAYS[-1], out_dir=out,
                     num_shards=args.shards or args.parallelism, batch_size=args.batch_size, threads=args.threads)
    summary = {"plan_file": write_plan(plan)}
    planned = time.perf_counter()
    backend = LocalBackend(home)
    spec = scoring_job_spec(summary, list(range(plan.num_shards)), name="bench-stage", engine="processes",
                            backend="local", cfg=cfg)
    status = wait_for(backend, backend.submit(spec))
    if status.state.name != "SUCCEEDED":
        raise SystemExit(f"the scoring job failed: {status.reason}\n{backend.logs(status.job_id)}")
    scored = time.perf_counter()
    manifest = publish_plan(plan)
    ended = time.perf_counter()
    seconds = ended - started
    return {"pins": manifest["rows"], "shards": plan.num_shards, "seconds": round(seconds, 3),
            "pins_per_s": round(manifest["rows"] / seconds, 1), "plan_s": round(planned - started, 3),
            "job_s": round(scored - planned, 3), "publish_s": round(ended - scored, 3),
            "per_process_pins_per_s": (manifest.get("throughput") or {}).get("pins_per_s_per_process"),
            "per_process_pins_per_cpu_s": (manifest.get("throughput") or {}).get("pins_per_cpu_s"),
            "plan": plan}


def run_ray(args: argparse.Namespace, root: Path, scratch: Path, model_uri: str, tracking_uri: str) -> dict[str, Any]:
    """The same work with ``python -m training.ray_inference`` (its own local cluster), then publish."""
    from training.inference import make_plan, publish_plan, write_plan

    out = root / "inference" / "ray" / f"ds={DAYS[-1]}"
    started = time.perf_counter()
    plan = make_plan(model_uri=model_uri, tracking_uri=tracking_uri, root=str(root), ds=DAYS[-1], out_dir=out,
                     num_shards=args.shards or args.parallelism, batch_size=args.batch_size, threads=args.threads)
    location = write_plan(plan)
    temp = Path(tempfile.mkdtemp(prefix="pfray-", dir="/tmp"))  # short: Ray's socket paths
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(scratch / "home"), "OMP_NUM_THREADS": str(args.threads),
           "RAY_USAGE_STATS_ENABLED": "0"}
    command = [sys.executable, "-m", "training.ray_inference", "--plan", location, "--cpus", str(args.ray_cpus),
               "--actor-cpus", str(args.ray_actor_cpus), "--reader-cpus", str(args.ray_reader_cpus),
               "--threads", str(args.threads), "--temp-dir", str(temp)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"the Ray job failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = publish_plan(plan)
    seconds = time.perf_counter() - started
    return {"pins": manifest["rows"], "seconds": round(seconds, 3), "pins_per_s": round(manifest["rows"] / seconds, 1),
            "actors": summary.get("actors"), "job_pins_per_s": summary.get("pins_per_s"),
            "ids_checksum": manifest["ids_checksum"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pins", type=int, default=1_000_000, help="pins in the corpus")
    parser.add_argument("--family", choices=FAMILIES, default="pin_ranker", help="the model family scoring it")
    parser.add_argument("--files", type=int, default=4, help="Parquet files of the snapshot")
    parser.add_argument("--batch-size", type=int, default=4096, help="pins per forward pass (the plan's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a scoring process / actor")
    parser.add_argument("--parallelism", type=int, default=1, help="scoring processes at once (the stage's)")
    parser.add_argument("--shards", type=int, default=0, help="shards of the plan (0: --parallelism)")
    parser.add_argument("--forward-pins", type=int, default=200_000, help="pins the forward pass is timed on")
    parser.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    parser.add_argument("--ray-actor-cpus", type=float, default=1.0, help="CPUs of a scoring actor")
    parser.add_argument("--ray-reader-cpus", type=float, default=0.5, help="CPUs of a reader task")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray measurement")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the Ray job may take")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (printed)")
    args = parser.parse_args(argv)

    import shutil

    from training.smoke_data import write_tiny_world

    scratch = Path(tempfile.mkdtemp(prefix="pinflow-bench-inference-"))
    try:
        root = scratch / "storage"
        t0 = time.perf_counter()
        write_tiny_world(root, DAYS, rows_per_day=200, pins=500)  # what the model's registration reads
        write_corpus(root, args.pins, args.files)
        tracking = f"sqlite:///{scratch / 'mlflow.db'}"
        model_uri = register_model(args.family, root, scratch, tracking)
        print(f"setup: {args.pins} pins, {args.family} model {model_uri} in {time.perf_counter() - t0:.1f}s", flush=True)

        # The forward pass is timed before and after the stage and the faster of the two is the ceiling: load
        # from other processes slows one of them, and the ratio must not flatter the stage.
        from training.inference import make_plan

        probe = make_plan(model_uri=model_uri, tracking_uri=tracking, root=str(root), ds=DAYS[-1],
                          out_dir=root / "inference" / "probe" / f"ds={DAYS[-1]}",
                          num_shards=args.shards or args.parallelism, batch_size=args.batch_size, threads=args.threads)
        before = measure_forward(probe, min(args.forward_pins, args.pins), args.threads)
        print(f"forward before: {json.dumps(before)}", flush=True)
        stage = run_stage(args, root, scratch / "home", model_uri, tracking)
        plan = stage.pop("plan")
        print(f"stage: {json.dumps(stage)}", flush=True)
        after = measure_forward(plan, min(args.forward_pins, args.pins), args.threads)
        print(f"forward after: {json.dumps(after)}", flush=True)
        forward = {**max(before, after, key=lambda f: f["pins_per_s"]),
                   "pins_per_cpu_s": max(before["pins_per_cpu_s"], after["pins_per_cpu_s"]),
                   "pins_per_s_before": before["pins_per_s"], "pins_per_s_after": after["pins_per_s"]}
        ray = None if args.no_ray else run_ray(args, root, scratch, model_uri, tracking)
        if ray is not None:
            print(f"ray: {json.dumps(ray)}", flush=True)
        stage_ceiling = forward["pins_per_s"] * min(args.parallelism, stage["shards"])
        result = {
            "pins": args.pins,
            "family": args.family,
            "batch_size": args.batch_size,
            "threads": args.threads,
            "parallelism": args.parallelism,
            "cpus": os.cpu_count(),
            "pins_per_s": stage["pins_per_s"],
            "forward_pins_per_s": forward["pins_per_s"],
            "stage_vs_forward": round(stage["pins_per_s"] / stage_ceiling, 3),
            # The same per CPU second of the scoring processes against the forward pass's: what the stage costs
            # beyond the model, whatever else the machine runs (the wall-time ratio above is the bar).
            "stage_vs_forward_cpu": round(stage["per_process_pins_per_cpu_s"] / forward["pins_per_cpu_s"], 3)
            if stage.get("per_process_pins_per_cpu_s") else None,
            "ray_pins_per_s": ray["pins_per_s"] if ray else None,
            "ray_vs_forward": round(ray["pins_per_s"] / (forward["pins_per_s"] * (ray["actors"] or 1)), 3) if ray else None,
            "stage": stage,
            "forward": forward,
            "ray": ray,
        }
        print(json.dumps(result), flush=True)
        return 0
    finally:
        if args.keep:
            print(f"kept {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
