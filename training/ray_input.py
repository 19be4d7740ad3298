"""Decoupled preprocessing on Ray Data: a rank's training batches built on CPU workers (``input_engine: ray``).

The last mile of a rank's input (reading its example row groups, shuffling them, resolving the users' action
sequences, the family's ``encode`` into tensors) runs as a streaming Ray Data pipeline on the cluster's CPU
workers; the trainer only joins finished pieces into batches and trains. This is the design of the reference
platform's Ray preprocessing (a 2x training speed-up there), in the platform's terms:

- **the same batches as the local engine.** Each rank builds its own pipeline over the work units the platform's
  plan gives it (``ExampleStream.rank_units`` with one reader: the order of the local engine at
  ``num_workers: 0``), with Ray Data's ``preserve_order``. A unit (a whole row group) is read and decoded once, by
  one task, shuffled as the local engine shuffles it, cut at the rank's batch boundaries (batch b is rows
  [b x batch_size, (b + 1) x batch_size) of the rank's rows in order), and each piece encoded by the family, whose
  ``encode`` is row-wise: a batch encoded in pieces and joined equals the batch encoded whole. So which batches a
  rank sees, and in which order, depends on neither the number of Ray workers nor which finishes first;
- **exact resume.** Ray's own iterators are not fault tolerant (ray-project/ray#37633, #48224) and are not asked to
  be: a try builds the pipeline of an epoch from its checkpoint's position (the epoch and the batches done), and the
  units wholly before it are not read. Only the batches a rank trains on are built (the tail past the epoch's
  common step count is never read);
- **why not ``streaming_split``** (or Ray Train's ``get_dataset_shard``, built on it): it hands blocks to the ranks
  as they are ready, which balances load but makes which rows a rank gets, and their order, a matter of timing; the
  order of a rank's batches is part of what a checkpoint resumes and of what a bitwise test compares;
- **failures.** A task whose worker dies is retried by Ray (``max_retries``); a cluster that is gone fails the
  rank as INFRA, and the job's retry resumes from its checkpoint with the same batches in the same order.

The cluster is the one ``RAY_ADDRESS`` names (on EKS a KubeRay RayCluster beside the TrainJob, its CPU workers on
other nodes), else each node's local rank 0 starts one on its node (local, AWS Batch: the node's own CPUs,
``training.ray_cpus``), which the node's other ranks join; it stops with that rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.failures import ConfigError, InfraError
from training.config import RunConfig
from training.data import ExampleStream, UnitReader, WorkUnit

log = logging.getLogger("training.ray_input")

BATCH, ROWS = "_batch", "_rows"  # bookkeeping columns of a piece: its batch's number and that batch's size
_WORKER_STATE: dict[str, tuple[UnitReader, Any]] = {}  # per Ray worker process: a run's reader and encode


def batch_pieces(unit_rows: Sequence[int], batch_size: int, drop_last: bool, skip: int, limit: int
                 ) -> list[list[tuple[int, int, int, int]]]:
    """For each unit (rows ``unit_rows[i]``, in order), the pieces ``(batch, lo, hi, batch_rows)`` it holds of the
    rank's batches ``skip`` to ``limit - 1``: its rows [lo, hi) are rows of batch ``batch``, which has
    ``batch_rows`` rows in all. Batches as the local engine cuts them: ``batch_size`` rows of the units' rows in
    order, the last one short unless ``drop_last``."""
    total = int(sum(unit_rows))
    last = total // batch_size if drop_last else -(-total // batch_size)
    limit = min(limit, last)
    pieces: list[list[tuple[int, int, int, int]]] = []
    offset = 0
    for rows in unit_rows:
        mine = []
        row = max(offset, skip * batch_size)
        while row < offset + rows and row // batch_size < limit:
            batch = row // batch_size
            end = min(offset + rows, (batch + 1) * batch_size)
            mine.append((batch, row - offset, end - offset, min(batch_size, total - batch * batch_size)))
            row = end
        pieces.append(mine)
        offset += rows
    return pieces


def _worker_state(run: dict[str, Any], reader: dict[str, Any]) -> tuple[UnitReader, Any]:
    """A run's unit reader and encode in this worker process, made once (the family's context is loaded once)."""
    key = json.dumps({"run": run, "reader": reader}, sort_keys=True, default=str)
    if key not in _WORKER_STATE:
        config = RunConfig.from_dict(run)
        family = config.family_instance()
        context = family.prepare(config.input_root, list(config.train_days), config.eval_ds)
        _WORKER_STATE.clear()  # one run at a time per worker: a new run's state replaces the last one's
        _WORKER_STATE[key] = (UnitReader(**reader), lambda table: family.encode(table, context))
    return _WORKER_STATE[key]


def read_and_encode(items: dict[str, np.ndarray], run: dict[str, Any], reader: dict[str, Any], epoch: int
                    ) -> Iterator[dict[str, np.ndarray]]:
    """A Ray task: each unit read and decoded once, shuffled, its sequences resolved, cut into its pieces of the
    rank's batches and each piece encoded; the pieces as numpy arrays, tagged with their batch and its size."""
    units, encode = _worker_state(run, reader)
    for i in range(len(items["path"])):
        unit = WorkUnit(str(items["path"][i]), int(items["row_group"][i]), int(items["start"][i]),
                        int(items["stop"][i]), str(items["ds"][i]))
        table = units.read(unit, epoch, int(items["key"][i]))
        for batch, lo, hi, batch_rows in json.loads(str(items["pieces"][i])):
            tensors = encode(table.slice(lo, hi - lo))
            n = hi - lo
            yield {**{name: t.numpy() for name, t in tensors.items()},
                   BATCH: np.full(n, batch, dtype=np.int64), ROWS: np.full(n, batch_rows, dtype=np.int64)}


