"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written complete-then-marked.

Layout: ``<checkpoint_dir>/step-XXXXXXXX/`` holds the DCP files of every rank plus ``COMPLETE.json``,
which rank 0 writes last, after every rank has finished writing. A folder without the marker is a
checkpoint that died half-way: readers ignore it and the next save at that step replaces it. Only the
marker is needed for atomicity, so the same scheme works on a shared filesystem and on object stores.

The state is ``{"model", "optim"}`` through ``torch.distributed.checkpoint.state_dict`` (so the same code
serves DDP now and FSDP2 later: keys are unwrapped FQNs, shards are resharded on load), the LR
scheduler's state and the loop position ``{"step", "epoch", "examples_seen"}``. ``checkpoint_dir`` must
be visible to every node.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from features.storage import write_json_atomic
from training.runtime import now_iso

log = logging.getLogger("training.checkpoint")

MARKER = "COMPLETE.json"
PREFIX = "step-"


def step_dir(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(checkpoint_dir) / f"{PREFIX}{step:08d}"


def complete_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    base = Path(checkpoint_dir)
    if not base.is_dir():
        return []
    found = []
    for path in base.glob(f"{PREFIX}*"):
        suffix = path.name[len(PREFIX) :]
        if suffix.isdigit() and (path / MARKER).exists():
            found.append((int(suffix), path))
    return sorted(found)


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker of the newest complete checkpoint (step, epoch, examples_seen, path, ...), or None."""
    import json

    for _, path in reversed(complete_checkpoints(checkpoint_dir)):
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError) as e:
            log.warning("ignoring checkpoint %s with an unreadable marker: %s", path, e)
            continue
        return {**marker, "path": str(path)}
    return None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}


def save(
    checkpoint_dir: str | os.PathLike[str],
    *,
    step: int,
    epoch: int,
    examples_seen: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    is_main: bool,
    keep: int = 2,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save on every rank (a collective); rank 0 marks the folder complete and prunes old checkpoints."""
    path = step_dir(checkpoint_dir, step)
    if is_main:
        if path.exists():  # a save at this step that died before its marker, or an older run's
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()
    state = _state(model, optimizer, scheduler)
    state["train"] = {"step": step, "epoch": epoch, "examples_seen": examples_seen}
    dcp.save(state, checkpoint_id=str(path))
    _barrier()  # every rank's files are in place
    if is_main:
        marker = {
            "step": step,
            "epoch": epoch,
            "examples_seen": examples_seen,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "time": now_iso(),
            **(extra or {}),
        }
        write_json_atomic(path / MARKER, marker)
        for _, old in complete_checkpoints(checkpoint_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint step %d written to %s", step, path)
    return path


def load(
    path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, int]:
    """Load a checkpoint into model, optimizer and scheduler (on every rank); return its loop position."""
    state = _state(model, optimizer, scheduler)
    state["train"] = {"step": 0, "epoch": 0, "examples_seen": 0}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return {k: int(v) for k, v in state["train"].items()}
