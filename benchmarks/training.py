"""Benchmark of training throughput: the real input pipeline against tensors in memory, and 2 ranks against 1.

    .venv/bin/python benchmarks/training.py                 # the demo-sized model, 2 x 12000 examples
    .venv/bin/python benchmarks/training.py --rows-per-day 2000 --steps 20   # a quick run

Setup (not timed): a synthetic ``examples`` dataset (``training.smoke_data``: two days, realistic
sequence lengths, row groups like the feature build writes) and the PinRanker of ``RankerParams``' defaults
(the demo's model; ``--ablation`` adds the lockstep ablation model as training does).

Measured in this one run, side by side (these machines are noisy; only ratios mean something):

* ``pipeline`` — one process trains ``--steps`` steps on batches streamed by ``ExampleStream`` through a
  ``DataLoader`` with ``--num-workers`` workers (Parquet row groups → tensors), as ``training.train`` does;
* ``memory`` — the same process trains the same number of steps on the same batches, decoded beforehand
  and held in memory: the ceiling of the pipeline;
* ``ddp_1`` / ``ddp_2`` — gloo process groups of 1 and 2 processes (``torch.multiprocessing``), each rank
  training on its in-memory share with ``--strategy`` (ddp or fsdp); examples/s of the whole group.

Each measurement warms up for ``--warmup`` steps first. The last line printed is one JSON object:
``examples_per_s`` (the pipeline's, one process), ``pipeline_vs_memory``, ``ddp_2_vs_1`` (group
examples/s of 2 ranks over 1 rank) and every figure behind them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DAYS = ["2026-01-01", "2026-01-02"]


def make_model(ablation: bool) -> tuple[list[Any], list[Any]]:
    import torch

    from training.models.pin_ranker.model import PinRanker
    from training.models.pin_ranker.params import RankerParams

    params = RankerParams()  # the ranker's defaults, as a training run uses them
    configs = [params.model_config()] + ([params.model_config(use_sequence=False)] if ablation else [])
    models, optimizers = [], []
    for c in configs:
        torch.manual_seed(0)
        model = PinRanker(c)
        models.append(model)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return models, optimizers


def train_step(models: list[Any], optimizers: list[Any], batch: dict[str, Any]) -> int:
    import torch

    from training.models.pin_ranker.model import multitask_loss

    inputs = {k: v for k, v in batch.items() if k not in ("labels", "impression_id")}
    for model, optimizer in zip(models, optimizers, strict=True):
        loss, _ = multitask_loss(model(inputs), batch["labels"], {})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return int(batch["labels"].shape[0])


def stream(root: Path, batch_size: int, rank: int = 0, world_size: int = 1, num_workers: int = 0) -> Any:
    from training.data import ExampleStream, PinEmbeddings
    from training.models.pin_ranker.inputs import EXAMPLE_COLUMNS, encode_batch

    pins = PinEmbeddings.from_snapshot(root, DAYS[-1])
    return ExampleStream(
        root,
        DAYS,
        lambda table: encode_batch(table, pins, 50),
        batch_size=batch_size,
        columns=EXAMPLE_COLUMNS,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        seed=0,
    )


def timed(models: list[Any], optimizers: list[Any], batches: Any, steps: int, warmup: int) -> dict[str, float]:
    """Train ``warmup`` then ``steps`` steps on ``batches`` (an iterator); examples/s of the timed steps."""
    it = iter(batches)
    for _ in range(warmup):
        train_step(models, optimizers, next(it))
    start = time.perf_counter()
    examples = 0
    for _ in range(steps):
        examples += train_step(models, optimizers, next(it))
    seconds = time.perf_counter() - start
    return {"examples": examples, "seconds": round(seconds, 3), "examples_per_s": round(examples / seconds, 1)}


def _rank_worker(rank: int, world_size: int, root: str, args: argparse.Namespace, store_path: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from training.train import wrap

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=dt.timedelta(seconds=600))
    s = stream(Path(root), args.batch_size, rank, world_size)
    needed = args.warmup + args.steps
    batches = [b for _, b in zip(range(needed), s, strict=False)]
    if len(batches) < needed:
        raise SystemExit(f"rank {rank} has {len(batches)} batches, need {needed}: raise --rows-per-day")
    models, _ = make_model(args.ablation)
    wrapped = [wrap(m, args.strategy, torch.device("cpu")) for m in models]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in wrapped]
    for b in batches[: args.warmup]:
        train_step(wrapped, optimizers, b)
    dist.barrier()
    start = time.perf_counter()
    examples = sum(train_step(wrapped, optimizers, b) for b in batches[args.warmup :])
    dist.barrier()
    seconds = time.perf_counter() - start
    total = torch.tensor([examples])
    dist.all_reduce(total)
    if rank == 0:
        out.put(
            {
                "world_size": world_size,
                "examples": int(total),
                "seconds": round(seconds, 3),
                "examples_per_s": round(int(total) / seconds, 1),
            }
        )
    dist.destroy_process_group()


def group_throughput(root: Path, world_size: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = tmp / f"store-{world_size}-{time.time_ns()}"
    mp.start_processes(
        _rank_worker, args=(world_size, str(root), args, str(store), out), nprocs=world_size, start_method="spawn"
    )
    return out.get()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows-per-day", type=int, default=12000, help="examples per day (two days)")
    parser.add_argument("--batch-size", type=int, default=512, help="examples per step per rank")
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternating pipeline/memory runs; the best of each counts"
    )
    parser.add_argument("--steps", type=int, default=16, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each measurement")
    parser.add_argument(
        "--num-workers", type=int, default=0, help="DataLoader workers of the pipeline run (training.train default: 0)"
    )
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="wrapping of the 1 vs 2 runs")
    parser.add_argument("--ablation", action="store_true", help="also train the ablation model, as training does")
    args = parser.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader

    from training.smoke_data import write_tiny_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pinflow-bench-") as tmp_name:
        tmp = Path(tmp_name)
        root = tmp / "storage"
        write_tiny_world(
            root, DAYS, rows_per_day=args.rows_per_day, pins=3000, users=2000, row_group_size=2048, max_sequence=50
        )
        needed = args.warmup + args.steps

        s = stream(root, args.batch_size, num_workers=args.num_workers)
        if s.steps_per_epoch(0) < needed:
            raise SystemExit(f"{s.steps_per_epoch(0)} batches in the data, need {needed}: raise --rows-per-day")
        loader = DataLoader(
            s, batch_size=None, num_workers=args.num_workers, generator=torch.Generator().manual_seed(0)
        )
        memory_batches = [b for _, b in zip(range(needed), stream(root, args.batch_size), strict=False)]

        # Interleave pipeline and memory runs and keep each one's best, so that a noisy neighbour
        # slows both alike.
        runs: dict[str, list[dict[str, float]]] = {"pipeline": [], "memory": []}
        for _ in range(args.repeats):
            models, optimizers = make_model(args.ablation)
            runs["pipeline"].append(timed(models, optimizers, loader, args.steps, args.warmup))
            models, optimizers = make_model(args.ablation)
            runs["memory"].append(timed(models, optimizers, memory_batches, args.steps, args.warmup))
        best = {k: max(v, key=lambda r: r["examples_per_s"]) for k, v in runs.items()}

        ddp1 = group_throughput(root, 1, args, tmp)
        ddp2 = group_throughput(root, 2, args, tmp)

    result = {
        "examples_per_s": best["pipeline"]["examples_per_s"],
        "pipeline_vs_memory": round(best["pipeline"]["examples_per_s"] / best["memory"]["examples_per_s"], 3),
        "ddp_2_vs_1": round(ddp2["examples_per_s"] / ddp1["examples_per_s"], 3),
        "memory_examples_per_s": best["memory"]["examples_per_s"],
        "ddp_1": ddp1,
        "ddp_2": ddp2,
        "runs": runs,
        "config": {**vars(args), "cpus": os.cpu_count(), "torch": torch.__version__},
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
