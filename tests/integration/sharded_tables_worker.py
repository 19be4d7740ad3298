"""One rank of the sharded-tables tests (``test_sharded_tables.py``), run under ``torch.distributed.run``.

``build OUT SHARDING [ROWS DIM]``: the model built as strategy torchrec builds it (``build_meta`` → ``to_torchrec``
→ ``shard``) with no tensor of a table's full size ever allocated (a dispatch mode refuses one); writes this
rank's rows of every table, its dense parameters and its peak RSS to ``OUT/rank{r}.pt``. Without ROWS the
model is the ranker's (small params); with them a two-table toy whose first table is ROWS x DIM.

``save CKPT SHARDING`` / ``load CKPT SHARDING OUT``: the toy sharded, trained 3 steps and checkpointed
(``training.checkpoint.save``); or built on this world and loaded from CKPT (resharded by DCP), writing this
rank's pieces of every sharded tensor (tables and the fused optimizer's state) and the loaded position.

``export OUT ROOT TRAIN_DAY EVAL_DAY STEPS PARAMS SHARDING...``: for each sharding, the ranker of ``PARAMS`` (JSON)
built as strategy torchrec builds it, trained ``STEPS`` steps on ``TRAIN_DAY`` of the world at ``ROOT`` (each
rank its own batches), exported sharded (``training.sharded_export.export``) to ``OUT/SHARDING/model``, and
gathered (``torchrec_sharding.gather_full``, what the unsharded export serves) into ``OUT/SHARDING/gathered.pt``
on rank 0.
"""

from __future__ import annotations

import datetime as dt
import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from training import torchrec_sharding as ts

SMALL_RANKER = {
    "sequence_length": 4, "first_k": 2, "d_model": 8, "ff_dim": 16, "sparse_dim": 4, "pin_buckets": 20011,
    "user_buckets": 47, "creator_buckets": 13, "category_buckets": 11, "mlp_hidden": [8], "embedding_dim": 8,
}
SEED = 7


