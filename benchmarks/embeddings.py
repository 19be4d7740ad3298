"""Benchmark of sharded embedding tables: FSDP2 per table (``strategy: fsdp``) against TorchRec (``torchrec``).

    .venv/bin/python benchmarks/embeddings.py                      # 1M x 32 table, batch 2048, 2 ranks on gloo
    .venv/bin/python benchmarks/embeddings.py --rows 200000 --steps 3   # a quick run

One model and one data stream for every variant: a table of ``--rows`` x ``--dim`` looked up once per example
(ids drawn uniformly, row 0 = absent), a small MLP over the vector, BCE loss; ``--batch`` examples per rank per
step, 2 ranks (``torch.multiprocessing``, gloo, one thread each). Each variant runs in its own fresh pair of
processes, so that its peak memory is its own:

* ``fsdp2``: the table an ``nn.Embedding`` wrapped the way ``training.train.wrap(model, "fsdp")`` wraps it
  (FSDP2 ``fully_shard`` per table, then the model), AdamW: every step gathers the whole table and
  reduce-scatters a dense gradient of its full size;
* ``table_wise`` / ``column_wise``: the platform's TorchRec path (``training.torchrec_sharding.shard``, the
  plan from TorchRec's planner); ``row_wise``: the plan built by hand (``construct_module_sharding_plan(...,
  row_wise())``). The table's optimizer (row-wise Adagrad) is fused into the backward pass, only the rows
  looked up move; the MLP is under DDP with AdamW.

Step time: the mean over ``--steps`` steps after ``--warmup`` (rank 0, wall clock, a barrier before and after).
Memory: rank 0's peak resident set (``ru_maxrss``: ``peak_mb``; ``peak_delta_mb`` less its resident set before
the model was built) and its peak during the timed steps alone (``train_peak_mb``: ``VmHWM`` after resetting it with
``/proc/self/clear_refs``, once the model is built and sharded). Every variant builds the whole model on every
rank first (same seed: the same start), so ``peak_mb`` includes one full copy of the table everywhere;
``train_peak_mb`` is what a rank holds while it trains.

Then the memory budget: each rank may hold ``--budget-mb`` MiB of table and optimizer state. The largest table
that trains row-wise holds ``2 x budget / bytes per row`` rows (weights and the row-wise Adagrad state);
table-wise it is refused by the planner (``Topology(ddr_cap=budget)``: no rank can hold it), row-wise it trains
``--steps`` steps with each rank's shard measured against the budget. This table is built on the meta device, so no
rank ever holds it whole: each allocates and initialises only its shard (its ``peak_delta_mb`` shows it).

The last line printed is one JSON object. Ratios are against ``fsdp2`` (these machines are noisy: only ratios
of one run mean something).

``--collisions``: what ids colliding in tables smaller than the id space cost the ranker (issue 32 item 4), instead
of the above. The demo's synthetic world (``core.config.DemoConfig``: 300 users, 3000 pins, seed 7; ``--days`` of it,
the last one evaluated) with its features built as the demo builds them; then the pin_ranker trained in one process
(AdamW, the training job's learning-rate schedule, batch size and minimum steps, seed 0, no ablation) once per
``id_tables`` (``hashed``, ``managed``) with the pin, user and creator tables each ``--table-share`` of their id
space (distinct ids in the world), and evaluated on the last day. Per table and mode the JSON reports the collision
rates among the ids of the training and evaluation days: ``distinct`` (share of the evaluation day's distinct ids
whose row holds another id too) and ``lookups`` (share of the evaluation day's lookups that read such a row); and
each head's AUC::

    .venv/bin/python benchmarks/embeddings.py --collisions                # 5 days: about 3 minutes on 2 busy cores
    .venv/bin/python benchmarks/embeddings.py --collisions --days 8       # 7 training days: about 13 minutes there

(figures in docs/training.md, "Managed id tables").
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import resource
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = ("fsdp2", "table_wise", "column_wise", "row_wise")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def reset_peak() -> bool:
    """Reset this process's peak resident set (Linux: ``clear_refs`` 5), so that a phase's own peak can be read.

    First the memory freed by the setup goes back to the system (``malloc_trim``), else it would count."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def vm_hwm_mb() -> float:
    """The peak resident set since the last :func:`reset_peak` (``VmHWM``), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def build(rows: int, dim: int, meta: bool = False) -> Any:
    """The model; ``meta``: its table a TorchRec one on the meta device (each rank allocates only its shard)."""
    import torch
    from torch import nn

    from training.torchrec_sharding import TableLookup

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table: nn.Module
            if meta:
                self.table = TableLookup("table", rows, dim, device=torch.device("meta"))
            else:
                self.table = nn.Embedding(rows, dim, padding_idx=0)
                nn.init.normal_(self.table.weight, std=0.05)
                with torch.no_grad():
                    self.table.weight[0].zero_()
            self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.table(ids)).squeeze(-1)

    torch.manual_seed(0)
    return Model()


def worker(rank: int, variant: str, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")  # TorchRec's and FSDP's advice on every call: not results
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result: dict[str, Any] = {"variant": variant}
    try:
        result.update(measure(rank, variant, args))
    except Exception as e:  # a refused plan is a result, not a crash
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(rank: int, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from training import torchrec_sharding as ts
    from training.train import wrap

    device = torch.device("cpu")
    rows = args.budget_rows if variant.startswith("budget_") else args.rows
    base = rss_mb()
    model = build(rows, args.dim, meta=variant.startswith("budget_"))
    if variant == "fsdp2":
        module = wrap(model, "fsdp", device)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        step_opt = optimizer
    else:
        sharding = variant.removeprefix("budget_")
        budget = args.budget_mb * 2**20 if variant.startswith("budget_") else None
        if not variant.startswith("budget_"):
            ts.to_torchrec(model, ["table"])
        module = ts.shard(model, sharding=sharding, device=device, lr=0.05, weight_decay=0.0, memory_per_rank=budget)
        opt = ts.make_optimizer(module, lr=1e-3, weight_decay=0.0)
        step_opt = opt.optimizer
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [
        (torch.randint(0, rows, (args.batch,), generator=gen), torch.randint(0, 2, (args.batch,), generator=gen).float())
        for _ in range(4)
    ]
    times = []
    can_reset = reset_peak()
    for step in range(args.warmup + args.steps):
        ids, labels = batches[step % len(batches)]
        dist.barrier()
        start = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(module(ids), labels)
        step_opt.zero_grad(set_to_none=True)
        loss.backward()
        step_opt.step()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    result: dict[str, Any] = {
        "rows": rows,
        "step_ms": round(1000 * sum(times) / len(times), 2),
        "peak_mb": round(rss_mb(), 1),
        "peak_delta_mb": round(rss_mb() - base, 1),
        "train_peak_mb": round(vm_hwm_mb(), 1) if can_reset else None,
        "loss": round(float(loss.detach()), 5),
    }
    if variant != "fsdp2":
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        local = 0
        for value in [*module.state_dict().values(), *_flat(step_opt.state_dict()["state"])]:
            if isinstance(value, ShardedTensor):
                local += sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
        sizes = [0, 0]
        dist.all_gather_object(sizes, local)
        result["table_and_state_mb_per_rank"] = [round(b / 2**20, 1) for b in sizes]
    return result


def _flat(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return [v for value in state.values() for v in _flat(value)]
    return [state]


def run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(variant, args, free_port(), out), nprocs=2, start_method="spawn")
        result = json.loads(Path(out).read_text())
    print(f"{variant:>18}: {json.dumps(result)}", flush=True)
    return result


# --- --collisions: hashed against managed id tables on the demo world ------------------------------------------

COLLISION_TABLES = {"pin_id": "pin_buckets", "user_id": "user_buckets", "creator_id": "creator_buckets"}


def build_demo_world(root: str, days: int) -> list[str]:
    """The demo's synthetic world (its first ``days`` days) with every day's features built; its days."""
    from core.config import DemoConfig, FeaturesConfig
    from features import build
    from features.synthetic import WorldConfig, generate_world

    demo, features = DemoConfig(), FeaturesConfig()
    world = WorldConfig(start=demo.start, days=days, users=demo.users, pins=demo.pins, seed=demo.seed,
                        impressions_per_user=demo.impressions_per_user)
    summary = generate_world(root, world)
    logging.getLogger("features.steps").setLevel(logging.ERROR)  # a world's first days have no earlier window: expected
    for ds in summary["days"]:
        build.build_day(root, ds, window_days=features.window_days, sequence_length=features.sequence_length,
                        prior_impressions=features.pin_prior_impressions,
                        negative_downsample=features.negative_downsample, seed=features.negative_downsample_seed,
                        require_validation=False)
    return list(summary["days"])


def collision_rates(model: Any, universe: dict[str, Any], evaluated: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per id table: the share of the evaluated distinct ids (``distinct``) and lookups (``lookups``) whose row holds
    another id of ``universe`` (the ids of the training and evaluation days) too."""
    import numpy as np
    import torch

    out = {}
    for feature in COLLISION_TABLES:
        ids = universe[feature]
        rows = model.rows(feature, torch.from_numpy(ids)).numpy()
        _, inverse, per_row = np.unique(rows, return_inverse=True, return_counts=True)
        shared = per_row[inverse] > 1
        eval_ids, eval_counts = evaluated[feature]
        hit = shared[np.searchsorted(ids, eval_ids)]
        out[feature] = {
            "distinct": round(float(hit.mean()), 4),
            "lookups": round(float((eval_counts * hit).sum() / eval_counts.sum()), 4),
        }
    return out


