"""The sharded export of a TorchRec-trained model: served without the whole model in one process.

Above ``sharded_export_above_mib`` of tables (RUN.json; strategy ``torchrec`` only) the end of training does not
gather the tables: every rank writes its own shards of each sharded table as ``.npy`` files of a row range (and,
column-wise, a column range), rank 0 writes the rest of the model (``dense.pt``: a state dict without those
tables, the managed-id buffers included) and ``MANIFEST.json`` (per table: rows, dim, dtype and each shard's
``row_start``, ``row_end``, ``col_start``, ``col_end``, ``file``, ``sha256``), all inside one
``core.storage.publish`` of the export folder: a half-written export is never visible.

:func:`load` rebuilds the family's model with those tables on the meta device and puts a :class:`ShardedRows`
in each table's place: a lookup that opens a shard file only when a looked-up row falls in it, after checking
its SHA-256 against the manifest, and reads only the rows looked up. A scorer whose pins map to a few rows of the pin table (the corpus
plan groups them so: ``training.inference``, sharding ``pin-rows-v1``) opens only the shards of those
rows. A missing shard, or one whose checksum differs, is a DataError naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import shutil
import weakref
from typing import IO, Any

import numpy as np
import torch
from torch import nn

from core import storage
from core.failures import DataError, InfraError
from core.scratch import make_scratch

FORMAT = "pinflow-sharded-v1"
MANIFEST_FILE = "MANIFEST.json"
DENSE_FILE = "dense.pt"
_CHUNK = 1 << 22  # bytes hashed at a time


def sha256_of(location: str) -> str:
    """The SHA-256 of a file, read in chunks (a file of any size, in bounded memory)."""
    digest = hashlib.sha256()
    try:
        if storage.is_remote(location):
            fs, key = storage.filesystem(location)
            with fs.open(key, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
        else:
            with open(storage.local_path(location), "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
    except FileNotFoundError:
        raise DataError(f"sharded model file {location} is missing: the export is incomplete or was removed") from None
    return digest.hexdigest()


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes what it passes to ``sink`` (np.save writes through it in chunks)."""

    def __init__(self, sink: IO[bytes]) -> None:
        self.sink, self.digest = sink, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.sink.write(view)
        return len(view)


def _write_npy(location: str, array: np.ndarray, zero_first_row: bool = False) -> str:
    """``array`` (2-D, C-contiguous) as a .npy file at ``location``, its first row written as zeros if
    ``zero_first_row``; its SHA-256. Written from the array itself in chunks, never copied: a rank's shard may be
    most of its memory."""
    with storage.open_output(location) as f:
        stream = _Hashing(f)
        np.lib.format.write_array_header_1_0(stream, np.lib.format.header_data_from_array_1_0(array))
        body = memoryview(array.reshape(-1).view(np.uint8).data)
        if zero_first_row and array.shape[0]:
            stream.write(bytes(array.strides[0]))
            body = body[array.strides[0]:]
        for start in range(0, len(body), _CHUNK):
            stream.write(body[start:start + _CHUNK])
    return stream.digest.hexdigest()


def tables_bytes(dmp: Any) -> int:
    """Bytes of the float32 tables TorchRec shards in ``dmp`` (what the export threshold is compared with)."""
    from training.torchrec_sharding import lookups

    return sum(t.num_embeddings * t.embedding_dim * 4 for t in lookups(dmp).values())


