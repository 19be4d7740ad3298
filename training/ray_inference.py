"""Corpus scoring with Ray Data: ``python -m training.ray_inference --plan URL [--shards 0-7]``.

Scores the shards of a plan of ``training.inference`` as one Ray job, decoupling the CPU work from the model:

- **readers**: Ray tasks (``--reader-cpus`` each) read one piece of the snapshot (rows of one row group), cut
  it into the plan's batches and run the family's ``corpus_inputs`` (the preprocessing, on CPU workers);
- **scorers**: an actor pool (``map_batches`` with ``ActorPoolStrategy``; ``--actors`` actors of
  ``--actor-cpus`` each, or ``--actor-gpus``) that loads the model once per actor and runs ``score_inputs``;
- the **driver** streams the scored batches back in plan order and writes each shard's part as
  ``training.inference`` does, the same rows in the same order (the actors score exactly the plan's batches:
  a model's floats depend on the batch), so :func:`training.inference.publish_plan` checks and publishes
  them alike, and the two engines' parts are interchangeable.

A sharded model's plan (``pin-rows-v1``: a shard is the pins of a range of the model's pin-table rows) is scored
by one Ray task per shard instead (:func:`score_table_rows`), each running the scoring processes' own
``score_plan_shard`` in a fresh worker process, so that each scorer opens only its range's file of the pin table
(an actor pool fed every shard's batches would open them all in every actor); the same parts again.

The pool is sized to leave room for a reader: an actor pool that takes every CPU starves the readers and the job
hangs (seen on 2 CPUs). The cluster: the one named by ``RAY_ADDRESS`` (a KubeRay ``RayJob``'s), else a local one
started here and stopped at the end: ``--cpus`` CPUs, Ray's temporary folder outside the data
(``--temp-dir``, default ``<system temp>/pinflow-ray``), no dashboard, no usage reporting, and token
authentication with a token made for this job and passed in the environment (nothing written under ``~``;
``RAY_AUTH_MODE=disabled`` turns it off). Exit codes as ``core.failures.ExitCode``; one JSON line per shard
written, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from core import storage
from core.arrays import parse_shards
from core.failures import ExitCode, UserError, exit_code_for
from training.inference import (
    PIN_ROWS,
    PartWriter,
    Piece,
    ScoringPlan,
    batch_bounds,
    find_part,
    read_piece,
    read_plan,
    shard_pieces,
    staged_part,
)
from training.runtime import setup_logging

log = logging.getLogger("training.ray_inference")

SHARD, BATCH, ROWS = "_shard", "_batch", "_rows"  # bookkeeping columns beside a batch's inputs and scores
_FAMILIES: dict[str, Any] = {}  # per worker process: the family of a feature spec (the ranker caches its window)


def _family(spec: dict[str, Any]) -> Any:
    from training.sdk import load_family

    key = json.dumps(spec, sort_keys=True, default=str)
    if key not in _FAMILIES:
        _FAMILIES[key] = load_family(str(spec.get("family", "pin_ranker")), str(spec.get("family_module", "")),
                                     spec.get("params"))
    return _FAMILIES[key]


def work_items(plan: ScoringPlan, shards: list[int]) -> list[dict[str, Any]]:
    """One item per piece of each shard, in plan order, with the global number of its first batch."""
    items: list[dict[str, Any]] = []
    batch = 0
    for shard in shards:
        for piece in shard_pieces(plan, shard):
            items.append({"shard": shard, "path": piece.path, "file_index": piece.file_index,
                          "row_group": piece.row_group, "start": piece.start, "stop": piece.stop, "first_batch": batch})
            batch += len(batch_bounds(piece, plan.batch_size))
    return items


def read_and_preprocess(items: dict[str, np.ndarray], plan: ScoringPlan, spec: dict[str, Any]) -> Iterator[dict[str, np.ndarray]]:
    """A reader task: each piece → the plan's batches → the family's ``corpus_inputs``, tagged with the shard,
    the batch's number and its size (so that the scorer can check it got whole batches)."""
    family = _family(spec)
    for i in range(len(items["shard"])):
        piece = Piece(str(items["path"][i]), int(items["file_index"][i]), int(items["row_group"][i]),
                      int(items["start"][i]), int(items["stop"][i]))
        table = read_piece(plan, piece)
        for j, (a, b) in enumerate(batch_bounds(piece, plan.batch_size)):
            inputs = family.corpus_inputs(table.slice(a, b - a), spec, plan.root, plan.ds)
            n = b - a
            yield {**{k: np.asarray(v) for k, v in inputs.items()},
                   SHARD: np.full(n, int(items["shard"][i]), dtype=np.int32),
                   BATCH: np.full(n, int(items["first_batch"][i]) + j, dtype=np.int64),
                   ROWS: np.full(n, n, dtype=np.int64)}


