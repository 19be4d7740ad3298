"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written complete-then-marked.

Layout: ``<checkpoint_dir>/step-XXXXXXXX/`` holds the DCP files of every rank plus ``COMPLETE.json``,
which rank 0 writes last, after every rank has finished writing. A folder without the marker is a
checkpoint that died half-way: readers ignore it and the next save at that step replaces it. Only the
marker is needed for atomicity, so the same scheme works on a shared filesystem and on object stores:
``checkpoint_dir`` is a local path (DCP's ``FileSystemWriter``) or a URL such as ``s3://bucket/prefix``
(DCP's fsspec writer and reader; the marker is one PUT, and finding the newest complete checkpoint is one
listing of the markers).

The state is ``{"model", "optim"}`` through ``torch.distributed.checkpoint.state_dict`` (the same code
serves DDP and FSDP2: keys are unwrapped FQNs, sharded tables are saved shard by shard and resharded on
load; a TorchRec ``DistributedModelParallel`` part gives its own state dicts, its tables and their fused
optimizer state as ShardedTensors, which DCP reshards the same way), the LR scheduler's state, the loop
position ``{"step", "epoch", "examples_seen"}``, the input pipeline's position ``data`` and every rank's RNG
states ``rng.rank<r>``; other trained parts (the ablation model) are saved alongside under their name as a
prefix. ``checkpoint_dir`` must be visible to every node.

Loading a DCP checkpoint unpickles its ``.metadata`` (``pickle.load``) and its non-tensor items
(``torch.load(weights_only=False)``): a file crafted by anyone who can write under the storage root's
``models/`` would run code in the training job. So the marker records the SHA-256 of every file of the
checkpoint (rank 0 hashes them once every rank has written), and :func:`load` checks every file against it
before DCP opens any of them. Checksums beside the files prove nothing to someone who can rewrite the marker
too, so the marker is signed: an HMAC-SHA256 of its content with the platform's checkpoint key
(``PINFLOW_CHECKPOINT_KEY`` in the job's environment: on the embedded default a key made once under
``<PINFLOW_HOME>/secrets/``, in production the secret that ``batch.checkpoint_key_secret`` or
``kubernetes.checkpoint_key_secret`` names), which is never stored beside the checkpoints. A checkpoint with a
changed, missing or extra file, a marker without checksums, or (where the key is set) a marker unsigned or signed
with another key, is refused with a :class:`~core.failures.DataError` (DATA: the stored checkpoint is bad input;
retrying cannot help and nothing may resume from it: delete that ``step-*`` folder, after looking at who wrote it,
to start the run from its previous checkpoint or from scratch). Without a key the checksums are still checked,
and the job says that its checkpoints are not signed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from core import storage
from core.failures import ConfigError, DataError, ExitCode, InfraError, exit_code_for
from training.runtime import now_iso

log = logging.getLogger("training.checkpoint")

MARKER = "COMPLETE.json"
KEY_ENV = "PINFLOW_CHECKPOINT_KEY"  # the checkpoint signing key (a secret: never written beside the checkpoints)
SIGNATURE = "signature"
PREFIX = "step-"
# Read in pieces of this size when hashing, so that a checkpoint file of any size fits in memory.
_CHUNK = 8 * 1024 * 1024
# A sharded table's rows are saved in items of at most this many bytes: DCP's load reads a saved item whole before
# copying it into place, so one item of a rank's whole shard would hold that shard twice at a resume.
SAVE_ITEM_BYTES = 16 * 1024 * 1024




@functools.cache  # once per process
def _warn_unsigned() -> None:
    log.warning("checkpoints are not signed (%s is not set): their checksums are checked on load, but someone who "
                "can write the checkpoint folder could rewrite them too", KEY_ENV)


def step_dir(checkpoint_dir: str | os.PathLike[str], step: int) -> str:
    return storage.join(checkpoint_dir, f"{PREFIX}{step:08d}")


def complete_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """(step, folder path or URL) of every complete checkpoint, oldest first."""
    found = []
    for marker in storage.glob(checkpoint_dir, f"{PREFIX}*/{MARKER}"):
        path = os.path.dirname(marker)  # a local path or a URL: both are /-separated here
        suffix = os.path.basename(path)[len(PREFIX) :]
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker of the newest complete checkpoint (step, epoch, examples_seen, path, ...), or None."""
    for _, path in reversed(complete_checkpoints(checkpoint_dir)):
        try:
            marker = json.loads(storage.read_text(storage.join(path, MARKER)))
        except (OSError, ValueError) as e:
            log.warning("ignoring checkpoint %s with an unreadable marker: %s", path, e)
            continue
        return {**marker, "path": path}
    return None


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint folder, its marker first: a deletion cut short never leaves a "complete" half."""
    storage.remove(storage.join(path, MARKER))
    storage.remove_tree(path)


def checkpoint_files(path: str | os.PathLike[str]) -> list[str]:
    """Names (relative, ``/``-separated) of every file of a checkpoint folder but its marker, sorted."""
    path = os.fspath(path)
    if storage.is_remote(path):
        fs, key = storage.filesystem(path)
        prefix = key.rstrip("/") + "/"
        names = [found[len(prefix):] for found in fs.find(key) if found.startswith(prefix)]
    else:
        base = storage.local_path(path)
        names = [p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()] if base.is_dir() else []
    return sorted(name for name in names if name != MARKER)


def file_sha256(location: str) -> str:
    """The SHA-256 (hex) of a file, a local path or a URL, read in pieces."""
    digest = hashlib.sha256()
    if storage.is_remote(location):
        fs, key = storage.filesystem(location)
        opened = fs.open(key, "rb")
    else:
        opened = storage.local_path(location).open("rb")
    with opened as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{file name: SHA-256}`` of every file of a checkpoint folder but its marker."""
    return {name: file_sha256(storage.join(path, name)) for name in checkpoint_files(path)}


def signing_key() -> bytes | None:
    """The platform's checkpoint key from the job's environment, or None (checkpoints then go unsigned)."""
    key = os.environ.get(KEY_ENV, "")
    return key.encode() if key else None


def signature(marker: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 of the marker's content (its signature left out), as canonical JSON."""
    content = json.dumps({k: v for k, v in marker.items() if k != SIGNATURE}, sort_keys=True, default=str)
    return hmac.new(key, content.encode(), hashlib.sha256).hexdigest()


def verification_problems(path: str | os.PathLike[str], marker: dict[str, Any] | None = None) -> list[str]:
    """Why the files of a checkpoint cannot be trusted (empty: every file is the one its marker recorded).

    ``marker`` is the checkpoint's ``COMPLETE.json`` (read from ``path`` when not given). Reads every file.
    """
    path = os.fspath(path)
    if marker is None:
        try:
            marker = json.loads(storage.read_text(storage.join(path, MARKER)))
        except FileNotFoundError:
            return [f"no {MARKER} marker: the checkpoint is incomplete"]
        except ValueError as e:
            return [f"unreadable {MARKER}: {e}"]
    key = signing_key()
    if key is not None and not isinstance(marker.get(SIGNATURE), str):
        return [f"{MARKER} is not signed, and checkpoints are signed here ({KEY_ENV} is set)"]
    if key is not None and not hmac.compare_digest(signature(marker, key), str(marker[SIGNATURE])):
        return [f"{MARKER}'s signature does not match: it was not written with this platform's checkpoint key"]
    recorded = marker.get("files")
    if not isinstance(recorded, dict) or not recorded:
        return [f"{MARKER} records no checksums of the checkpoint's files (written before checksums were recorded?)"]
    present = set(checkpoint_files(path))
    problems = [f"{name}: missing" for name in sorted(set(recorded) - present)]
    problems += [f"{name}: not written by the save (not in {MARKER})" for name in sorted(present - set(recorded))]
    for name in sorted(present & set(recorded)):
        actual = file_sha256(storage.join(path, name))
        if actual != recorded[name]:
            problems.append(f"{name}: SHA-256 {actual[:16]}... differs from the recorded {str(recorded[name])[:16]}...")
    return problems


def verify(path: str | os.PathLike[str], marker: dict[str, Any] | None = None) -> None:
    """Raise DataError unless every file of the checkpoint is the one its save recorded (before any unpickling)."""
    problems = verification_problems(path, marker)
    if problems:
        raise DataError(
            f"checkpoint {os.fspath(path)} refused: its files are not the ones pinflow wrote ({'; '.join(problems[:5])}"
            f"{f'; and {len(problems) - 5} more' if len(problems) > 5 else ''}). Loading it could run code from a "
            f"crafted file; if it was not tampered with, it is corrupt. Delete that folder to resume from the "
            f"previous checkpoint (or from scratch), after finding out who wrote it."
        )


def _writer(path: str) -> dcp.StorageWriter:
    if storage.is_remote(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # An object is durable once its upload completes: no fsync (which would os.sync() this node).
        return FsspecWriter(path, sync_files=False)
    return dcp.FileSystemWriter(path)


def _reader(path: str) -> dcp.StorageReader:
    if storage.is_remote(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
    return dcp.FileSystemReader(path)


def _failed(action: str, path: str, exc: CheckpointException) -> Exception:
    """DCP's CheckpointException (a BaseException: no ``except Exception`` sees it) as an error of a class.

    DCP raises it on every rank when any rank failed. A storage that failed for a while (no answer, a
    5xx, a full disk, an I/O error) is INFRA: the job is retried and resumes from the previous complete
    checkpoint. Anything else (a missing file, a denied write, a bug) is USER: fail now with the message.
    """
    causes = [cause for cause, _ in (exc.failures[rank] for rank in sorted(exc.failures))]
    message = f"checkpoint {action} at {path} failed on rank(s) {sorted(exc.failures)}: " + "; ".join(
        f"{type(cause).__name__}: {cause}" for cause in causes[:2]
    )

    def transient(cause: BaseException) -> bool:
        if exit_code_for(cause) == ExitCode.INFRA:
            return True
        return isinstance(cause, OSError) and not isinstance(cause, PermissionError | FileNotFoundError)

    return InfraError(message) if any(transient(c) for c in causes) else RuntimeError(message)


def _verified_on_every_rank(path: str) -> None:
    """verify() on rank 0; every rank raises the same DataError if it failed (none waits in a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        verify(path)
        return
    outcome: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            verify(path)
        except DataError as e:
            outcome[0] = str(e)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise DataError(outcome[0])


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# A trained part: its module (plain, DDP- or FSDP2-wrapped), optimizer and LR scheduler.
Part = tuple[nn.Module, torch.optim.Optimizer, Any]


def _prefix(name: str) -> str:
    return "" if name == "model" else f"{name}_"


def _is_torchrec(model: nn.Module) -> bool:
    return type(model).__name__ == "DistributedModelParallel"


def _state(parts: dict[str, Part], loading: bool = False) -> dict[str, Any]:
    """Every part's state by its prefix. A TorchRec part (``DistributedModelParallel``) gives its own state
    dicts: sharded tables and the fused optimizer's state as ShardedTensors (DCP saves each rank's shards and
    reshards on load), the dense AdamW's keyed by FQN; ``loading`` first creates that AdamW's lazy state, so
    that DCP can load into it in place."""
    state: dict[str, Any] = {}
    for name, (model, optimizer, scheduler) in parts.items():
        if _is_torchrec(model):
            from training.torchrec_sharding import init_optimizer_state

            if loading:
                for _, child in getattr(optimizer, "optimizers", []):
                    if not child.state or len(child.state) < len(child.params):
                        init_optimizer_state(child)
            model_sd, optim_sd = dict(model.state_dict()), dict(optimizer.state_dict())
            if not loading:
                model_sd, optim_sd = _in_items(model_sd), _in_items(optim_sd)
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
        p = _prefix(name)
        state.update({f"{p}model": model_sd, f"{p}optim": optim_sd, f"{p}scheduler": scheduler.state_dict()})
    return state


def _in_items(value: Any) -> Any:
    """``value`` (a state dict, nested) with every ShardedTensor's shards cut by rows into views of at most
    ``SAVE_ITEM_BYTES`` (no copy), so that DCP saves, and a resume reads, a sharded table a bounded item at a time.
    The cut depends only on the global shard layout, so every rank computes the same metadata without talking."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(value, dict):
        return {k: _in_items(v) for k, v in value.items()}
    if not isinstance(value, ShardedTensor) or not value.size() or value.size()[0] == 0:
        return value
    meta = value.metadata()
    element = torch.empty((), dtype=meta.tensor_properties.dtype).element_size()

    def row_bytes(md: ShardMetadata) -> int:
        return element * math.prod(md.shard_sizes[1:])

    def cut(md: ShardMetadata) -> list[tuple[int, ShardMetadata]]:
        step = max(1, SAVE_ITEM_BYTES // max(1, row_bytes(md)))
        rows = md.shard_sizes[0]
        return [(start, ShardMetadata([md.shard_offsets[0] + start, *md.shard_offsets[1:]],
                                      [min(step, rows - start), *md.shard_sizes[1:]], md.placement))
                for start in range(0, rows, step)] or [(0, md)]

    if all(md.shard_sizes[0] * row_bytes(md) <= SAVE_ITEM_BYTES for md in meta.shards_metadata):
        return value  # nothing to cut: the layout saved stays one item per shard
    local = [Shard(shard.tensor[start:start + piece.shard_sizes[0]], piece)
             for shard in value.local_shards() for start, piece in cut(shard.metadata)]
    meta = copy.copy(meta)
    meta.shards_metadata = [piece for md in value.metadata().shards_metadata for _, piece in cut(md)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta, process_group=value._process_group)


def rng_state() -> dict[str, Any]:
    """This process's random number generators: torch (CPU and CUDA), NumPy's global one, Python's."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank_key() -> str:
    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"


def save(
    checkpoint_dir: str | os.PathLike[str],
    *,
    step: int,
    epoch: int,
    examples_seen: int,
    parts: dict[str, Part],
    is_main: bool,
    data: dict[str, int] | None = None,
    keep: int = 2,
    extra: dict[str, Any] | None = None,
) -> str:
    """Save on every rank (a collective); rank 0 marks the folder complete and prunes old checkpoints.

    ``parts`` maps a name to (module, optimizer, scheduler); ``"model"`` is the trained model. ``data``
    is the input pipeline's position (``ExampleStream.position``). Each rank's RNG states are saved
    under its own key, so a resumed run draws the same random numbers.
    """
    path = step_dir(checkpoint_dir, step)
    if is_main:
        remove_checkpoint(path)  # a save at this step that died before its marker, or an older run's
        storage.make_dirs(path)
    _barrier()
    state = _state(parts)
    state["train"] = {"step": step, "epoch": epoch, "examples_seen": examples_seen}
    state["data"] = dict(data or {})
    state["rng"] = {_rank_key(): rng_state()}
    try:
        dcp.save(state, checkpoint_id=path, storage_writer=_writer(path))
    except CheckpointException as e:
        raise _failed("save", path, e) from e
    _barrier()  # every rank's files are in place
    if is_main:
        marker = {
            "step": step,
            "epoch": epoch,
            "examples_seen": examples_seen,
            "data": dict(data or {}),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "parts": sorted(parts),
            "time": now_iso(),
            **(extra or {}),
            # Every rank's files are complete (barrier above): what load() verifies before unpickling anything.
            "files": checksums(path),
        }
        key = signing_key()
        if key is not None:
            marker[SIGNATURE] = signature(marker, key)
        else:
            _warn_unsigned()
        storage.write_json(storage.join(path, MARKER), marker)
        # Checkpoints past this step are an earlier world's (resumed on more ranks, a run counts fewer steps an epoch:
        # training.train's continue_at_same_share): this one supersedes them, or they would stay the newest.
        for old_step, old in complete_checkpoints(checkpoint_dir):
            if old_step > step:
                remove_checkpoint(old)
        for _, old in complete_checkpoints(checkpoint_dir)[:-keep]:
            remove_checkpoint(old)
        log.info("checkpoint step %d written to %s", step, path)
    return path


def _shape(value: Any) -> tuple[int, ...] | None:
    """The global shape of a state value (a tensor, a ShardedTensor, a DTensor), None for anything else."""
    if hasattr(value, "local_shards") and callable(getattr(value, "metadata", None)):  # a ShardedTensor
        return tuple(int(n) for n in value.metadata().size)
    if isinstance(value, torch.Tensor):
        return tuple(int(n) for n in value.size())
    return None


def _dims(shape: tuple[int, ...]) -> str:
    return " x ".join(str(n) for n in shape) or "a scalar"


def model_mismatches(metadata: Any, state: dict[str, Any], parts: dict[str, Part]) -> list[str]:
    """What differs between the models of ``parts`` (their state in ``state``) and those a checkpoint holds
    (its DCP ``metadata``): a tensor with another shape (a table's rows x width), or one only one side has.
    Reads the metadata alone (no tensor), so a checkpoint of another model is refused before it is loaded."""
    saved = metadata.state_dict_metadata
    problems: list[str] = []
    for name in parts:
        key = f"{_prefix(name)}model"
        here = {f"{key}.{k}": _shape(v) for k, v in state.get(key, {}).items()}
        there = {k: tuple(int(n) for n in m.size) for k, m in saved.items() if k.startswith(f"{key}.") and
                 hasattr(m, "size") and hasattr(m, "chunks")}
        for k in sorted(set(here) | set(there)):
            what = k.split(".", 1)[1].removesuffix(".weight")
            what = what.split(".ebc.embedding_bags.")[0]  # a TorchRec table by its module's name
            a, b = here.get(k), there.get(k)
            if k not in there and a is not None:
                problems.append(f"{name}: {what} ({_dims(a)}) is not in the checkpoint")
            elif k not in here:
                problems.append(f"{name}: the checkpoint's {what} ({_dims(b or ())}) is not in this model")
            elif a is not None and a != b:
                problems.append(f"{name}: {what} is {_dims(b or ())} in the checkpoint, {_dims(a)} in this model")
    return problems


def load(path: str | os.PathLike[str], *, parts: dict[str, Part], restore_rng: bool = True) -> dict[str, Any]:
    """Load a checkpoint into every part (on every rank); return its loop position.

    Returns ``{"step", "epoch", "examples_seen", "data"}``. The RNG states of this rank are restored when
    ``restore_rng`` (only meaningful with the world size the checkpoint was written with).

    First every file is checked against the checksums in the marker (by rank 0, which tells the others):
    a checkpoint whose files are not the ones its save wrote raises DataError on every rank, before DCP
    unpickles anything. Then its models' tensors are compared with the parts' by name and shape
    (:func:`model_mismatches`): a checkpoint of another model raises ConfigError (USER) naming the tables and
    their sizes, before any tensor is read. A checkpoint of another world size or sharding loads resharded.
    """
    path = os.fspath(path)
    _verified_on_every_rank(path)
    state = _state(parts, loading=True)
    state["train"] = {"step": 0, "epoch": 0, "examples_seen": 0}
    if restore_rng:
        state["rng"] = {_rank_key(): rng_state()}
    metadata = _reader(path).read_metadata()
    problems = model_mismatches(metadata, state, parts)
    if problems:
        raise ConfigError(
            f"checkpoint {path} is not of this run's model ({len(problems)} difference(s)): {'; '.join(problems[:6])}"
            f"{'; ...' if len(problems) > 6 else ''}. Train with the params it was saved with, or use a new "
            "checkpoint_dir"
        )
    has_data = any(key.startswith("data.") or key == "data" for key in metadata.state_dict_metadata)
    if has_data:
        state["data"] = {k.split(".", 1)[1]: 0 for k in metadata.state_dict_metadata if k.startswith("data.")}
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=_reader(path))
    except CheckpointException as e:
        raise _failed("load", path, e) from e
    for name, (model, optimizer, scheduler) in parts.items():
        p = _prefix(name)
        if _is_torchrec(model):
            model.load_state_dict(state[f"{p}model"])
            optimizer.load_state_dict(state[f"{p}optim"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state[f"{p}model"], optim_state_dict=state[f"{p}optim"])
        scheduler.load_state_dict(state[f"{p}scheduler"])
        # The learning rates the schedule had set (TorchRec's optimizers do not save their param groups).
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    if restore_rng:
        set_rng_state(state["rng"][_rank_key()])
    position: dict[str, Any] = {k: int(v) for k, v in state["train"].items()}
    position["data"] = {k: int(v) for k, v in state.get("data", {}).items()}
    return position
