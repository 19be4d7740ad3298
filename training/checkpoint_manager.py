"""The training loop's view of checkpoints: save the run's state, resume from the newest complete one.

:class:`CheckpointManager` holds what a checkpoint is made of (the trained parts, the input stream, the
count of examples seen) and remembers the step it last saved; :mod:`training.checkpoint` does the writing
and reading (DCP, the ``COMPLETE.json`` marker, RNG states). Like torchtitan's ``CheckpointManager``, the
loop only says *when*: ``save(step, epoch, batches_in_epoch)`` and, once at the start, ``resume()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from core.failures import ConfigError
from training import checkpoint
from training.checkpoint import Part
from training.config import RunConfig
from training.data import ExampleStream
from training.runtime import DistEnv, Heartbeat


def checkpoint_interval(every: int, total_steps: int) -> int:
    """Steps between periodic checkpoints: ``every`` (``checkpoint_every``), but at least ten in a run of
    ``total_steps`` (a run shorter than ``every`` would otherwise save none before its end, and each retry of it
    would start again from step 0); 0: only at the end."""
    return min(every, max(1, -(-total_steps // 10))) if every and total_steps else every


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run continues: the loaded checkpoint's loop position and whether it is exact."""

    path: str
    step: int
    epoch: int
    examples_seen: int  # by all ranks, over every earlier try
    exact: bool  # same world size and a saved input position: the data order continues exactly
    saved_world_size: int | None


class CheckpointManager:
    """Saves and restores the parts, the input position and every rank's RNG states (collectives: every rank).

    ``examples_seen`` counts the examples trained on by all ranks over every try (itself a collective);
    ``extra`` goes into each checkpoint's marker.
    """

    def __init__(
        self,
        config: RunConfig,
        env: DistEnv,
        heartbeat: Heartbeat,
        *,
        parts: dict[str, Part],
        stream: ExampleStream,
        examples_seen: Callable[[], int],
        extra: dict[str, Any],
    ) -> None:
        self.config = config
        self.env = env
        self.heartbeat = heartbeat
        self.parts = parts
        self.stream = stream
        self.examples_seen = examples_seen
        self.extra = extra
        self.last_saved = -1  # the step of the newest complete checkpoint of this run, -1 before the first

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of the periodic checkpoint steps (:func:`checkpoint_interval`)."""
        every = checkpoint_interval(self.config.checkpoint_every, int(self.extra.get("total_steps") or 0))
        return bool(every) and step % every == 0

    def save(self, step: int, epoch: int, batches_in_epoch: int) -> None:
        """Checkpoint the state after ``step``: ``batches_in_epoch`` batches of ``epoch`` are consumed."""
        cfg, hb = self.config, self.heartbeat
        hb.update(progress=0, force=True, phase="checkpointing")
        checkpoint.save(
            cfg.checkpoint_dir,
            step=step,
            epoch=epoch,
            examples_seen=self.examples_seen(),
            parts=self.parts,
            data=self.stream.position(epoch, batches_in_epoch),
            is_main=self.env.is_main,
            keep=cfg.keep_checkpoints,
            extra=self.extra,
        )
        self.last_saved = step
        hb.update(progress=0, force=True, phase="training")

    def resume(self) -> Resumed | None:
        """Load the newest complete checkpoint into the parts, the RNGs and the stream; None if there is none.

        Rank 0 picks the checkpoint, every rank loads the same one. With another world size (or a
        checkpoint without an input position) the parts are resharded but the RNG states and the data
        order are not restored: ``exact`` is False.
        """
        found = [checkpoint.latest_checkpoint(self.config.checkpoint_dir) if self.env.is_main else None]
        dist.broadcast_object_list(found, src=0)
        marker = found[0]
        if marker is None:
            return None
        names = sorted(self.parts)
        same_layout = marker.get("world_size") == self.env.world_size and names == marker.get("parts")
        if names != marker.get("parts", ["model"]):
            raise ConfigError(
                f"checkpoint {marker['path']} holds {marker.get('parts')} but this run trains {names}: "
                "keep `ablation` as it was, or use a new checkpoint_dir"
            )
        position = checkpoint.load(marker["path"], parts=self.parts, restore_rng=same_layout)
        exact = bool(same_layout and position["data"])
        if exact:
            self.stream.load_position(position["data"])
        self.last_saved = position["step"]
        return Resumed(
            path=marker["path"],
            step=position["step"],
            epoch=position["epoch"],
            examples_seen=position["examples_seen"],
            exact=exact,
            saved_world_size=marker.get("world_size"),
        )
