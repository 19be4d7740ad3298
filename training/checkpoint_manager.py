"""The training loop's view of checkpoints: save the run's state, resume from the newest complete one.

:class:`CheckpointManager` holds what a checkpoint is made of (the trained parts, the input stream, the
count of examples seen) and remembers the step it last saved; :mod:`training.checkpoint` does the writing
and reading (DCP, the ``COMPLETE.json`` marker, RNG states). Like torchtitan's ``CheckpointManager``, the
loop only says *when*: ``save(step, epoch, batches_in_epoch)`` and, once at the start, ``resume()``.
"""

from __future__ import annotations

import json
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
    exact: bool  # the run continues bit for bit as the uninterrupted run would (same layout, input position saved)
    saved_world_size: int | None
    data_restored: bool = False  # the input position and the ranks' RNG states were restored (same world size)
    reason: str = ""  # why it is exact, or why not
    saved_sharding: str | None = None
    world_size: int | None = None
    sharding: str | None = None
    saved_steps_per_epoch: tuple[int, ...] = ()  # the saved run's steps of each epoch (empty: older code's marker)

    def summary(self) -> dict[str, Any]:
        """What result.json says of the resume."""
        return {
            "from": self.path, "step": self.step, "exact": self.exact, "reason": self.reason,
            "data_restored": self.data_restored,
            "saved": {"world_size": self.saved_world_size, "sharding": self.saved_sharding},
            "now": {"world_size": self.world_size, "sharding": self.sharding},
        }


# What a resumed run must share with the checkpoint's: what it trains on and is evaluated on, the model, and what the
# optimizer and LR schedule restore from the checkpoint. Not: epochs and step caps (a run may be extended), the world
# size and sharding (resharded: resume_verdict), the batch size (the input position checks it), the storage root
# (a moved copy) and how the job runs (workers, threads, heartbeats, checkpoint cadence).
RESUME_SETTINGS = ("family", "family_module", "train_days", "eval_ds", "params", "lr", "weight_decay", "warmup_steps",
                   "min_lr_ratio", "grad_clip", "seed", "sparse_lr")


def resume_settings(config: RunConfig) -> dict[str, Any]:
    """``RESUME_SETTINGS`` of ``config``, as the checkpoint marker records them (JSON values)."""
    values = config.to_dict()
    return dict(json.loads(json.dumps({key: values[key] for key in RESUME_SETTINGS})))


def resume_verdict(
    marker: dict[str, Any], world_size: int, sharding: str | None, has_position: bool
) -> tuple[bool, str]:
    """Whether resuming the checkpoint of ``marker`` on ``world_size`` ranks with ``sharding`` (None: not
    sharded) is exact, and why. Every resume restores the model, the optimizers (their sharded state resharded
    by DCP, bit for bit), the LR schedule and the step; only one with the same world size and sharding and a
    saved input position continues exactly as the uninterrupted run would."""
    saved_ws, saved_sh = marker.get("world_size"), marker.get("sharding")
    why: list[str] = []
    if saved_ws != world_size:
        why.append(
            f"saved by {saved_ws} rank(s), resumed on {world_size}: the model and optimizer state are resharded "
            "bit for bit and training continues from the same step, but each rank's batches, its random numbers "
            "(dropout) and the reduced gradients are not the uninterrupted run's"
        )
    if saved_sh is not None and sharding is not None and saved_sh != sharding:
        why.append(
            f"saved {saved_sh}, resumed {sharding}: the tables are resharded bit for bit, but their gradients are "
            "summed in another order across the new shards"
        )
    if not why and not has_position:
        why.append("the checkpoint has no input position: the epoch restarts its data order")
    if why:
        return False, "; ".join(why)
    layout = f"{world_size} rank(s)" + (f", {sharding}" if sharding else "")
    return True, f"same layout as saved ({layout}): model, optimizers, input position and every rank's RNG restored"


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

    def _check_settings(self, marker: dict[str, Any]) -> None:
        """ConfigError if the checkpoint's run was trained with other RESUME_SETTINGS than this RUN.json's: the resume
        would restore that run's optimizer and schedule (ignoring a new lr), continue its MLflow run under its first
        params and report its model. A marker of older code records none: not checked."""
        saved = marker.get("settings")
        if not isinstance(saved, dict):
            return
        now = resume_settings(self.config)
        differ = [f"{key}: saved {saved.get(key)!r}, now {now.get(key)!r}" for key in sorted(set(saved) | set(now))
                  if saved.get(key) != now.get(key)]
        if differ:
            raise ConfigError(
                f"checkpoint {marker['path']} is of a run trained with other settings than this RUN.json's "
                f"({'; '.join(differ)}): resuming it would continue that run and ignore them. Resume with its settings, "
                "or give this run a checkpoint_dir of its own to train from scratch (a DAG run: trigger a new run; the demo: "
                "make clean)"
            )

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
        if names != marker.get("parts", ["model"]):
            raise ConfigError(
                f"checkpoint {marker['path']} holds {marker.get('parts')} but this run trains {names}: "
                "keep `ablation` as it was, or use a new checkpoint_dir"
            )
        same_world = marker.get("world_size") == self.env.world_size
        position = checkpoint.load(marker["path"], parts=self.parts, restore_rng=same_world)
        self._check_settings(marker)  # after the load, which names a model of another shape more precisely
        data_restored = bool(same_world and position["data"])
        if data_restored:
            self.stream.load_position(position["data"])
        sharding = self.extra.get("sharding")
        exact, reason = resume_verdict(marker, self.env.world_size, sharding, bool(position["data"]))
        self.last_saved = position["step"]
        return Resumed(
            path=marker["path"],
            step=position["step"],
            epoch=position["epoch"],
            examples_seen=position["examples_seen"],
            exact=exact,
            saved_world_size=marker.get("world_size"),
            data_restored=data_restored,
            reason=reason,
            saved_sharding=marker.get("sharding"),
            world_size=self.env.world_size,
            sharding=sharding,
            saved_steps_per_epoch=tuple(int(n) for n in marker.get("steps_per_epoch") or ()),
        )
