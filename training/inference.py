"""Batch inference over the pin corpus, exact under any re-run: ``python -m training.inference``.

A **plan** fixes what one run scores: a model version, the ``raw/pins`` snapshot of a day (its files, their
row groups and a fingerprint of them) and its cut into ``num_shards`` contiguous row ranges (shard *i* holds
the rows ``[start_i, stop_i)`` of the snapshot in file and row-group order, so that a shard reads only its
own row groups; a model exported sharded, ``training.sharded_export``: the pins whose rows of the model's pin
table are in ``[start_i, stop_i)``, sharding ``pin-rows-v1``, so that a shard reads only those rows of the model). The plan's id digests all of that and the batch size (a model's floats depend on how rows
are batched), and every part is written under it, ``<out-dir>/_plans/<plan_id>/part-NNNNN.parquet``: a part of
another plan (another shard count, snapshot or model) is never taken for one of this plan. Each part is one
atomic write (a local temporary file and a rename, or one PUT on S3) carrying its plan id, row count and a
checksum of its pin ids in the Parquet footer; a shard whose part exists is skipped, so a retry scores only
what is missing, and a shard killed half-way left nothing behind. An incremental snapshot (a day holding only
the pins that changed, ``core.storage.snapshot_days``) is merged once into a view file under ``_plans/_views/``
that the plan cuts instead (:func:`snapshot`).

Scoring goes through the family's ``score_corpus`` (``training.sdk``): the ranker writes each pin's prior
engagement probabilities in a non-personalised context; the content model ``p_unsafe``, the topic
distribution and the content embedding. ``training.ray_inference`` scores the same plan with Ray Data and
writes the same parts, row for row.

:func:`publish_plan` (``--publish``) checks that every pin of the snapshot is in exactly one part (per part:
the plan id, the row count and the pin-id checksum of its row range, recomputed from the snapshot), moves the
parts to ``<out-dir>/part-NNNNN.parquet`` (replacing any earlier output) and writes ``_MANIFEST.json`` last,
with the counts, checksums and the measured throughput. Readers use only manifested outputs. Exit codes as
``core.failures.ExitCode``.

Made by hand from options (``--model-uri``, ``--ds``, ...), a plan scores the version its ``--model-uri`` names
when it is made: an alias (``models:/name@champion``) or ``latest`` is resolved first (:func:`pinned_model`), so a
move of the alias between two scorers cannot mix two models in one output. A plan read with ``--plan`` is checked
against its id (an edited plan is refused). Two scorers of one shard on local storage: the second waits for the
first and takes its part.

A job scores the shards named by ``--shards``; in an array job (an AWS Batch array job, a Kubernetes Indexed
Job, the local backend's parallel processes) the array index (``PINFLOW_ARRAY_INDEX``,
``AWS_BATCH_JOB_ARRAY_INDEX`` or ``JOB_COMPLETION_INDEX``) picks one of them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core import storage
from core.arrays import parse_shards, shards_of_this_process
from core.contracts import RAW_PINS
from core.failures import DataError, ExitCode, FailureClass, PinflowError, UserError, classify, exit_code_for
from training.runtime import peak_rss_bytes, setup_logging

log = logging.getLogger("training.inference")

MANIFEST = "_MANIFEST.json"
PLANS_DIR = "_plans"  # readers skip names that start with "_" (pyarrow datasets, Spark, the manifest)
PLAN_FILE = "_PLAN.json"
VIEWS_DIR = "_views"  # under PLANS_DIR: merged incremental snapshots
PART_METADATA_KEY = "pinflow.part"
SHARDING = "rows-v1"  # contiguous row ranges of the snapshot in file and row-group order
# A sharded model's plan: shard i scores the pins whose rows of the family's corpus table (the ranker's pin table)
# are in [start_i, stop_i), so that it reads only the export's files of those rows (training.sharded_export).
PIN_ROWS = "pin-rows-v1"
SHARDED_METADATA = "pinflow_sharded"  # a sharded model's pointer in its MLflow metadata (location, sha256, tables)
# A sharded model version's tag: the rows of its family's corpus table (the corpus plan's table_rows; absent: 0).
SHARDED_ROWS_TAG = "pinflow.sharded_table_rows"
# The columns of the pin snapshot a family's score_corpus may read.
PIN_COLUMNS = ["pin_id", "embedding", "category", "creator_id", "image_embedding", "text_tokens"]
ROW_GROUP_ROWS = 64 * 1024  # rows per row group of a part
# Fault injection for tests (as training's debug_step_sleep_s): seconds to sleep after each scored batch, so that
# a test can kill a scoring process half-way through its shard. Unset: no sleep.
DEBUG_SLEEP_VARIABLE = "PINFLOW_INFERENCE_DEBUG_BATCH_SLEEP_S"


class MissingPartsError(DataError, FileNotFoundError):
    """Publishing found parts missing or wrong: score those shards (again) first."""


def part_name(shard: int) -> str:
    return f"part-{shard:05d}.parquet"


def _digest(obj: Any, length: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


# --- pin-id checksums ------------------------------------------------------------------------------------------

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id: a well-spread 64-bit hash (uint64 arithmetic wraps)."""
    z = ids.astype(np.int64, copy=False).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def ids_checksum(ids: np.ndarray, start: int = 0) -> int:
    """An order-independent checksum of pin ids: the sum of their splitmix64 hashes modulo 2**64.

    With the count it tells a part holding exactly the pins of its row range from one with a pin missing,
    duplicated or swapped. ``start`` continues a running checksum.
    """
    with np.errstate(over="ignore"):
        total = int(_mix(np.asarray(ids)).sum(dtype=np.uint64)) if len(ids) else 0
    return (start + total) & 0xFFFFFFFFFFFFFFFF


def checksum_hex(value: int) -> str:
    return f"{value:016x}"


# --- the snapshot and the plan ---------------------------------------------------------------------------------


def _version(path: str) -> str:
    """What changes when a file is rewritten: its S3 ETag, or its local modification time."""
    if storage.is_remote(path):
        fs, key = storage.filesystem(path)
        info = fs.info(key)
        return str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")
    return str(os.stat(storage.local_path(path)).st_mtime_ns)


