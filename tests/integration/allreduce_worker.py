"""A tiny distributed worker for backend tests: all-reduce, then exit with the code it is told to."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
out = os.environ["WORKER_OUT"]
with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
    f.write(f"{world} {value.item()}")
sleep = float(os.environ.get("WORKER_SLEEP", "0"))
time.sleep(sleep)
fail_rank = int(os.environ.get("WORKER_FAIL_RANK", "-1"))
dist.destroy_process_group()
sys.exit(int(os.environ.get("WORKER_EXIT", "0")) if rank == fail_rank else 0)