class BatchScorer:
    """An actor of the pool: the model, loaded once; scores each of the plan's batches in a block on its own."""

    def __init__(self, model_uri: str, tracking_uri: str, threads: int) -> None:
        import torch

        from training.inference import Scorer

        if threads:
            torch.set_num_threads(threads)
        self.scorer = Scorer.load(model_uri, tracking_uri)

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        ids = batch[BATCH]
        cuts = [0, *(np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), len(ids)]
        names = [k for k in batch if k not in (SHARD, BATCH, ROWS)]
        tables = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if b - a != int(batch[ROWS][a]):
                raise RuntimeError(f"batch {int(ids[a])} reached a scorer split ({b - a} of {int(batch[ROWS][a])} "
                                   "rows): raise DataContext.target_max_block_size")
            scored = self.scorer.family.score_inputs(self.scorer.module, {k: batch[k][a:b] for k in names},
                                                     self.scorer.spec)
            tables.append(scored.append_column(SHARD, pa.array(batch[SHARD][a:b], pa.int32()))
                          .append_column(BATCH, pa.array(ids[a:b], pa.int64())))
        return pa.concat_tables(tables)


def pool_size(cpus: float, actor_cpus: float, reader_cpus: float, actors: int = 0) -> int:
    """Scoring actors that fit beside one reader task: an actor pool holding every CPU starves the readers."""
    room = math.floor((cpus - reader_cpus) / actor_cpus + 1e-9)
    if actors:
        if actors > room:
            raise UserError(
                f"{actors} scoring actors of {actor_cpus} CPU leave no room for a reader ({reader_cpus} CPU) on "
                f"{cpus:g} CPUs: the readers would starve and the job hang (inference.ray_actors, ray_actor_cpus)"
            )
        return actors
    if room < 1:
        raise UserError(f"{cpus:g} CPUs hold no scoring actor of {actor_cpus} CPU beside a reader of {reader_cpus} CPU "
                        "(inference.ray_actor_cpus, ray_reader_cpus, ray_cpus)")
    return room