def train_and_evaluate(root: str, days: list[str], mode: str, buckets: dict[str, int]) -> dict[str, Any]:
    """The ranker with ``id_tables: mode`` trained on ``days[:-1]`` and evaluated on the last day."""
    import math as _math

    import numpy as np
    import torch

    from core.config import TrainingConfig
    from training.data import ExampleStream
    from training.models.pin_ranker.inputs import id_counts
    from training.sdk import load_family
    from training.train import lr_lambda

    cfg = TrainingConfig()
    train, eval_ds = days[:-1], days[-1]
    family = load_family("pin_ranker", params={**buckets, "id_tables": mode, "ablation": False})
    context = family.prepare(root, train, eval_ds)
    torch.manual_seed(0)
    model = family.build_model()
    stream = ExampleStream(root, train, lambda t: family.encode(t, context), batch_size=cfg.batch_size,
                           dataset=family.dataset, columns=family.columns, seed=0)
    per_epoch = stream.steps_per_epoch(0)
    epochs = max(cfg.epochs, _math.ceil(cfg.min_steps / max(per_epoch, 1)))
    total = epochs * per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, 20, 0.1))
    started = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        stream.set_epoch(epoch)
        for batch in stream:
            batch = family.finish(batch, context)
            loss, _ = family.loss(model(batch), batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
    train_s = time.perf_counter() - started
    metrics = family.evaluate({"model": model}, root, eval_ds, context, device="cpu", batch_size=1024)
    seen, evaluated = id_counts(root, train), id_counts(root, [eval_ds])
    universe = {f: np.union1d(seen[f][0], evaluated[f][0]) for f in COLLISION_TABLES}
    return {
        "auc": {label: None if v is None else round(v, 4) for label, v in metrics["auc"].items()},
        "mean_auc": None if metrics["mean_auc"] is None else round(metrics["mean_auc"], 4),
        "collisions": collision_rates(model, universe, evaluated),
        "steps": total,
        "train_s": round(train_s, 1),
    }


def collisions_main(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from training.models.pin_ranker.inputs import id_counts

    torch.set_num_threads(max(1, args.threads))
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        days = build_demo_world(root, args.days)
        counts = id_counts(root, days)
        space = {feature: int((counts[feature][0] >= 0).sum()) for feature in COLLISION_TABLES}
        buckets = {param: max(3, round(args.table_share * space[f])) + 1 for f, param in COLLISION_TABLES.items()}
        results = {mode: train_and_evaluate(root, days, mode, buckets) for mode in ("hashed", "managed")}
        examples = {"train": int(np.sum(id_counts(root, days[:-1], ("pin_id",))["pin_id"][1])),
                    "eval": int(np.sum(id_counts(root, days[-1:], ("pin_id",))["pin_id"][1]))}
    summary = {
        "mode": "collisions",
        "world": {"days": len(days), "train_days": len(days) - 1, "eval_day": days[-1], "examples": examples},
        "table_share": args.table_share,
        "id_space": space,
        "table_rows": {f: buckets[p] for f, p in COLLISION_TABLES.items()},
        "collision_rate": {mode: r["collisions"] for mode, r in results.items()},
        "auc": {mode: r["auc"] for mode, r in results.items()},
        "mean_auc": {mode: r["mean_auc"] for mode, r in results.items()},
        "steps": {mode: r["steps"] for mode, r in results.items()},
        "train_s": {mode: r["train_s"] for mode, r in results.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2048, help="examples per rank per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-mb", type=float, default=96.0, help="table + optimizer state a rank may hold")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--collisions", action="store_true",
                        help="instead: hashed against managed id tables on the demo world (collision rate, AUC per head)")
    parser.add_argument("--days", type=int, default=5, help="--collisions: days of the demo world (the last evaluated)")
    parser.add_argument("--table-share", type=float, default=0.1,
                        help="--collisions: rows of the pin, user and creator tables, as a share of their distinct ids")
    parser.add_argument("--threads", type=int, default=2, help="--collisions: torch threads")
    args = parser.parse_args(argv)
    if args.collisions:
        return collisions_main(args)

    from training.torchrec_sharding import rows_bytes

    per_row = rows_bytes(1, args.dim)
    args.budget_rows = int(2 * args.budget_mb * 2**20 // per_row)  # the largest table two ranks' budgets hold
    results = {v: run(v, args) for v in args.variants.split(",")}
    base = results.get("fsdp2", {})
    speedup = {
        v: round(base["step_ms"] / r["step_ms"], 1)
        for v, r in results.items() if v != "fsdp2" and "step_ms" in r and "step_ms" in base
    }
    memory = {
        v: round(r["peak_mb"] / base["peak_mb"], 2)
        for v, r in results.items() if v != "fsdp2" and "peak_mb" in r and "peak_mb" in base
    }
    train_memory = {
        v: round(r["train_peak_mb"] / base["train_peak_mb"], 2)
        for v, r in results.items() if v != "fsdp2" and r.get("train_peak_mb") and base.get("train_peak_mb")
    }
    for v in speedup:
        print(f"{v}: {speedup[v]}x faster per step than fsdp2; rank-0 peak memory {memory[v]}x of fsdp2's "
              f"(while training: {train_memory.get(v)}x)")
    budget_tw = run("budget_table_wise", args)
    budget_rw = run("budget_row_wise", args)
    table_mb = round(per_row * args.budget_rows / 2**20, 1)
    fits = "table_and_state_mb_per_rank" in budget_rw and all(
        mb <= args.budget_mb for mb in budget_rw["table_and_state_mb_per_rank"]
    )
    print(
        f"budget {args.budget_mb} MiB per rank: a {args.budget_rows} x {args.dim} table ({table_mb} MiB with its "
        f"optimizer state) is refused table-wise ({'error' in budget_tw}) and trains row-wise "
        f"({'step_ms' in budget_rw}, shards {budget_rw.get('table_and_state_mb_per_rank')} MiB)"
    )
    summary = {
        "rows": args.rows,
        "dim": args.dim,
        "batch_per_rank": args.batch,
        "ranks": 2,
        "step_ms": {v: r.get("step_ms") for v, r in results.items()},
        "peak_mb": {v: r.get("peak_mb") for v, r in results.items()},
        "peak_delta_mb": {v: r.get("peak_delta_mb") for v, r in results.items()},
        "train_peak_mb": {v: r.get("train_peak_mb") for v, r in results.items()},
        "speedup_vs_fsdp2": speedup,
        "peak_memory_vs_fsdp2": memory,
        "train_peak_memory_vs_fsdp2": train_memory,
        "budget": {
            "mb_per_rank": args.budget_mb,
            "rows": args.budget_rows,
            "table_mb": table_mb,
            "table_wise_refused": "error" in budget_tw,
            "table_wise_error": budget_tw.get("error"),
            "row_wise_trains": "step_ms" in budget_rw,
            "row_wise_step_ms": budget_rw.get("step_ms"),
            "row_wise_mb_per_rank": budget_rw.get("table_and_state_mb_per_rank"),
            "row_wise_fits_budget": fits,
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