def _file_entries(paths: list[str]) -> list[dict[str, Any]]:
    """Each file's name, version, rows per row group and the pin columns it has (from the Parquet footers)."""
    files = []
    for path in paths:
        with storage.parquet_file(path) as parquet:
            meta = parquet.metadata
            row_groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            names = parquet.schema_arrow.names
        if "pin_id" not in names:
            raise DataError(f"{path} has no column pin_id: not a {RAW_PINS} file")
        files.append({"file": storage.name_of(path), "version": _version(path), "row_groups": row_groups,
                      "columns": [c for c in PIN_COLUMNS if c in names]})
    return files


def _day_files(root: str, day: str) -> list[str]:
    try:
        paths = storage.data_files(root, RAW_PINS, day)
    except FileNotFoundError as e:
        raise DataError(str(e)) from None
    if not paths:
        raise DataError(f"{RAW_PINS} partition ds={day} under {root} has a marker but no Parquet file")
    return paths


def snapshot(root: str, ds: str, views: str | None = None) -> dict[str, Any]:
    """The ``raw/pins`` snapshot as of ``ds``: each file's name, size, version and rows per row group, the pin
    count and a fingerprint of all of it (read from the Parquet footers; no data is read).

    An incremental snapshot (``core.storage.snapshot_days``: the newest full partition and the increments after
    it) is merged once (``core.storage.read_snapshot``, one row per pin, the newest winning, by pin id) into a
    *view* file under ``views/<fingerprint>/``, which the plan then cuts like a full partition's files;
    the fingerprint is that of every partition's files, so a re-landed increment makes another plan.
    """
    if not storage.is_complete(root, RAW_PINS, ds):
        _day_files(root, ds)  # raises DataError naming the partition
    days = storage.snapshot_days(root, RAW_PINS, ds)
    if len(days) <= 1:
        files = _file_entries(_day_files(root, ds))
        pins = sum(sum(f["row_groups"]) for f in files)
        return {"ds": ds, "files": files, "pins": pins, "fingerprint": _digest({"ds": ds, "files": files}, 24)}
    sources = {day: _file_entries(_day_files(root, day)) for day in days}
    fingerprint = _digest({"ds": ds, "days": sources}, 24)
    if views is None:
        raise UserError(f"{RAW_PINS} ds={ds} is an incremental snapshot (over {days[0]}..{days[-1]}): its merged view "
                        "needs a folder (views)")
    location = storage.join(views, fingerprint, "view.parquet")
    if not storage.exists(location):
        columns = [c for c in PIN_COLUMNS if all(c in f["columns"] for fs in sources.values() for f in fs)]
        table, _ = storage.read_snapshot(root, RAW_PINS, ds, "pin_id", columns)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS)
        storage.write_bytes(location, sink.getvalue().to_pybytes())  # atomic: a concurrent planner writes the same
        log.info("merged the incremental %s snapshot ds=%s (%s) into %s: %d pins", RAW_PINS, ds, ", ".join(days),
                 location, table.num_rows)
    view = _file_entries([location])[0]
    view.update({"version": fingerprint, "path": location})  # the merge's content is the sources' fingerprint
    return {"ds": ds, "files": [view], "pins": sum(view["row_groups"]), "fingerprint": fingerprint, "days": days}


def file_location(plan: ScoringPlan, entry: dict[str, Any]) -> str:
    """Where a file of the plan's snapshot is: a merged view's own path, else in the day's partition (its published
    version's folder on an object store, ``core.storage.partition_folder``)."""
    return str(entry.get("path") or storage.join(storage.partition_folder(plan.root, RAW_PINS, plan.ds),
                                                 entry["file"]))