def start_ray(cpus: int, temp_dir: str, object_store_mb: int = 0) -> bool:
    """Join the cluster of ``RAY_ADDRESS``, else start a local one; True if started here (stop it after)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    join = bool(os.environ.get("RAY_ADDRESS"))
    if not join and os.environ.get("RAY_AUTH_MODE", "token").lower() == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
        # Token auth as Ray's default for a new cluster, with a token of this job's own in the environment
        # (its processes inherit it) instead of one Ray would write to ~/.ray/auth_token. Set before Ray is
        # imported: it reads the mode then.
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    import ray

    if join:
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING, log_to_driver=True)
        return False
    # Ray puts its sockets at <temp>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store; AF_UNIX paths have
    # at most 107 bytes.
    if len(os.path.abspath(temp_dir)) + len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store") > 107:
        raise UserError(f"Ray's temporary folder {temp_dir} is too long a path for Ray's sockets (at most 107 bytes "
                        "with them): choose a shorter one (inference.ray_temp_dir)")
    os.makedirs(temp_dir, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if object_store_mb:
        kwargs["object_store_memory"] = object_store_mb * 1024 * 1024
    ray.init(num_cpus=cpus or os.cpu_count() or 1, include_dashboard=False, _temp_dir=temp_dir,
             _node_ip_address="127.0.0.1", logging_level=logging.WARNING, log_to_driver=False, **kwargs)
    return True


def score_with_ray(
    plan: ScoringPlan,
    shards: list[int],
    *,
    actors: int = 0,
    actor_cpus: float = 1.0,
    actor_gpus: float = 0.0,
    reader_cpus: float = 0.5,
    threads: int = 1,
) -> dict[str, Any]:
    """Score the plan's ``shards`` that have no part yet on the Ray cluster this process is connected to."""
    import ray
    import ray.data

    from training.inference import load_model

    started = time.monotonic()
    todo = [s for s in shards if find_part(plan, s) is None]
    summary: dict[str, Any] = {"plan_id": plan.plan_id, "engine": "ray", "shards": len(todo),
                               "skipped": len(shards) - len(todo)}
    if not todo:
        return {**summary, "rows": 0, "seconds": 0.0}
    for shard in todo:
        shard_pieces(plan, shard)  # a shard outside the plan fails here
    if plan.sharding == PIN_ROWS:
        return {**summary, **score_table_rows(plan, todo, tasks=actors, task_cpus=actor_cpus, task_gpus=actor_gpus,
                                              threads=threads)}
    _, spec = load_model(plan.model_uri, plan.tracking_uri)  # the feature spec; each actor loads the model
    family = _family(spec)
    if not family.splits_corpus_scoring:
        raise UserError(f"model family {family.name} has no corpus_inputs/score_inputs: score it with engine processes")
    cpus = float(ray.cluster_resources().get("CPU", 0))
    size = pool_size(cpus, actor_cpus, reader_cpus, actors) if not actor_gpus else (actors or 1)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # parts are written in plan order as batches come back
    context.enable_progress_bars = False
    # A batch must reach a scorer whole: never split a block below a few batches of the widest inputs.
    context.target_max_block_size = max(context.target_max_block_size or 0, 512 * 1024 * 1024)
    items = work_items(plan, todo)
    dataset = (
        ray.data.from_items(items, override_num_blocks=len(items))
        .map_batches(read_and_preprocess, batch_size=1, num_cpus=reader_cpus,  # type: ignore[arg-type]
                     fn_kwargs={"plan": plan, "spec": spec})
        .map_batches(BatchScorer, batch_size=None, batch_format="numpy",
                     compute=ray.data.ActorPoolStrategy(size=size),
                     num_cpus=actor_cpus, num_gpus=actor_gpus or None,
                     fn_constructor_kwargs={"model_uri": plan.model_uri, "tracking_uri": plan.tracking_uri,
                                            "threads": threads})
    )
    log.info("scoring %d shard(s) of plan %s with Ray: %d actor(s) of %s CPU, readers of %s CPU, %g CPUs",
             len(todo), plan.plan_id, size, actor_cpus, reader_cpus, cpus)
    writer: PartWriter | None = None
    rows = 0
    written = []

    def finish(w: PartWriter) -> None:
        data, record = w.finish(seconds=0.0, engine="ray")
        storage.write_bytes(staged_part(plan, w.shard), data)
        written.append(w.shard)
        print(json.dumps({"plan_id": plan.plan_id, "shard": w.shard, "rows": record["rows"],
                          "ids_checksum": record["ids_checksum"], "path": staged_part(plan, w.shard),
                          "engine": "ray", "skipped": False}), flush=True)

    for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        block: pa.Table = batch  # type: ignore[assignment]
        shard_ids = block.column(SHARD).to_numpy()
        batch_ids = block.column(BATCH).to_numpy()
        cuts = [0, *(np.flatnonzero(batch_ids[1:] != batch_ids[:-1]) + 1).tolist(), len(batch_ids)]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            shard = int(shard_ids[a])
            if writer is None or writer.shard != shard:
                if writer is not None:
                    finish(writer)
                writer = PartWriter(plan, shard, family.corpus_schema)
            writer.add(block.slice(a, b - a).drop_columns([SHARD, BATCH]))
            rows += b - a
    if writer is not None:
        finish(writer)
    empty = [s for s in todo if s not in written]  # shards of no rows (more shards than pins)
    for shard in empty:
        finish(PartWriter(plan, shard, family.corpus_schema))
    seconds = time.monotonic() - started
    return {**summary, "rows": rows, "seconds": round(seconds, 3), "actors": size,
            "pins_per_s": round(rows / seconds, 1) if seconds else None}


def _score_shard_task(plan: ScoringPlan, shard: int, threads: int) -> dict[str, Any]:
    """A Ray task: one shard of a ``pin-rows-v1`` plan scored as a scoring process scores it."""
    import torch

    from training.inference import score_plan_shard

    if threads:
        torch.set_num_threads(threads)
    return score_plan_shard(plan, shard, engine="ray")