class Toy(nn.Module):
    def __init__(self, rows: int = 41, dim: int = 4) -> None:
        super().__init__()
        self.ids = nn.Embedding(rows, dim, padding_idx=0)
        self.tags = nn.Embedding(13, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.out(self.ids(ids) + self.tags(tags)).squeeze(-1)


class NoWholeTable(TorchDispatchMode):
    """Raises if any operation makes a tensor with ``limit`` elements or more (a whole table)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.numel())
                if t.numel() >= self.limit:
                    raise AssertionError(f"{func} made a tensor of {tuple(t.shape)}: a whole table")
        return out


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sharded(build: Any, names: list[str], sharding: str, std: dict[str, float] | None = None) -> Any:
    torch.manual_seed(SEED)
    model = ts.to_torchrec(ts.build_meta(build, names), names, seed=SEED, init_std=std)
    return ts.shard(ts.to_device(model, torch.device("cpu")), sharding=sharding, device=torch.device("cpu"),
                    lr=0.1, weight_decay=0.0)


def pieces(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every sharded tensor of a nested state, flattened as DCP flattens it: key → [(offsets, local tensor)]."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    found: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(pieces(value, f"{name}."))
        elif isinstance(value, ShardedTensor):
            found[name] = [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in value.local_shards()]
    return found


def build(out: str, sharding: str, rows: int | None, dim: int | None) -> dict[str, Any]:
    from training.sdk import load_family

    if rows is None:
        family = load_family("pin_ranker", params=SMALL_RANKER)
        make, names = family.build_model, list(family.sparse_features())
        std = family.sparse_init_std()
    else:
        assert dim is not None
        make, names, std = (lambda: Toy(rows, dim)), ["ids", "tags"], None
    probe = ts.build_meta(make, names)
    # The largest table (larger than any dense tensor). Guarded row-wise over several ranks only: one rank, or the
    # rank a table is placed on table-wise, holds it whole.
    whole = sharding != "row_wise" or dist.get_world_size() == 1
    limit = 2**62 if whole else max(probe.get_submodule(n).weight.numel() for n in names)
    del probe
    sharded(Toy, ["ids", "tags"], "row_wise")  # warm up: TorchRec's and fbgemm's libraries load on first use
    before = rss_peak()
    guard = NoWholeTable(limit)
    with guard:
        dmp = sharded(make, names, sharding, std)
    after = rss_peak()  # before the copies below
    state = dmp.state_dict()
    return {
        "tables": pieces(state),
        "dense": {k: v.clone() for k, v in state.items() if ".ebc." not in k},
        "rss_before": before, "rss_after": after, "largest": guard.largest, "limit": limit,
    }


def train_and_save(ckpt: str, sharding: str) -> dict[str, Any]:
    from training import checkpoint

    dmp = sharded(Toy, ["ids", "tags"], sharding)
    opt = ts.make_optimizer(dmp, lr=0.01, weight_decay=0.0).optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        ids, tags = torch.randint(0, 41, (8,), generator=gen), torch.randint(0, 13, (8,), generator=gen)
        opt.zero_grad()
        dmp(ids, tags).square().sum().backward()
        opt.step()
        sched.step()
    checkpoint.SAVE_ITEM_BYTES = 5 * 4 * 4  # the tables saved in items of 5 rows, as a large table is cut
    checkpoint.save(ckpt, step=3, epoch=0, examples_seen=48, parts={"model": (dmp, opt, sched)}, is_main=rank == 0,
                    extra={"strategy": "torchrec", "sharding": sharding})
    return {}


def load(ckpt: str, sharding: str) -> dict[str, Any]:
    from training import checkpoint

    dmp = sharded(Toy, ["ids", "tags"], sharding)
    opt = ts.make_optimizer(dmp, lr=0.01, weight_decay=0.0).optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    parts = {"model": (dmp, opt, sched)}
    path = checkpoint.complete_checkpoints(ckpt)[-1][1]
    position = checkpoint.load(path, parts=parts, restore_rng=False)
    return {"position": position, "pieces": pieces({"model": dmp.state_dict(), "optim": opt.state_dict()}),
            "scheduler": sched.state_dict()}


def train_and_export(out: str, root: str, train_day: str, eval_day: str, steps: int, params: dict[str, Any],
                     shardings: list[str]) -> None:
    from training import sharded_export
    from training.data import ExampleStream
    from training.sdk import load_family

    rank = dist.get_rank()
    for sharding in shardings:
        family = load_family("pin_ranker", params=params)
        context = family.prepare(root, [train_day], eval_day)
        names = list(family.sparse_features())
        dmp = sharded(family.build_model, names, sharding, family.sparse_init_std())
        opt = ts.make_optimizer(dmp, lr=0.05, weight_decay=0.0).optimizer
        stream = ExampleStream(root, [train_day], lambda t: family.encode(t, context), batch_size=16,  # noqa: B023
                               dataset=family.dataset, columns=family.columns, seed=1 + rank)
        batches = iter(stream)
        for _ in range(steps):
            inputs = family.finish(next(batches), context)
            opt.zero_grad()
            loss, _ = family.loss(dmp(inputs), inputs)
            loss.backward()
            opt.step()
        sharded_export.export(dmp, names, os.path.join(out, sharding, "model"))
        full = ts.gather_full(dmp, names, family.build_model)
        if full is not None:
            torch.save(full.state_dict(), os.path.join(out, sharding, "gathered.pt"))
        dist.barrier()


def main(argv: list[str]) -> None:
    ts.quiet_library_logs()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    mode, rank = argv[0], dist.get_rank()
    if mode == "build":
        rows = int(argv[3]) if len(argv) > 3 else None
        result = build(argv[1], argv[2], rows, int(argv[4]) if len(argv) > 4 else None)
        out = argv[1]
    elif mode == "export":
        import json

        train_and_export(argv[1], argv[2], argv[3], argv[4], int(argv[5]), json.loads(argv[6]), argv[7:])
        result, out = {}, ""
    elif mode == "save":
        result, out = train_and_save(argv[1], argv[2]), ""
    else:
        result, out = load(argv[1], argv[2]), argv[3]
    if out:
        os.makedirs(out, exist_ok=True)
        torch.save({"world_size": dist.get_world_size(), **result}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