@dataclasses.dataclass(frozen=True)
class ShardRows:
    """Shard ``shard`` of a plan: the rows ``[start, stop)`` of the snapshot (sharding ``rows-v1``), or of the
    model's corpus table (``pin-rows-v1``: the pins whose ids map to those rows)."""

    shard: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class ScoringPlan:
    """What one run scores (see the module doc): written by the operator beside its parts (``_PLAN.json``), read
    by every scoring job, whichever the backend and engine. ``snapshot`` is :func:`snapshot`'s record."""

    plan_id: str
    model_uri: str
    tracking_uri: str
    root: str
    ds: str
    out_dir: str
    parts_dir: str
    num_shards: int
    batch_size: int
    threads: int
    sharding: str
    pins: int
    snapshot: dict[str, Any]
    shards: tuple[ShardRows, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "shards": [dataclasses.asdict(s) for s in self.shards]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScoringPlan:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["threads"] = int(data.get("threads", 1))
        values["shards"] = tuple(ShardRows(int(s["shard"]), int(s["start"]), int(s["stop"])) for s in data["shards"])
        return cls(**values)


def split_rows(total: int, num_shards: int) -> list[tuple[int, int]]:
    """``num_shards`` contiguous row ranges covering ``[0, total)``, their sizes differing by at most one."""
    return [(i * total // num_shards, (i + 1) * total // num_shards) for i in range(num_shards)]


def row_blocks(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """``num_shards`` ranges of a table's ``rows`` in blocks of ceil(rows / num_shards), as TorchRec cuts a table
    row-wise: with as many shards as training ranks, each scorer reads exactly one rank's file of the table."""
    block = -(-rows // num_shards)
    return [(min(i * block, rows), min((i + 1) * block, rows)) for i in range(num_shards)]


def make_plan(
    *,
    model_uri: str,
    tracking_uri: str,
    root: str,
    ds: str,
    out_dir: str | os.PathLike[str],
    num_shards: int,
    batch_size: int = 4096,
    threads: int = 1,
    snap: dict[str, Any] | None = None,
    table_rows: int = 0,
) -> ScoringPlan:
    """The plan of scoring the snapshot of ``ds`` with ``model_uri`` in ``num_shards`` shards (see the module doc).

    Deterministic: the same model, snapshot, shard count and batch size give the same plan id. ``snap``: the
    :func:`snapshot` already read for this output folder (else it is read now). ``table_rows``: the rows of a
    sharded model's corpus table (its version's tag ``SHARDED_ROWS_TAG``): the shards are then ranges of those
    rows (``pin-rows-v1``).
    """
    if num_shards < 1:
        raise UserError(f"num_shards={num_shards}: need at least one shard")
    if batch_size < 1:
        raise UserError(f"batch_size={batch_size}: need at least one pin per batch")
    out = os.fspath(out_dir)
    snap = snap or snapshot(root, ds, views_dir(out))
    sharding = PIN_ROWS if table_rows else SHARDING
    key = {"model_uri": model_uri, "ds": ds, "snapshot": snap["fingerprint"], "num_shards": num_shards,
           "sharding": sharding, "batch_size": batch_size, **({"table_rows": table_rows} if table_rows else {})}
    plan_id = _digest(key)
    return ScoringPlan(
        plan_id=plan_id, model_uri=model_uri, tracking_uri=tracking_uri, root=root, ds=ds, out_dir=out,
        parts_dir=storage.join(out, PLANS_DIR, plan_id), num_shards=num_shards, batch_size=batch_size, threads=threads,
        sharding=sharding, pins=int(snap["pins"]), snapshot=snap,
        shards=tuple(ShardRows(i, a, b) for i, (a, b) in enumerate(
            row_blocks(table_rows, num_shards) if table_rows else split_rows(snap["pins"], num_shards))),
    )


_REGISTRY_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>[^/]+)|@(?P<alias>[^/]+))")


def is_pinned(model_uri: str) -> bool:
    """A registry URI of one version number (``models:/name/N``), or a URI that is not the registry's."""
    match = _REGISTRY_URI.fullmatch(model_uri)
    return match is None or (match["version"] or "").isdigit()


def pinned_model(model_uri: str, tracking_uri: str) -> tuple[str, int]:
    """``model_uri`` as the version of the registry it names now (an alias or ``latest``: ``models:/name/N``), and
    the rows of that version's corpus table when it was exported sharded (its ``SHARDED_ROWS_TAG``; else 0). A plan
    keys its parts by this URI: planned by an alias, two scorers of one plan would score with whichever version the
    alias named at each start, and the publish would mix them. Other URIs (``runs:/...``, a path) are kept."""
    match = _REGISTRY_URI.fullmatch(model_uri)
    if match is None:
        return model_uri, 0
    if tracking_uri.startswith("sqlite:///") and not os.path.exists(tracking_uri.removeprefix("sqlite:///")):
        raise UserError(f"no MLflow database at {tracking_uri.removeprefix('sqlite:///')} (--tracking-uri "
                        f"{tracking_uri}): give the tracking URI the model was registered with")
    from mlflow import MlflowClient

    from core.model_versions import model_version

    registry = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    name, ref = match["name"], match["alias"] or match["version"]
    if ref == "latest":
        versions = registry.search_model_versions(f"name='{name}'")
        if not versions:
            raise UserError(f"model {name} has no registered version in {tracking_uri}: check the model's name")
        ref = str(max(int(v.version) for v in versions))
    version = model_version(registry, name, ref)
    if ref != str(version.version):
        log.info("%s is version %s now: the plan scores that version", model_uri, version.version)
    return f"models:/{name}/{version.version}", int((version.tags or {}).get(SHARDED_ROWS_TAG) or 0)


def views_dir(out_dir: str | os.PathLike[str]) -> str:
    """Where merged views of incremental snapshots go: beside the plans (removed with them once published)."""
    return storage.join(os.fspath(out_dir), PLANS_DIR, VIEWS_DIR)


def plan_location(plan: ScoringPlan) -> str:
    return storage.join(plan.parts_dir, PLAN_FILE)


def write_plan(plan: ScoringPlan) -> str:
    """Write the plan beside its parts (the jobs read it); return where."""
    location = plan_location(plan)
    storage.write_json(location, plan.to_dict())
    return location


def read_plan(location: str) -> ScoringPlan:
    """The plan at ``location``; a MissingPartsError when it is gone (published, or removed by a later run), a
    UserError when the path cannot be a plan's or the file is not one."""
    try:
        data = storage.read_json(location)
    except FileNotFoundError:
        raise _plan_not_found(location) from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as err:
        raise UserError(f"cannot read scoring plan {location}: {err}; --plan is <out-dir>/{PLANS_DIR}/<plan id>/"
                        f"{PLAN_FILE}") from None
    except ValueError as err:  # not JSON, or not UTF-8
        raise UserError(f"scoring plan {location} is not a plan file ({err}): remove it and plan the run again") from None
    try:
        plan = ScoringPlan.from_dict(data)
        made = make_plan(model_uri=plan.model_uri, tracking_uri=plan.tracking_uri, root=plan.root, ds=plan.ds,
                         out_dir=plan.out_dir, num_shards=plan.num_shards, batch_size=plan.batch_size,
                         threads=plan.threads, snap=plan.snapshot,
                         table_rows=plan.shards[-1].stop if plan.sharding == PIN_ROWS and plan.shards else 0)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError, UserError) as err:
        raise UserError(
            f"scoring plan {location} is not a plan file ({type(err).__name__}: {err}): remove it and plan the run again"
        ) from None
    if (made.plan_id, made.shards, made.parts_dir, made.sharding, made.pins) != (
            plan.plan_id, plan.shards, plan.parts_dir, plan.sharding, plan.pins):
        # Its parts are keyed by the plan id: a plan edited by hand (another model, other shards) would publish parts
        # scored by another model, or index shards it does not have.
        raise UserError(f"scoring plan {location} does not match its id {plan.plan_id} (edited since it was made?): "
                        "remove its folder and plan the run again")
    return plan


def _plan_not_found(location: str) -> Exception:
    """Why there is no plan at ``location`` (``<out_dir>/_plans/<plan_id>/_PLAN.json``): published, removed, or a path
    that never held one."""
    parts = location.rstrip("/").split("/")
    if len(parts) < 4 or parts[-1] != PLAN_FILE or parts[-3] != PLANS_DIR:
        return UserError(f"no scoring plan at {location}: a plan is <out-dir>/{PLANS_DIR}/<plan id>/{PLAN_FILE}; "
                         "check --plan")
    out_dir, plan_id = "/".join(parts[:-3]), parts[-2]
    if not storage.exists(out_dir):
        return UserError(f"no scoring plan at {location}: {out_dir} does not exist; check --plan")
    manifest = storage.join(out_dir, MANIFEST)
    with contextlib.suppress(FileNotFoundError, ValueError):
        if storage.read_json(manifest).get("plan_id") == plan_id:
            return MissingPartsError(f"scoring plan {plan_id} was published ({manifest}): nothing is left to score; "
                                     "plan a new run to score again")
    return MissingPartsError(f"scoring plan {location} is gone (removed by a later run, or never written): "
                             "plan the run again")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of one row group of one snapshot file: a shard is a few of them."""

    path: str
    file_index: int
    row_group: int
    start: int
    stop: int


def shard_pieces(plan: ScoringPlan, shard: int) -> list[Piece]:
    """The pieces of the snapshot that make up ``shard``, in order."""
    if not 0 <= shard < plan.num_shards:
        raise UserError(f"shard {shard} is not in [0, {plan.num_shards}) of plan {plan.plan_id}")
    # pin-rows-v1: a shard's pins are anywhere in the snapshot; it reads every piece and keeps those of its rows.
    start, stop = (0, plan.pins) if plan.sharding == PIN_ROWS else (plan.shards[shard].start, plan.shards[shard].stop)
    pieces, offset = [], 0
    for index, f in enumerate(plan.snapshot["files"]):
        path = file_location(plan, f)
        for rg, n in enumerate(f["row_groups"]):
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                pieces.append(Piece(path, index, rg, lo - offset, hi - offset))
            offset += n
    return pieces


def batch_bounds(piece: Piece, batch_size: int) -> list[tuple[int, int]]:
    """The batches of a piece, as row offsets inside it: the same for every engine (floats depend on them)."""
    n = piece.stop - piece.start
    return [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]


def read_piece(plan: ScoringPlan, piece: Piece, parquet: pq.ParquetFile | None = None) -> pa.Table:
    """The snapshot's rows of ``piece`` (the columns a family may read), checked against the plan's footer."""
    entry = plan.snapshot["files"][piece.file_index]

    def read(pf: pq.ParquetFile) -> pa.Table:
        counts = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        if counts != entry["row_groups"]:
            raise DataError(
                f"{piece.path} changed since plan {plan.plan_id} was made (row groups {counts}, planned "
                f"{entry['row_groups']}): the snapshot ds={plan.ds} was rewritten; plan the run again"
            )
        table = pf.read_row_group(piece.row_group, columns=entry["columns"])
        return table.slice(piece.start, piece.stop - piece.start)

    if parquet is not None:
        return read(parquet)
    with storage.parquet_file(piece.path) as pf:
        return read(pf)


def shard_batches(plan: ScoringPlan, shard: int, rows_of: Any = None) -> Iterator[pa.Table]:
    """The shard's pins in batches of at most ``batch_size``, in plan order (one open file at a time).

    ``pin-rows-v1``: of each piece only the pins whose corpus-table rows (``rows_of(table)``, the scorer's
    :meth:`Scorer.table_rows`) are in the shard's range, batched per piece."""
    pieces = shard_pieces(plan, shard)
    batch_size = plan.batch_size
    i = 0
    while i < len(pieces):
        path = pieces[i].path
        with storage.parquet_file(path) as parquet:
            while i < len(pieces) and pieces[i].path == path:
                table = read_piece(plan, pieces[i], parquet)
                if plan.sharding == PIN_ROWS:
                    rows = rows_of(table)
                    ours = plan.shards[shard]
                    table = table.filter(pa.array((rows >= ours.start) & (rows < ours.stop)))
                    for a in range(0, table.num_rows, batch_size):
                        yield table.slice(a, min(batch_size, table.num_rows - a))
                else:
                    for a, b in batch_bounds(pieces[i], batch_size):
                        yield table.slice(a, b - a)
                i += 1


# --- scoring ---------------------------------------------------------------------------------------------------


def _registered(model_uri: str, tracking_uri: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The feature spec of a registered model and its sharded export's pointer (None: a whole model)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    info = mlflow.models.get_model_info(model_uri)
    spec = (info.metadata or {}).get("feature_spec")
    if not spec:
        raise ValueError(f"model {model_uri} has no feature_spec in its metadata: was it logged by training.train?")
    return spec, (info.metadata or {}).get(SHARDED_METADATA)


def _family_of(spec: dict[str, Any]) -> Any:
    from training.sdk import load_family

    return load_family(str(spec.get("family", "")), str(spec.get("family_module", "")), spec.get("params"))


def load_model(model_uri: str, tracking_uri: str) -> tuple[Any, dict[str, Any]]:
    """The serving module and its feature spec (from the MLflow model's metadata).

    A model exported sharded (``training.sharded_export``; its metadata points to the export) is the family's
    serving form over :class:`~training.sharded_export.ShardedRows` tables: each shard file is checked and
    opened only when a looked-up row falls in it, and only those rows are read. Any other model is the ``torch.export`` program."""
    spec, pointer = _registered(model_uri, tracking_uri)
    if pointer:
        from training import sharded_export

        family = _family_of(spec)
        model = sharded_export.load(str(pointer["location"]), family, sha256=str(pointer["sha256"]))
        return family.serving(model).eval(), spec
    import mlflow.pytorch

    return mlflow.pytorch.load_model(model_uri), spec


def load_trainable(model_uri: str, tracking_uri: str) -> tuple[Any, Any, dict[str, Any]]:
    """(its family, the family's trainable ``model``, the feature spec) of a registered model: what ``evaluate``
    takes (the promotion gate's champion, ``training.champion``). A sharded model keeps its tables in their files
    (``ShardedRows``: never built whole); a whole one goes through the family's ``model_from_serving``."""
    spec, pointer = _registered(model_uri, tracking_uri)
    family = _family_of(spec)
    if pointer:
        from training import sharded_export

        return family, sharded_export.load(str(pointer["location"]), family, sha256=str(pointer["sha256"])), spec
    import mlflow.pytorch

    return family, family.model_from_serving(mlflow.pytorch.load_model(model_uri)), spec


@dataclasses.dataclass
class Scorer:
    """A loaded model and its family: scores batches of the snapshot into ``corpus_schema`` rows."""

    family: Any
    module: Any
    spec: dict[str, Any]

    @classmethod
    def load(cls, model_uri: str, tracking_uri: str) -> Scorer:
        from training.sdk import load_family

        module, spec = load_model(model_uri, tracking_uri)
        family = load_family(str(spec.get("family", "pin_ranker")), str(spec.get("family_module", "")), spec.get("params"))
        if family.corpus_schema is None:
            raise UserError(f"model {model_uri} is of family {family.name}, which does not score the corpus")
        return cls(family, module, spec)

    @property
    def schema(self) -> pa.Schema:
        return self.family.corpus_schema  # type: ignore[no-any-return]

    def score(self, pins: pa.Table, root: str, ds: str) -> pa.Table:
        return self.family.score_corpus(self.module, pins, self.spec, root, ds)  # type: ignore[no-any-return]

    def table_rows(self, pins: pa.Table) -> np.ndarray:
        """The rows of the family's corpus table that ``pins`` look up (how a pin-rows plan groups them)."""
        return np.asarray(self.family.corpus_rows(self.module, pins))

    @property
    def splits(self) -> bool:
        """Whether preprocessing (``corpus_inputs``) can run apart from the model (``score_inputs``)."""
        return bool(getattr(self.family, "splits_corpus_scoring", False))

    def scored_batches(self, batches: Iterator[pa.Table], root: str, ds: str, prefetch: int = 2) -> Iterator[pa.Table]:
        """``score`` of each batch, in order. With a family that splits scoring, a reader thread reads and
        preprocesses the next ``prefetch`` batches while the model scores this one (Arrow, NumPy and torch release
        the GIL): the CPU work of a shard overlaps its forward passes, as Ray's readers and actors do across
        processes. The same batches, rows and floats either way."""
        if not self.splits or prefetch < 1:
            for batch in batches:
                yield self.score(batch, root, ds)
            return
        done = object()
        ready: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        stop = threading.Event()

        def read() -> None:
            try:
                for batch in batches:
                    item = self.family.corpus_inputs(batch, self.spec, root, ds)
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                ready.put(done)
            except BaseException as exc:  # handed to the consumer, raised there
                ready.put(exc)

        reader = threading.Thread(target=read, name="inference-reader", daemon=True)
        reader.start()
        try:
            while (item := ready.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield self.family.score_inputs(self.module, item, self.spec)
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting on a full queue
                with contextlib.suppress(queue.Empty):
                    ready.get_nowait()
                reader.join(timeout=0.05)


class PartWriter:
    """One part file in memory: scored batches in order, row groups of ``ROW_GROUP_ROWS``, and the footer
    record (plan, shard, rows, pin-id checksum) that :func:`publish_plan` checks. The same bytes from every engine."""

    def __init__(self, plan: ScoringPlan, shard: int, schema: pa.Schema) -> None:
        self.plan, self.shard, self.schema = plan, shard, schema
        self.sink = pa.BufferOutputStream()
        self.writer = pq.ParquetWriter(self.sink, schema)
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.rows = 0
        self.checksum = 0

    def add(self, table: pa.Table) -> None:
        if table.schema != self.schema:
            table = table.cast(self.schema)
        self.rows += table.num_rows
        self.checksum = ids_checksum(table.column("pin_id").to_numpy(), self.checksum)
        self.pending.append(table)
        self.pending_rows += table.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=max(self.pending_rows, 1))
            self.pending, self.pending_rows = [], 0

    def finish(self, **extra: Any) -> tuple[bytes, dict[str, Any]]:
        """The part's bytes and its footer record (``extra``: how it was made, e.g. seconds and engine)."""
        self._flush()
        record = {"plan_id": self.plan.plan_id, "shard": self.shard, "num_shards": self.plan.num_shards,
                  "rows": self.rows, "ids_checksum": checksum_hex(self.checksum), **extra}
        self.writer.add_key_value_metadata({PART_METADATA_KEY: json.dumps(record, sort_keys=True)})
        self.writer.close()
        return self.sink.getvalue().to_pybytes(), record


def staged_part(plan: ScoringPlan, shard: int) -> str:
    return storage.join(plan.parts_dir, part_name(shard))


def published_part(plan: ScoringPlan, shard: int) -> str:
    return storage.join(plan.out_dir, part_name(shard))


def part_record(location: str) -> dict[str, Any] | None:
    """The footer record of a part file (None if it is not there or has none)."""
    try:
        with storage.parquet_file(location) as parquet:
            raw = (parquet.metadata.metadata or {}).get(PART_METADATA_KEY.encode())
    except (FileNotFoundError, OSError, pa.ArrowInvalid):
        return None
    return dict(json.loads(raw)) if raw else None


def find_part(plan: ScoringPlan, shard: int, staged: set[str] | None = None) -> str | None:
    """Where this plan's part of ``shard`` is: staged under the plan, or already published (its footer names
    the plan). None if it has not been scored. ``staged``: the names under ``parts_dir`` if already listed."""
    name = part_name(shard)
    location = staged_part(plan, shard)
    if (name in staged) if staged is not None else storage.exists(location):
        return location
    location = published_part(plan, shard)
    record = part_record(location)
    if record is not None and record.get("plan_id") == plan.plan_id and record.get("shard") == shard:
        return location
    return None


def missing_shards(plan: ScoringPlan) -> list[int]:
    """The shards of the plan that have no part yet (staged or published), in order."""
    staged = set(storage.list_names(plan.parts_dir))
    published = set(storage.list_names(plan.out_dir))
    missing = []
    for shard in range(plan.num_shards):
        name = part_name(shard)
        if name in staged:
            continue
        if name in published and find_part(plan, shard, staged) is not None:
            continue
        missing.append(shard)
    return missing


def score_plan_shard(plan: ScoringPlan, shard: int, scorer: Scorer | None = None,
                     engine: str = "processes") -> dict[str, Any]:
    """Score one shard of the plan into its part (skipped if this plan's part exists); a summary.

    ``engine``: what the part's record says scored it (``training.ray_inference`` scores a ``pin-rows-v1`` plan's
    shards with this function, one Ray task each)."""
    started = time.monotonic()
    summary: dict[str, Any] = {"plan_id": plan.plan_id, "shard": shard, "num_shards": plan.num_shards,
                               "ds": plan.ds, "path": staged_part(plan, shard)}
    with _shard_claim(plan, shard):  # a second scorer of this shard waits for the first, then finds its part
        found = find_part(plan, shard)
        if found is not None:
            record = part_record(found) or {}
            return {**summary, "path": found, "rows": record.get("rows"), "skipped": True, "seconds": 0.0}
        return _score_shard(plan, shard, scorer, engine, started, summary)


CLAIM_WAIT_LOG_S = 60.0  # how often a scorer waiting for another's claim on its shard says so


@contextlib.contextmanager
def _shard_claim(plan: ScoringPlan, shard: int, poll_s: float = 1.0) -> Iterator[None]:
    """Hold the claim on scoring ``shard`` of the plan (a lock file beside its parts, dropped with this process
    however it ends), waiting while another scorer holds it. None on an object store (a second scorer there scores
    the same part again: identical, written whole), nor once the plan's folder is gone (published)."""
    from core import claims

    fd = None
    if not storage.is_remote(plan.parts_dir):
        since, said = time.monotonic(), -1.0
        while storage.exists(plan.parts_dir):
            try:
                fd = claims.hold(storage.join(plan.parts_dir, f".shard-{shard:05d}.lock"))
                break
            except claims.Claimed as held:
                waited = time.monotonic() - since
                if said < 0 or waited - said >= CLAIM_WAIT_LOG_S:  # a line now and then: a hung holder shows
                    log.info("shard %d of plan %s is being scored by %s: waiting for it (%.0f s so far; if that scorer "
                             "hangs, stop it and this one scores the shard)", shard, plan.plan_id, held.holder, waited)
                    said = waited
                time.sleep(poll_s)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _score_shard(plan: ScoringPlan, shard: int, scorer: Scorer | None, engine: str, started: float,
                 summary: dict[str, Any]) -> dict[str, Any]:
    pieces = shard_pieces(plan, shard)  # checks the shard number before the model is loaded
    scorer = scorer or Scorer.load(plan.model_uri, plan.tracking_uri)
    loaded, cpu_from = time.monotonic(), time.process_time()
    writer = PartWriter(plan, shard, scorer.schema)
    by_rows = plan.sharding == PIN_ROWS
    expected = sum(p.stop - p.start for p in pieces)
    sleep_s = float(os.environ.get(DEBUG_SLEEP_VARIABLE) or 0)
    log.info("scoring shard %d of plan %s: %s in %d piece(s) (model ready after %.1fs)", shard, plan.plan_id,
             f"the pins of table rows [{plan.shards[shard].start}, {plan.shards[shard].stop})" if by_rows
             else f"{expected} pins", len(pieces), loaded - started)
    batches = shard_batches(plan, shard, scorer.table_rows if by_rows else None)
    for scored in scorer.scored_batches(batches, plan.root, plan.ds):
        writer.add(scored)
        if sleep_s:
            time.sleep(sleep_s)
    if not by_rows and writer.rows != expected:
        raise DataError(f"shard {shard} of plan {plan.plan_id} scored {writer.rows} rows, its range has {expected}")
    seconds = time.monotonic() - loaded
    # The process's peak resident memory (VmHWM: this program's own, not its parent's), and the shard files a
    # sharded model opened: what a scorer of a sharded model saves is measured, not assumed.
    peak_rss_mib = peak_rss_bytes() / 2**20
    opened: list[str] | None = None
    if by_rows and scorer.module is not None:
        from training.sharded_export import opened_files

        opened = opened_files(scorer.module)
    log.info("shard %d: %d pins scored, peak RSS %.1f MiB%s", shard, writer.rows, peak_rss_mib,
             f", {len(opened)} shard file(s) of the sharded model opened" if opened else "")
    # CPU seconds too: on a shared machine they measure the work when wall time measures the neighbours.
    data, record = writer.finish(seconds=round(seconds, 3), cpu_seconds=round(time.process_time() - cpu_from, 3),
                                 engine=engine, peak_rss_mib=round(peak_rss_mib, 1),
                                 **({"model_files_opened": len(opened)} if opened is not None else {}))
    storage.write_bytes(summary["path"], data)
    return {**summary, "rows": record["rows"], "ids_checksum": record["ids_checksum"], "skipped": False,
            "seconds": round(time.monotonic() - started, 3), "score_seconds": round(seconds, 3),
            "engine": engine, **({"model_files": opened} if opened is not None else {})}


def score_shard(
    *,
    model_uri: str,
    tracking_uri: str,
    root: str,
    ds: str,
    shard: int,
    num_shards: int,
    out_dir: str | os.PathLike[str],
    batch_size: int = 4096,
) -> dict[str, Any]:
    """Score one shard of the plan made from these arguments (see :func:`make_plan`); skipped if scored."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    plan = make_plan(model_uri=model_uri, tracking_uri=tracking_uri, root=root, ds=ds, out_dir=out_dir,
                     num_shards=num_shards, batch_size=batch_size)
    if find_part(plan, shard) is None and not storage.exists(plan_location(plan)):
        write_plan(plan)  # what publish_manifest finds the plan's root and batch size by
    return score_plan_shard(plan, shard)


# --- publishing ------------------------------------------------------------------------------------------------


def expected_parts(plan: ScoringPlan) -> list[dict[str, Any]]:
    """Rows and pin-id checksum of each shard's range, recomputed from the snapshot (its ``pin_id`` column only).

    ``pin-rows-v1``: which shard a pin is in takes the model to say, so one entry for the whole snapshot (shard
    -1): the parts together must hold its rows and checksum."""
    by_rows = plan.sharding == PIN_ROWS
    counts = [0] * (1 if by_rows else plan.num_shards)
    sums = [0] * len(counts)
    bounds = [(0, plan.pins)] if by_rows else [(s.start, s.stop) for s in plan.shards]
    offset = 0
    for f in plan.snapshot["files"]:
        with storage.parquet_file(file_location(plan, f)) as parquet:
            for rg, n in enumerate(f["row_groups"]):
                ids = None
                for shard, (start, stop) in enumerate(bounds):
                    lo, hi = max(start, offset), min(stop, offset + n)
                    if lo >= hi:
                        continue
                    if ids is None:
                        ids = parquet.read_row_group(rg, columns=["pin_id"]).column("pin_id").to_numpy()
                    counts[shard] += hi - lo
                    sums[shard] = ids_checksum(ids[lo - offset:hi - offset], sums[shard])
                offset += n
    if by_rows:
        return [{"shard": -1, "rows": counts[0], "ids_checksum": checksum_hex(sums[0])}]
    return [{"shard": i, "rows": counts[i], "ids_checksum": checksum_hex(sums[i])} for i in range(plan.num_shards)]


def _move(source: str, target: str) -> None:
    """Move one file: a rename locally; a server-side copy and a delete on an object store."""
    if not storage.is_remote(source):
        os.replace(storage.local_path(source), storage.local_path(target))
        return
    fs, src = storage.filesystem(source)
    _, dst = storage.filesystem(target)
    fs.mv(src, dst)


def _throughput(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Pins per second of one scoring process, from the parts scored by processes (their own timing)."""
    timed = [r for r in records if r.get("engine") == "processes" and float(r.get("seconds") or 0) > 0]
    rows, seconds = sum(int(r["rows"]) for r in timed), sum(float(r["seconds"]) for r in timed)
    if not timed or rows == 0:
        return None
    cpu = sum(float(r.get("cpu_seconds") or 0) for r in timed)
    return {"pins_per_s_per_process": round(rows / seconds, 1), "parts": len(timed), "rows": rows,
            "seconds": round(seconds, 3),
            **({"pins_per_cpu_s": round(rows / cpu, 1)} if all(r.get("cpu_seconds") for r in timed) else {})}


def publish_plan(plan: ScoringPlan) -> dict[str, Any]:
    """Check every part, move them into ``out_dir`` and write ``_MANIFEST.json`` last; return the manifest.

    Every pin of the snapshot must be in exactly one part: each part must carry this plan's id and hold the
    row count and pin-id checksum of its shard's range, recomputed from the snapshot (whose fingerprint must
    still be the plan's). A missing part raises :class:`MissingPartsError` naming it; a wrong one is removed
    (so that scoring it again replaces it) and raises it too. Then the old manifest goes first, the parts
    are moved in (replacing the earlier output's, whatever its shard count), parts of no shard of this
    plan are removed, the manifest is written last, and the staging folders of every plan are removed.
    """
    out_dir = plan.out_dir
    current = snapshot(plan.root, plan.ds, views_dir(out_dir))
    if current["fingerprint"] != plan.snapshot["fingerprint"]:
        raise DataError(
            f"the {RAW_PINS} snapshot ds={plan.ds} changed since plan {plan.plan_id} was made: plan and "
            "score the run again"
        )
    expected = expected_parts(plan)
    by_rows = plan.sharding == PIN_ROWS
    whole = expected[0] if by_rows else None
    if whole is not None:  # each part is checked against the plan; the parts together against the snapshot
        expected = [{"shard": i, "rows": None, "ids_checksum": None} for i in range(plan.num_shards)]
    staged = set(storage.list_names(plan.parts_dir))
    missing, wrong, parts = [], [], []
    schema: pa.Schema | None = None
    for want in expected:
        shard = want["shard"]
        location = find_part(plan, shard, staged)
        if location is None:
            missing.append(part_name(shard))
            continue
        with storage.parquet_file(location) as parquet:
            raw = (parquet.metadata.metadata or {}).get(PART_METADATA_KEY.encode())
            record = json.loads(raw) if raw else {}
            ids = parquet.read(columns=["pin_id"]).column("pin_id").to_numpy()
            part_schema = parquet.schema_arrow.remove_metadata()
        got = {"rows": len(ids), "ids_checksum": checksum_hex(ids_checksum(ids))}
        problems = []
        if record.get("plan_id") != plan.plan_id or record.get("shard") != shard:
            problems.append(f"made for plan {record.get('plan_id')} shard {record.get('shard')}")
        if want["rows"] is not None and got["rows"] != want["rows"]:
            problems.append(f"{got['rows']} rows, its range has {want['rows']}")
        if want["ids_checksum"] is not None and got["ids_checksum"] != want["ids_checksum"]:
            problems.append(f"pin-id checksum {got['ids_checksum']}, its range's {want['ids_checksum']}")
        schema = schema or part_schema
        if part_schema != schema:
            problems.append("its columns differ from the other parts'")
        if problems:
            wrong.append(f"{part_name(shard)} ({'; '.join(problems)})")
            storage.remove(location)
            continue
        parts.append({"file": part_name(shard), "shard": shard, **got, "start": plan.shards[shard].start,
                      "_location": location, "_record": record})
    if missing or wrong:
        detail = "; ".join(filter(None, [
            f"{len(missing)} of {plan.num_shards} part(s) missing ({', '.join(missing[:10])})" if missing else "",
            f"wrong part(s) removed: {', '.join(wrong[:10])}" if wrong else "",
        ]))
        raise MissingPartsError(
            f"cannot publish {out_dir} (plan {plan.plan_id}): {detail}; score those shards (again) first"
        )
    if whole is not None:
        rows, total = sum(p["rows"] for p in parts), 0
        for part in parts:
            total = (total + int(part["ids_checksum"], 16)) & 0xFFFFFFFFFFFFFFFF
        if (rows, checksum_hex(total)) != (whole["rows"], whole["ids_checksum"]):
            for part in parts:
                storage.remove(part["_location"])
            raise MissingPartsError(
                f"cannot publish {out_dir} (plan {plan.plan_id}): its parts hold {rows} pins (checksum "
                f"{checksum_hex(total)}), the snapshot {whole['rows']} ({whole['ids_checksum']}): a pin is missing "
                "or scored twice; the parts were removed, score every shard again"
            )

    storage.remove(storage.join(out_dir, MANIFEST))  # from here on readers see no output until the new manifest
    for part in parts:
        target = storage.join(out_dir, part["file"])
        if part["_location"] != target:
            _move(part["_location"], target)
    keep = {part["file"] for part in parts}
    for name in storage.list_names(out_dir):
        if name.startswith("part-") and name.endswith(".parquet") and name not in keep:
            storage.remove(storage.join(out_dir, name))
    records = [part.pop("_record") for part in parts]
    for part in parts:
        part.pop("_location")
    total = 0
    for part in parts:
        total = (total + int(part["ids_checksum"], 16)) & 0xFFFFFFFFFFFFFFFF
    manifest = {
        "ds": plan.ds,
        "model_uri": plan.model_uri,
        "plan_id": plan.plan_id,
        "num_shards": plan.num_shards,
        "sharding": plan.sharding,
        "batch_size": plan.batch_size,
        "snapshot": {"fingerprint": plan.snapshot["fingerprint"], "pins": plan.pins,
                     "files": len(plan.snapshot["files"])},
        "parts": parts,
        "rows": sum(p["rows"] for p in parts),
        "pins": plan.pins,
        "ids_checksum": checksum_hex(total),
        "columns": schema.names if schema is not None else [],
        "throughput": _throughput(records),
        "engines": sorted({str(r.get("engine", "")) for r in records}),
        "created": dt.datetime.now(dt.UTC).isoformat(),
    }
    storage.write_json(storage.join(out_dir, MANIFEST), manifest)
    _remove_plan(out_dir, plan.plan_id)
    return manifest


def _remove_plan(out_dir: str, plan_id: str) -> None:
    """This plan's folder; the merged snapshot views too once no other plan's folder is left. Another plan scoring
    into the same output meanwhile (other shards, another model) keeps its parts: its own publish decides."""
    plans = storage.join(out_dir, PLANS_DIR)
    storage.remove_tree(storage.join(plans, plan_id))
    if not [name for name in storage.list_names(plans) if name != VIEWS_DIR]:
        storage.remove_tree(plans)


def publish_manifest(
    out_dir: str | os.PathLike[str], num_shards: int, model_uri: str, ds: str, *, root: str | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Publish the plan of these arguments (see :func:`publish_plan`).

    ``root`` and ``batch_size`` default to those of a plan of this model, day and shard count staged under
    ``out_dir``; the plan is then made again from the snapshot as it is now, so a changed snapshot or a part
    of another plan never gets published.
    """
    staged = []
    for location in storage.glob(storage.join(out_dir, PLANS_DIR), f"*/{PLAN_FILE}"):
        found = storage.read_json(location)
        if (found.get("model_uri"), found.get("ds"), found.get("num_shards")) == (model_uri, ds, num_shards):
            staged.append(found)
    if root is None:
        if not staged:
            raise MissingPartsError(
                f"cannot publish {out_dir}: no shard of {model_uri} ds={ds} in {num_shards} shards was scored there"
            )
        root = str(staged[0]["root"])
    if batch_size is None:
        batch_size = int(staged[0]["batch_size"]) if staged else 4096
    tracking = str(staged[0].get("tracking_uri", "")) if staged else ""
    by_rows = bool(staged) and staged[0].get("sharding") == PIN_ROWS
    plan = make_plan(model_uri=model_uri, tracking_uri=tracking, root=root, ds=ds, out_dir=out_dir,
                     num_shards=num_shards, batch_size=batch_size,
                     table_rows=int(staged[0]["shards"][-1]["stop"]) if by_rows else 0)
    return publish_plan(plan)


# --- the entry point -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.inference",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--plan", help="the plan file (_PLAN.json) to score or publish; or make one with the options below")
    parser.add_argument("--shards", help="shards of the plan to score, e.g. 0,3,5-7 (an array job scores one)")
    parser.add_argument("--model-uri", help="MLflow model URI, e.g. models:/pin_ranker/3 (any family)")
    parser.add_argument("--tracking-uri", help="MLflow tracking and registry URI")
    parser.add_argument("--root", help="storage root holding raw/pins")
    parser.add_argument("--ds", help="day of the raw/pins snapshot (YYYY-MM-DD)")
    parser.add_argument("--shard", type=int, help="this shard's index in [0, num-shards)")
    parser.add_argument("--num-shards", type=int, help="contiguous row ranges the snapshot is cut into")
    parser.add_argument("--out-dir", help="folder of the part files and the manifest")
    parser.add_argument("--batch-size", type=int, help="pins per forward pass (default 4096; a plan's own)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the plan's, 1)")
    parser.add_argument(
        "--publish", action="store_true", help="do not score: check every part and write _MANIFEST.json last"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(0)
    try:
        if args.threads is not None and args.threads < 1:
            raise UserError(f"--threads {args.threads}: need at least one thread")
        if args.plan:
            plan = read_plan(args.plan)
        else:
            needed = {"--model-uri": args.model_uri, "--ds": args.ds, "--num-shards": args.num_shards,
                      "--out-dir": args.out_dir}
            if not args.publish:
                needed.update({"--tracking-uri": args.tracking_uri, "--root": args.root})
            absent = [name for name, value in needed.items() if value in (None, "")]
            if absent:
                parser.error(f"give --plan, or {', '.join(absent)}")
            try:
                storage.parse_ds(args.ds)
            except ValueError:
                raise UserError(f"--ds {args.ds!r} is not a day: give YYYY-MM-DD") from None
            if args.publish:
                model_uri = args.model_uri
                if not is_pinned(model_uri):
                    if not args.tracking_uri:
                        raise UserError(f"--model-uri {model_uri} names no version: give its version number, or "
                                        "--tracking-uri to find the version it names")
                    model_uri = pinned_model(model_uri, args.tracking_uri)[0]
                manifest = publish_manifest(args.out_dir, args.num_shards, model_uri, args.ds, root=args.root,
                                            batch_size=args.batch_size)
                print(json.dumps({k: v for k, v in manifest.items() if k != "parts"}), flush=True)
                return int(ExitCode.OK)
            model_uri, table_rows = pinned_model(args.model_uri, args.tracking_uri)
            plan = make_plan(model_uri=model_uri, tracking_uri=args.tracking_uri, root=args.root, ds=args.ds,
                             out_dir=args.out_dir, num_shards=args.num_shards,
                             batch_size=4096 if args.batch_size is None else args.batch_size,
                             threads=1 if args.threads is None else args.threads, table_rows=table_rows)
        if args.publish:
            manifest = publish_plan(plan)
            print(json.dumps({k: v for k, v in manifest.items() if k != "parts"}), flush=True)
            return int(ExitCode.OK)
        if args.shards:
            shards = shards_of_this_process(parse_shards(args.shards))
        elif args.shard is not None:
            shards = [args.shard]
        else:
            parser.error("--shards or --shard: which shards to score")
        outside = [shard for shard in shards if not 0 <= shard < plan.num_shards]
        if outside:  # before the model loads or a plan is written
            raise UserError(f"shard(s) {outside} not in [0, {plan.num_shards}) of plan {plan.plan_id}")
        threads = args.threads if args.threads is not None else plan.threads
        if threads:
            import torch

            torch.set_num_threads(threads)
        scorer = None
        for shard in shards:
            if find_part(plan, shard) is None:
                if scorer is None:
                    shard_pieces(plan, shard)  # a snapshot changed since the plan fails before the model is loaded
                    scorer = Scorer.load(plan.model_uri, plan.tracking_uri)  # a wrong model: no plan written
                if not args.plan and not storage.exists(plan_location(plan)):
                    write_plan(plan)  # only when there is a shard to score (none once the plan was published)
            print(json.dumps(score_plan_shard(plan, shard, scorer)), flush=True)
        return int(ExitCode.OK)
    except Exception as exc:
        code = exit_code_for(exc)
        # Our own user or data errors, and MLflow's answers (no such model or version), are their one line; anything
        # else (a bug) keeps its traceback.
        from_mlflow = any(cls.__name__ == "MlflowException" for cls in type(exc).__mro__)  # RestException too
        expected = (isinstance(exc, PinflowError) or from_mlflow) and classify(exc) in (FailureClass.USER, FailureClass.DATA)
        log.error("inference failed (%s, exit %d): %s", code.name, int(code), exc, exc_info=None if expected else exc)
        return int(code)


if __name__ == "__main__":
    sys.exit(main())