def score_table_rows(
    plan: ScoringPlan, shards: list[int], *, tasks: int = 0, task_cpus: float = 1.0, task_gpus: float = 0.0,
    threads: int = 1,
) -> dict[str, Any]:
    """Score the ``shards`` of a sharded model's plan (``pin-rows-v1``): one Ray task per shard.

    A shard is the pins whose rows of the model's pin table are in its range, so the scorer that loads the model
    must be the one that scores exactly those pins: an actor pool fed batches of every shard would open every
    pin-table file in every actor. Each task runs :func:`training.inference.score_plan_shard`, the scoring
    processes' own code (its reader thread preprocesses the next batches while the model scores), in a worker
    process of its own (``max_calls=1``: the part's ``peak_rss_mib`` is that scorer's, and the model's files
    are closed with it), and writes the same part. ``tasks``: at most that many at once (0: as many as the
    cluster's CPUs hold).
    """
    import ray

    cluster = ray.cluster_resources()
    for wanted, kind, setting in ((task_cpus, "CPU", "inference.ray_actor_cpus, ray_cpus"),
                                  (task_gpus, "GPU", "--actor-gpus")):
        if wanted > float(cluster.get(kind, 0)):
            raise UserError(f"a scoring task of {wanted:g} {kind} does not fit the cluster's {float(cluster.get(kind, 0)):g} "
                            f"{kind}s: it would wait forever ({setting})")
    started = time.monotonic()
    remote = ray.remote(num_cpus=task_cpus, num_gpus=task_gpus, max_calls=1)(_score_shard_task)
    waiting, parts = list(shards), []
    running: list[Any] = []
    log.info("scoring %d shard(s) of plan %s (%s) with Ray: a task of %s CPU per shard%s", len(shards),
             plan.plan_id, PIN_ROWS, task_cpus, f", {tasks} at once" if tasks else "")
    try:
        while waiting or running:
            while waiting and (not tasks or len(running) < tasks):
                running.append(remote.remote(plan, waiting.pop(0), threads))
            done, running = ray.wait(running, num_returns=1)
            record = ray.get(done[0])  # a task's error is raised here, as its own class (a DataError stays one)
            parts.append({k: record.get(k) for k in ("plan_id", "shard", "rows", "ids_checksum", "path", "engine",
                                                     "skipped", "model_files")})
            print(json.dumps(parts[-1]), flush=True)
    except BaseException:
        for ref in running:  # no part written after the job has failed (a retry scores what is missing)
            ray.cancel(ref, force=True)
        raise
    seconds = time.monotonic() - started
    rows = sum(int(p["rows"] or 0) for p in parts)
    return {"rows": rows, "seconds": round(seconds, 3), "tasks": len(shards),
            "pins_per_s": round(rows / seconds, 1) if seconds else None,
            "parts": sorted(parts, key=lambda p: int(p["shard"]))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.ray_inference",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--plan", required=True, help="the plan file (_PLAN.json) of training.inference")
    parser.add_argument("--shards", help="shards of the plan to score, e.g. 0,3,5-7 (default: all)")
    parser.add_argument("--cpus", type=int, default=0, help="CPUs of a local cluster started here (0: the machine's)")
    parser.add_argument("--actors", type=int, default=0, help="scoring actors (0: as many as fit beside a reader); a "
                        "sharded model's plan: scoring tasks at once (0: as many as the cluster holds)")
    parser.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs one scoring actor (or task) reserves")
    parser.add_argument("--actor-gpus", type=float, default=0.0, help="GPUs one scoring actor (or task) reserves")
    parser.add_argument("--reader-cpus", type=float, default=0.5, help="CPUs one read-and-preprocess task reserves")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of an actor (default: the plan's)")
    parser.add_argument("--temp-dir", default="", help="Ray's temporary folder (default: <system temp>/pinflow-ray)")
    parser.add_argument("--object-store-mb", type=int, default=0, help="object store of a local cluster (0: Ray's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(0)
    started_here = False
    try:
        plan = read_plan(args.plan)
        shards = parse_shards(args.shards) if args.shards else list(range(plan.num_shards))
        temp_dir = args.temp_dir or os.path.join(tempfile.gettempdir(), "pinflow-ray")
        root = plan.root
        if not storage.is_remote(root) and os.path.abspath(temp_dir).startswith(os.path.abspath(root) + os.sep):
            raise UserError(f"Ray's temporary folder {temp_dir} is under the storage root {root}: move it "
                            "(inference.ray_temp_dir)")
        started_here = start_ray(args.cpus, temp_dir, args.object_store_mb)
        summary = score_with_ray(plan, shards, actors=args.actors, actor_cpus=args.actor_cpus,
                                 actor_gpus=args.actor_gpus, reader_cpus=args.reader_cpus,
                                 threads=args.threads if args.threads is not None else plan.threads)
        print(json.dumps(summary), flush=True)
        return int(ExitCode.OK)
    except Exception as exc:
        code = exit_code_for(exc)
        log.error("Ray inference failed (%s, exit %d): %s", code.name, int(code), exc, exc_info=exc)
        return int(code)
    finally:
        if started_here:
            import ray

            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