def export(dmp: Any, names: tuple[str, ...] | list[str], final: str) -> dict[str, Any] | None:
    """Write the sharded export of ``dmp`` (its tables ``names``) to the folder ``final``; a collective.

    Each rank writes its own shards; rank 0 the dense rest and the manifest, and publishes the folder once every
    rank has written (a rank that failed fails the export on every rank, and nothing is published). No rank returns
    before the folder is published (rank 0 registers it next). Returns the manifest on rank 0, None elsewhere."""
    import torch.distributed as dist

    from training import torchrec_sharding as ts

    rank = dist.get_rank()
    keys = ts.lookup_key_map(names)
    tables = {t.name: t for t in ts.lookups(dmp).values()}
    manifest: dict[str, Any] | None = None
    together = False  # past the point where every rank raises together
    try:
        with storage.publish(final) if rank == 0 else contextlib.nullcontext("") as folder:
            manifest = _write(dmp, names, final, folder, keys, tables)
            together = True
            if rank == 0:
                manifest = _write_rest(manifest, names, folder, tables)
    except Exception as e:  # noqa: BLE001 - rank 0's own failure to finish or publish: the others learn of it below
        if not together:
            raise
        published: str | None = f"{type(e).__name__}: {e}"
        failure: Exception | None = e
    else:
        published, failure = None, None
    word = [published]
    dist.broadcast_object_list(word, src=0)  # rank 0 has published (or failed to): now the others may read it
    if failure is not None:
        raise failure
    if word[0] is not None:
        raise InfraError(f"the sharded export to {final} was not published: rank 0: {word[0]}")
    return manifest if rank == 0 else None


def _write(dmp: Any, names: tuple[str, ...] | list[str], final: str, folder: str, keys: dict[str, str],
           tables: dict[str, Any]) -> dict[str, Any]:
    """Every rank: write this rank's shards into rank 0's ``folder``; every rank raises if any rank failed.
    Returns what rank 0 needs for the rest (the dense state dict and every rank's shard entries)."""
    import torch.distributed as dist

    from training import torchrec_sharding as ts

    rank, world = dist.get_rank(), dist.get_world_size()
    shared = [folder]
    dist.broadcast_object_list(shared, src=0)  # where rank 0's publish is filled: a temporary or version folder
    folder = str(shared[0])
    entries: list[dict[str, Any]] = []
    dense: dict[str, torch.Tensor] = {}
    error: str | None = None
    try:
        for key, value in dmp.state_dict().items():
            plain = keys.get(key)
            if plain is None:
                dense[key] = value.detach().cpu()
                continue
            table = plain.removesuffix(".weight")
            lookup = tables[ts._table_name(table)]
            for (row, col), tensor in ts.local_shards(value):
                array = np.ascontiguousarray(tensor.detach().cpu().numpy())  # a view, as TorchRec holds it
                rows, cols = array.shape
                name = f"{table}/rows-{row:012d}-{row + rows:012d}-cols-{col:05d}-{col + cols:05d}.npy"
                entries.append({"table": table, "row_start": row, "row_end": row + rows, "col_start": col,
                                "col_end": col + cols, "file": name,
                                # Row 0 is "absent": zero, as padding_idx=0 keeps it.
                                "sha256": _write_npy(storage.join(folder, name), array,
                                                     zero_first_row=lookup.padded and row == 0),
                                "bytes": array.nbytes})
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then each raises
        error = f"rank {rank}: {type(e).__name__}: {e}"
        failure: Exception | None = e
    else:
        failure = None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (entries, error))
    errors = [e for _, e in gathered if e]
    if failure is not None:
        raise failure
    if errors:
        raise InfraError(f"the sharded export to {final} failed on another rank: {'; '.join(errors)}")
    return {"dense": dense, "gathered": gathered}


def _write_rest(written: dict[str, Any], names: tuple[str, ...] | list[str], folder: str,
                tables: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the dense rest and the manifest of every rank's shards (``_write``'s); returns the manifest."""
    import torch.distributed as dist

    from training import torchrec_sharding as ts

    world = dist.get_world_size()
    dense, gathered = written["dense"], written["gathered"]
    buffer = io.BytesIO()
    torch.save(dense, buffer)
    storage.write_bytes(storage.join(folder, DENSE_FILE), buffer.getvalue())
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "dense": {"file": DENSE_FILE, "sha256": hashlib.sha256(buffer.getvalue()).hexdigest()},
        "world_size": world,
        "tables": {},
    }
    for table in names:
        lookup = tables[ts._table_name(table)]
        shards = sorted((e for part, _ in gathered for e in part if e["table"] == table),
                        key=lambda e: (e["row_start"], e["col_start"]))
        manifest["tables"][table] = {
            "rows": lookup.num_embeddings, "dim": lookup.embedding_dim, "dtype": "float32",
            "shards": [{k: v for k, v in e.items() if k != "table"} for e in shards],
        }
    storage.write_json(storage.join(folder, MANIFEST_FILE), manifest)
    return manifest


def manifest_sha256(final: str) -> str:
    """The SHA-256 of a published export's manifest (what the registered model records)."""
    return sha256_of(storage.join(storage.resolve(final), MANIFEST_FILE))


