"""Benchmark of the training input pipeline against the model step, on the demo's world.

    .venv/bin/python benchmarks/input_pipeline.py                       # the demo's world, 19 days (built once)
    .venv/bin/python benchmarks/input_pipeline.py --root .pinflow/storage --days 19   # the demo's own storage

Measured in this one run, side by side (these machines are noisy; only ratios mean something), on the ranker's
batches (``RankerParams`` defaults, ``--batch-size`` rows) of the training days:

* ``local_examples_per_s`` — the local engine alone (``ExampleStream.loader``, as ``training.train`` reads) with
  0, 1 and 2 input workers: examples delivered per second, nothing trained;
* ``ray_examples_per_s`` — the Ray engine alone (``training.ray_input``: a Ray Data pipeline on a local cluster of
  every CPU), the same batches;
* ``model_step_examples_per_s`` — the model alone: the family's ``finish`` (the gather of the sequence's content
  embeddings, which a job runs on the training device as the step's first part), forward, backward and AdamW on
  batches already in memory.

Each pipeline figure is the median epoch over the training days after the first (which starts the input workers,
or loads the run's state into the Ray cluster's workers, once, as in a job), timed from the start of the epoch's
pipeline to its last batch, as the trainer gets the batches; the local engine's counts take their epochs in turn
(epoch e with 0, 1 and 2 workers, then e + 1). The last line printed is one JSON object with those figures,
``workers_2_vs_0`` (the median over the measured epochs of 2 workers' rate over the same round's 0 workers' rate),
``ray_vs_local`` (Ray over the local engine at 0 workers) and ``best_pipeline_vs_model_step`` (above 1: the input can
feed the model on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

START = "2026-11-01"


def demo_world(workdir: Path, days: int) -> str:
    """The demo's synthetic world (``demo:`` of the configuration) for ``days + 1`` days, features built; kept in
    ``workdir`` for the next run."""
    from core import config, contracts, storage
    from features import build
    from features.synthetic import WorldConfig, generate_world

    demo = config.load().demo
    world = WorldConfig(start=demo.start, days=days + 1, users=demo.users, pins=demo.pins, seed=demo.seed,
                        impressions_per_user=demo.impressions_per_user)
    root = workdir / "storage"
    marker = workdir / "world.json"
    if not marker.exists() or json.loads(marker.read_text()) != world.__dict__:
        print(f"building the demo world ({days + 1} days) under {root}", file=sys.stderr, flush=True)
        generate_world(root, world)
        for ds in world.day_list:
            build.build_day(root, ds, require_validation=False)
        marker.write_text(json.dumps(world.__dict__))
    assert storage.complete_days(root, contracts.EXAMPLES)
    return str(root)


def training_days(root: str, days: int) -> tuple[list[str], str]:
    from core import contracts, storage

    complete = storage.complete_days(root, contracts.EXAMPLES)
    if len(complete) < 2:
        raise SystemExit(f"{root} has {len(complete)} complete examples partition(s): give --root a built world")
    return complete[:-1][-days:], complete[-1]


def run_config(root: str, days: list[str], eval_ds: str, batch_size: int, workdir: Path) -> dict[str, Any]:
    return {"root": root, "train_days": days, "eval_ds": eval_ds, "output_dir": str(workdir / "job"),
            "checkpoint_dir": str(workdir / "checkpoints"), "mlflow_tracking_uri": "", "batch_size": batch_size,
            "params": {"ablation": False}}


def local_stream(config: Any, family: Any, context: Any, workers: int) -> Any:
    from training.data import ExampleStream

    return ExampleStream(config.root, config.train_days, lambda table: family.encode(table, context),
                         encode_into=lambda table, alloc: family.encode_into(table, context, alloc),
                         batch_size=config.batch_size, dataset=family.dataset, columns=family.columns,
                         num_workers=workers, seed=config.seed)


def delivered(make: Any) -> float:
    """Examples per second of one epoch of batches, from the start of the epoch's pipeline (``make()``: its
    workers or its Ray Data job) to its last batch: what a job waits for, per epoch."""
    started = time.perf_counter()
    rows = 0
    for item in make():
        rows += int(item["row_id"].shape[0])
    return rows / (time.perf_counter() - started)


def local_rates(config: Any, family: Any, context: Any, workers: Sequence[int], epochs: int) -> dict[int, list[float]]:
    """The local engine's rate per epoch at each count of ``workers``, the counts' epochs interleaved (epoch e at
    every count, then epoch e + 1): a noisy machine's slow spell falls on every count alike. Each count's loader
    (and its workers, started by its first epoch, as in a job) lives for the whole measure."""
    import torch

    streams = {w: local_stream(config, family, context, w) for w in workers}
    loaders = {w: stream.loader(prefetch_factor=config.prefetch_factor, generator=torch.Generator().manual_seed(0))
               for w, stream in streams.items()}
    rates: dict[int, list[float]] = {w: [] for w in workers}
    for epoch in range(epochs):
        for w in workers:
            streams[w].set_epoch(epoch)
            rates[w].append(delivered(lambda w=w: loaders[w]))  # type: ignore[misc]
    return rates


def ray_rate(config: Any, family: Any, context: Any, epochs: int) -> float:
    """The Ray engine's median epoch after the first, on a local cluster of every CPU (a job starts the cluster
    once; the first epoch loads the run's state into Ray's workers)."""
    from training.ray_inference import start_ray
    from training.ray_input import RayExampleBatches

    started = start_ray(0, os.path.join(tempfile.gettempdir(), "pinflow-ray"))
    try:
        stream = local_stream(config, family, context, 0)
        engine = RayExampleBatches(stream, config.to_dict())
        rates = [delivered(lambda e=epoch: engine.batches(e, 0, stream.steps_per_epoch(e)))  # type: ignore[misc]
                 for epoch in range(epochs)]
        return statistics.median(rates[1:])
    finally:
        if started:
            import ray

            ray.shutdown()


def model_rate(config: Any, family: Any, context: Any, steps: int) -> float:
    import torch

    stream = local_stream(config, family, context, 0)
    stream.set_epoch(0)
    resident = []
    for batch in stream:
        resident.append(batch)
        if len(resident) >= 8:
            break
    torch.manual_seed(0)
    model = family.build_model("model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model.train()

    def step(batch: dict[str, Any]) -> int:
        batch = family.finish(batch, context)  # as training.train's step does
        loss, _ = family.loss(model(batch), batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return int(batch["row_id"].shape[0])

    step(resident[0])  # warm-up
    started, rows = time.perf_counter(), 0
    for i in range(steps):
        rows += step(resident[i % len(resident)])
    return rows / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="", help="a storage root with built examples (default: the demo world, built)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pinflow-bench-input")
    parser.add_argument("--days", type=int, default=19, help="training days read (default: %(default)s, the demo's)")
    # 12: one epoch's ratio of 2 workers to none ranges about 1.55-2.05 on a 2-core machine (its speed drifts within
    # seconds), too wide for a median of 5; what is left between runs is the machine's drift over minutes.
    parser.add_argument("--epochs", type=int, default=12, help="epochs per engine; the median of all but the first "
                        "is reported (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40, help="model steps measured")
    args = parser.parse_args(argv)

    import torch

    from training.config import RunConfig

    args.workdir.mkdir(parents=True, exist_ok=True)
    root = args.root or demo_world(args.workdir, args.days)
    days, eval_ds = training_days(root, args.days)
    config = RunConfig.from_dict(run_config(root, days, eval_ds, args.batch_size, args.workdir))
    family = config.family_instance()
    context = family.prepare(config.root, list(config.train_days), config.eval_ds)
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)

    per_epoch = local_rates(config, family, context, (0, 1, 2), args.epochs)
    local = {str(w): round(statistics.median(rates[1:]), 1) for w, rates in per_epoch.items()}
    # Each measured epoch's 2 workers over the same round's none, the median: a ratio of neighbours in time.
    workers_2_vs_0 = statistics.median(two / none for two, none in zip(per_epoch[2][1:], per_epoch[0][1:], strict=True))
    print(f"local engine (examples/s by workers): {local}", file=sys.stderr, flush=True)
    ray = round(ray_rate(config, family, context, args.epochs), 1)
    print(f"ray engine: {ray} examples/s", file=sys.stderr, flush=True)
    model = round(model_rate(config, family, context, args.steps), 1)
    print(f"model step: {model} examples/s", file=sys.stderr, flush=True)
    best = max([*local.values(), ray])
    print(json.dumps({
        "model_step_examples_per_s": model,
        "local_examples_per_s": local,
        "ray_examples_per_s": ray,
        "workers_2_vs_0": round(workers_2_vs_0, 3),
        "ray_vs_local": round(ray / local["0"], 3) if local["0"] else None,
        "best_pipeline_vs_model_step": round(best / model, 3) if model else None,
        "cpus": cpus, "batch_size": args.batch_size, "train_days": days,
        "torch": torch.__version__,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