@contextlib.contextmanager
def trainer_random_kept() -> Iterator[None]:
    """Ray's client code in the trainer draws from Python's and NumPy's global random generators (ids, ports):
    their states are put back after it, so the trainer's (saved in every checkpoint) do not depend on the input
    engine, nor on how often a resumed run talked to Ray."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _to_tensors(block: dict[str, np.ndarray], a: int, b: int) -> dict[str, torch.Tensor]:
    """Rows [a, b) of a block as tensors of their own (a block's arrays are read-only views of Ray's object store)."""
    return {name: torch.from_numpy(np.array(values[a:b])) for name, values in block.items()
            if name not in (BATCH, ROWS)}


@dataclass
class RayExampleBatches:
    """A rank's batches of an epoch from a Ray Data pipeline (see the module docstring).

    ``stream`` is the rank's :class:`~training.data.ExampleStream` planned with one reader (``num_workers`` 0):
    its plan says which units, in which order; ``run`` the run's RUN.json content (the workers build the family's
    encode from it); ``cpus_per_task`` what a read-and-encode task reserves; ``prefetch`` the batches taken ahead.
    """

    stream: ExampleStream
    run: dict[str, Any]
    cpus_per_task: float = 1.0
    prefetch: int = 2

    def batches(self, epoch: int, skip: int, limit: int) -> Iterator[dict[str, torch.Tensor]]:
        """Batches ``skip`` to ``limit - 1`` of this rank's ``epoch``, in order."""
        import ray.data

        stream = self.stream
        if stream.num_workers:
            raise ConfigError("input_engine ray plans each rank with one reader: the stream must have num_workers 0")
        units = stream.rank_units(epoch)
        pieces = batch_pieces([u.rows for u in units], stream.batch_size, stream.drop_last, skip, limit)
        items = [{"path": u.path, "row_group": u.row_group, "start": u.start, "stop": u.stop, "ds": u.ds,
                  "key": stream.unit_key(u), "pieces": json.dumps(p)}
                 for u, p in zip(units, pieces, strict=True) if p]
        if not items:
            return
        with trainer_random_kept():
            context = ray.data.DataContext.get_current()
            context.execution_options.preserve_order = True  # the rank's batches in the plan's order
            context.enable_progress_bars = False
            # A piece is at most one batch: blocks stay whole pieces or bundles of them, never split below a batch.
            context.target_max_block_size = max(context.target_max_block_size or 0, 512 * 1024 * 1024)
            dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
                read_and_encode, batch_size=1, num_cpus=self.cpus_per_task, max_retries=3,  # type: ignore[arg-type]
                fn_kwargs={"run": self.run, "reader": stream.reader().spec(), "epoch": epoch},
            )
            blocks = iter(dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=self.prefetch))
        pending: list[dict[str, torch.Tensor]] = []
        have, want, current = 0, 0, skip
        try:
            while True:
                with trainer_random_kept():
                    block = next(blocks, None)
                if block is None:
                    break
                ids = block[BATCH]
                cuts = [0, *(np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), len(ids)]
                for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                    batch = int(ids[a])
                    if batch != current:
                        raise RuntimeError(f"Ray input: batch {batch} arrived while batch {current} was incomplete")
                    pending.append(_to_tensors(block, a, b))
                    have, want = have + (b - a), int(block[ROWS][a])
                    if have == want:
                        yield pending[0] if len(pending) == 1 else {
                            name: torch.cat([p[name] for p in pending]) for name in pending[0]}
                        pending, have, current = [], 0, current + 1
        except (ray.exceptions.RayError, ConnectionError) as err:  # the cluster or its workers are gone
            raise InfraError(f"the Ray input pipeline of epoch {epoch} failed: {err}") from err
        expected = max(piece[0] for unit in pieces for piece in unit) + 1
        if current != expected:
            raise InfraError(f"the Ray input pipeline of epoch {epoch} ended at batch {current}, before {expected}")


def connect(local_rank: int, exchange: Any, cpus: int, temp_dir: str) -> bool:
    """Join this job's Ray cluster: ``RAY_ADDRESS``'s, else the one local rank 0 of this node starts (True there:
    it stops with that rank). ``exchange(value)`` shares local rank 0's address and token with the node's other
    ranks (an all-gather over the job's process group); every rank calls it."""
    with trainer_random_kept():
        return _connect(local_rank, exchange, cpus, temp_dir)


def _connect(local_rank: int, exchange: Any, cpus: int, temp_dir: str) -> bool:
    from training.ray_inference import start_ray

    if os.environ.get("RAY_ADDRESS"):
        exchange(None)
        start_ray(cpus, temp_dir)
        return False
    started, address = False, None
    if local_rank == 0:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if os.environ["RAY_AUTH_MODE"].lower() == "token":
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        try:
            started = start_ray(cpus, temp_dir)
        except Exception as err:
            exchange(None)
            raise InfraError(f"could not start the node's Ray cluster for input_engine ray: {err}") from err
        import ray

        address = {"address": ray.get_runtime_context().gcs_address, "token": os.environ.get("RAY_AUTH_TOKEN", ""),
                   "mode": os.environ.get("RAY_AUTH_MODE", "")}
    shared = exchange(address)
    if local_rank != 0:
        if not shared:
            raise InfraError("the node's Ray cluster for input_engine ray did not start (see local rank 0's log)")
        os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = shared["mode"], shared["token"]
        import ray  # after the variables: Ray reads its auth mode when it is imported

        ray.init(address=shared["address"], logging_level=logging.WARNING, log_to_driver=False)
    return started