# --- loading ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardFile:
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    location: str
    sha256: str


class ShardedRows(nn.Module):
    """A table of the sharded export, called like ``nn.Embedding``: rows in, vectors out (float32, no gradient).

    A shard file is opened (checked against its SHA-256) the first time a looked-up row falls in it, and only the
    rows looked up are read from it: a process holds the rows it uses, never a shard."""

    def __init__(self, name: str, rows: int, dim: int, shards: list[ShardFile], cache: str) -> None:
        super().__init__()
        self.name, self.num_embeddings, self.embedding_dim = name, rows, dim
        self.shards, self.cache = shards, cache
        self._open: dict[int, tuple[IO[bytes], int]] = {}
        # Checked per run of rows between shard boundaries (not with an array of every row: the table's rows
        # may be many more than a process may hold): each run's shards must tile its columns exactly.
        bounds = sorted({0, rows, *(min(b, rows) for s in shards for b in (s.row_start, s.row_end))})
        for first, stop in zip(bounds, bounds[1:], strict=False):
            spans = sorted((s.col_start, s.col_end) for s in shards if s.row_start <= first and stop <= s.row_end)
            at = 0
            for start, end in spans:
                at = end if start == at else -1
            if at != dim:
                raise DataError(f"sharded model table {name}: its shards do not cover every row and column exactly "
                                f"(row {first} has {sum(e - s for s, e in spans)} of {dim} columns)")

    @property
    def opened(self) -> list[str]:
        """The shard files this table has opened so far."""
        return [self.shards[i].location for i in sorted(self._open)]

    def _open_file(self, i: int) -> tuple[IO[bytes], int]:
        """Shard ``i``'s file, checked against its SHA-256 when first opened, and where its rows start."""
        if i not in self._open:
            shard = self.shards[i]
            path = shard.location
            if storage.is_remote(path):  # read from a local copy (the scorer's cache), this file only, fetched once
                path = os.path.join(self.cache, f"{self.name}-{i}.npy")
                fs, key = storage.filesystem(shard.location)
                try:
                    fs.get_file(key, path)  # streamed to disk in blocks: a shard never held in memory
                except FileNotFoundError:
                    raise DataError(f"sharded model file {shard.location} is missing: the export is incomplete or "
                                    "was removed") from None
            digest = sha256_of(path)  # the copy that is read is the one checked
            if digest != shard.sha256:
                raise DataError(f"sharded model file {shard.location} has SHA-256 {digest}, the manifest says "
                                f"{shard.sha256}: the file was changed or damaged; export the model again")
            f = open(path, "rb")  # noqa: SIM115 - kept open while the table is used (closed with it)
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(f)
            want = (shard.row_end - shard.row_start, shard.col_end - shard.col_start)
            if dtype != np.float32 or tuple(shape) != want or fortran:
                f.close()
                raise DataError(f"sharded model file {shard.location} holds {dtype} {shape}, the manifest says "
                                f"float32 {want}")
            self._open[i] = (f, f.tell())
        return self._open[i]

    def _read(self, i: int, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (local to shard ``i``) of its file, read with one ``pread`` per run of consecutive rows:
        not memory-mapped, whose fault-around would make 64 KiB resident for every row of 128 bytes looked up."""
        f, offset = self._open_file(i)
        shard = self.shards[i]
        width = shard.col_end - shard.col_start
        row_bytes = width * 4
        unique, inverse = np.unique(rows, return_inverse=True)
        out = np.empty((len(unique), width), dtype=np.float32)
        cuts = np.flatnonzero(np.diff(unique) != 1) + 1
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(unique)], strict=True):
            size = int(b - a) * row_bytes
            data = os.pread(f.fileno(), size, offset + int(unique[a]) * row_bytes)
            if len(data) != size:
                raise DataError(f"sharded model file {shard.location} is shorter than its header says")
            out[a:b] = np.frombuffer(data, dtype=np.float32).reshape(-1, width)
        return out[inverse]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"{self.name}: rows outside [0, {self.num_embeddings})")
        out = np.zeros((flat.size, self.embedding_dim), dtype=np.float32)
        for i, s in enumerate(self.shards):
            hit = (flat >= s.row_start) & (flat < s.row_end)
            if hit.any():
                out[hit, s.col_start:s.col_end] = self._read(i, flat[hit] - s.row_start)
        return torch.from_numpy(out).reshape(*rows.shape, self.embedding_dim).to(rows.device)


def read_manifest(final: str, sha256: str | None = None) -> tuple[str, dict[str, Any]]:
    """(the folder its files are in, the manifest) of the export published at ``final``; with ``sha256``, the
    manifest must have that digest (what the registered model recorded)."""
    base = storage.resolve(final)
    location = storage.join(base, MANIFEST_FILE)
    try:
        raw = storage.read_bytes(location)
    except FileNotFoundError:
        raise DataError(f"sharded model manifest {location} is missing: the export was removed or never "
                        "published") from None
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise DataError(f"sharded model manifest {location} is not the one the model was registered with "
                        f"(SHA-256 {hashlib.sha256(raw).hexdigest()}, registered {sha256})")
    import json

    manifest = json.loads(raw)
    if manifest.get("format") != FORMAT:
        raise DataError(f"{location} is not a pinflow sharded export (format {manifest.get('format')!r})")
    return base, manifest


def published(final: str) -> bool:
    """Whether an export is published at ``final`` (its manifest is there and readable)."""
    try:
        read_manifest(final)
    except DataError:
        return False
    return True


def load(final: str, family: Any, variant: str = "model", sha256: str | None = None) -> nn.Module:
    """The family's ``variant`` model from the sharded export at ``final``: the dense part loaded, each sharded
    table a :class:`ShardedRows` over its files (opened on first use)."""
    from training.torchrec_sharding import build_meta

    base, manifest = read_manifest(final, sha256)
    tables = manifest["tables"]
    model = build_meta(lambda: family.build_model(variant), list(tables))
    cache = make_scratch("pinflow-shards-") if storage.is_remote(base) else ""
    if cache:  # the local copies of an object store's shards go with the model
        weakref.finalize(model, shutil.rmtree, cache, ignore_errors=True)
    for table, info in tables.items():
        shards = [ShardFile(int(s["row_start"]), int(s["row_end"]), int(s["col_start"]), int(s["col_end"]),
                            storage.join(base, s["file"]), str(s["sha256"])) for s in info["shards"]]
        parent, _, attr = table.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                ShardedRows(table, int(info["rows"]), int(info["dim"]), shards, cache))
    dense_location = storage.join(base, manifest["dense"]["file"])
    try:
        dense = storage.read_bytes(dense_location)  # read once: the bytes checked are the bytes loaded
    except FileNotFoundError:
        raise DataError(f"sharded model file {dense_location} is missing: the export is incomplete or was "
                        "removed") from None
    if hashlib.sha256(dense).hexdigest() != manifest["dense"]["sha256"]:
        raise DataError(f"sharded model file {dense_location} does not match its SHA-256 in the manifest: "
                        "the file was changed or damaged; export the model again")
    state = torch.load(io.BytesIO(dense), weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DataError(f"{dense_location} does not fit the family's model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def opened_files(module: nn.Module) -> list[str]:
    """Every shard file the sharded tables of ``module`` have opened."""
    return [f for m in module.modules() if isinstance(m, ShardedRows) for f in m.opened]
