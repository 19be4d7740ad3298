"""Distributed training of the PinRanker: ``python -m training.train --config RUN.json``.

Runs under ``torchrun`` (any number of nodes and processes; it reads RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT as torchrun sets them) or alone as a world of one. CPU: gloo; CUDA: nccl and
bf16 autocast. ``strategy``: DDP, or FSDP2 (``fully_shard``: embedding tables and optimizer state sharded
across ranks). AdamW, warmup + cosine LR, gradient clipping, weighted per-head BCE. With ``ablation``
the model without the action sequence trains in lockstep on the same batches, for the evaluation.

Each rank writes ``<output_dir>/heartbeat-rank{r}.json`` every few seconds and, when it fails,
``<output_dir>/failure-rank{r}.json`` (exit code, failure class, message, traceback). Checkpoints go to
``<checkpoint_dir>/step-XXXXXXXX/`` every ``checkpoint_every`` steps and at the end; a (re)started job
resumes exactly from the newest complete one: model, optimizer, LR schedule, every rank's RNG states and
the input position (the data order is a function of seed and epoch; the batches already trained on in
that epoch are skipped without being read). At the end rank 0 evaluates on ``eval_ds``,
logs to MLflow (params, train loss, metrics, the exported model + feature spec), registers the model and
writes ``<output_dir>/result.json`` atomically. ``root``, ``output_dir``, ``checkpoint_dir`` and the
``--config`` file itself may be local paths or URLs such as ``s3://bucket/prefix/...`` (``training.storage_io``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import random
import sys
import time
from typing import Any

from training import storage_io
from training.config import ConfigError, RunConfig, fields_help
from training.failures import ExitCode, NanLossError
from training.runtime import DistEnv, Heartbeat, exit_code_for, failure_path, setup_logging, write_failure

log = logging.getLogger("training.train")

RESULT_FILE = "result.json"

EPILOG = f"""\
{fields_help()}

Exit codes (training.failures.ExitCode), one per failure class (DESIGN.md section 4):
  0    OK
  1    USER      a bug in the model code or an invalid RUN.json: fail now, fix the named field
  65   DATA      a missing, incomplete or malformed input partition: fail now, nothing downstream runs
  75   INFRA     a lost peer, a collective (gloo/NCCL) timeout, MLflow not answering, killed from outside:
                 retry; the job resumes exactly from the newest complete checkpoint
  76   NAN_LOSS  (class USER) the loss or the gradient norm became NaN/Inf on some rank: fail now; lower lr
  137  OOM       out of (GPU) memory, or the kernel's OOM killer: fail; lower batch_size or shard (fsdp)
Under torchrun the launcher's own exit code is 1 for any worker failure: start it with `python -m
training.launch --nproc-per-node=N ... -- -m training.train --config RUN.json`, which exits with the
failing worker's code (a worker killed by a signal: 75), or read <output_dir>/failure-rank*.json.
Health check before training: `python -m training.preflight --config RUN.json` (exits 0, 65 or 75).

Files: <output_dir>/heartbeat-rank<r>.json, failure-rank<r>.json, result.json;
<checkpoint_dir>/step-XXXXXXXX/ (DCP + COMPLETE.json), mlflow_run.json.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.train",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="path or URL (s3://...) of the run's RUN.json (fields below)")
    return parser


def lr_lambda(total_steps: int, warmup_steps: int, min_lr_ratio: float):  # noqa: ANN201 - a closure
    """Multiplier of the peak LR at scheduler step ``s``: linear warmup, then cosine to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def wrap(model: Any, strategy: str, device: Any) -> Any:
    """Wrap a PinRanker for data-parallel training.

    ``ddp``: DistributedDataParallel (every rank holds every parameter). ``fsdp``: FSDP2 ``fully_shard``
    with each embedding table and each transformer layer its own unit, then the rest: every parameter,
    the big tables first, and its optimizer state are split by rows across the ranks; a unit is gathered
    only while it computes. On CUDA its parameters compute in bf16 and gradients reduce in fp32.
    """
    import torch
    from torch import nn

    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings >= torch.distributed.get_world_size():
            fully_shard(module, mesh=mesh, mp_policy=policy)
    if getattr(model, "encoder", None) is not None:
        for layer in model.encoder.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def gather_full(module: Any, model_config: Any) -> Any:
    """A plain CPU PinRanker with the full weights of a wrapped one on rank 0 (None elsewhere); a collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from training.model import PinRanker

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    plain = PinRanker(model_config)
    plain.load_state_dict(state)
    return plain


class Trainer:
    def __init__(self, config: RunConfig, env: DistEnv, heartbeat: Heartbeat) -> None:
        self.config = config
        self.env = env
        self.heartbeat = heartbeat
        self.tracker: Any = None
        self.started = time.monotonic()

    # ----------------------------------------------------------------------------------------------
    def setup_distributed(self) -> Any:
        import torch
        import torch.distributed as dist

        cfg, env = self.config, self.env
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but CUDA is not available on this node; use device='auto'")
        if use_cuda:
            torch.cuda.set_device(env.local_rank)
            device = torch.device("cuda", env.local_rank)
        else:
            device = torch.device("cpu")
        backend = "nccl" if use_cuda else "gloo"
        timeout = dt.timedelta(seconds=cfg.dist_timeout_s)
        if env.launched:
            dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
        else:  # a world of one: an in-process store, no port to pick
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return device

    def run(self) -> dict[str, Any] | None:
        import numpy as np
        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader

        from training import checkpoint
        from training.data import ExampleStream, PinEmbeddings
        from training.failures import DataError
        from training.model import PinRanker, multitask_loss

        cfg, env, hb = self.config, self.env, self.heartbeat
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        device = self.setup_distributed()
        log.info("rank %d/%d on %s, strategy %s", env.rank, env.world_size, device, cfg.strategy)

        pins = PinEmbeddings.from_snapshot(cfg.root, max(cfg.train_days))
        stream = ExampleStream(
            cfg.root,
            cfg.train_days,
            pins,
            batch_size=cfg.batch_size,
            sequence_length=cfg.sequence_length,
            rank=env.rank,
            world_size=env.world_size,
            num_workers=cfg.num_workers,
            seed=cfg.seed,
        )
        steps_per_epoch = [stream.steps_per_epoch(e) for e in range(cfg.epochs)]
        if min(steps_per_epoch) == 0:
            raise DataError(
                f"{stream.total_rows} training rows in {len(stream.units)} row groups over {env.world_size} "
                f"ranks x {max(1, cfg.num_workers)} workers leave some rank without a batch: train on more "
                "days or use fewer processes"
            )
        epoch_start = [sum(steps_per_epoch[:e]) for e in range(cfg.epochs)]
        total_steps = sum(steps_per_epoch)
        if cfg.max_steps:
            total_steps = min(total_steps, cfg.max_steps)

        # The trained model and, in lockstep on the same batches, the ablation without the sequence.
        configs = {"model": cfg.model_config()}
        if cfg.ablation:
            configs["ablation"] = dataclasses.replace(configs["model"], use_sequence=False)
        modules: dict[str, Any] = {}
        parts: dict[str, Any] = {}
        for name, model_config in configs.items():
            torch.manual_seed(cfg.seed)  # the same initialisation on every rank
            module = wrap(PinRanker(model_config).to(device), cfg.strategy, device)
            optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda(total_steps, cfg.warmup_steps, cfg.min_lr_ratio)
            )
            modules[name] = module
            parts[name] = (module, optimizer, scheduler)
        torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank stream (dropout), saved in every checkpoint

        if env.is_main:
            from training.tracking import Tracker

            self.tracker = Tracker(cfg)
            self.tracker.log_params(
                {
                    **{k: v for k, v in cfg.to_dict().items() if k not in ("mlflow_tracking_uri",)},
                    "world_size": env.world_size,
                    "device": str(device.type),
                    "steps_per_epoch": steps_per_epoch,
                    "total_steps": total_steps,
                    "train_rows": stream.total_rows,
                    "pins_snapshot_ds": pins.ds,
                    "parameters": sum(p.numel() for p in modules["model"].parameters()),
                }
            )

        # Resume: rank 0 picks the checkpoint, everyone loads the same one.
        found = [checkpoint.latest_checkpoint(cfg.checkpoint_dir) if env.is_main else None]
        dist.broadcast_object_list(found, src=0)
        step, resumed_seen, local_seen = 0, 0, 0
        skip_first = 0
        if found[0] is not None:
            marker = found[0]
            same_layout = marker.get("world_size") == env.world_size and sorted(parts) == marker.get("parts")
            if sorted(parts) != marker.get("parts", ["model"]):
                raise ConfigError(
                    f"checkpoint {marker['path']} holds {marker.get('parts')} but this run trains {sorted(parts)}: "
                    "keep `ablation` as it was, or use a new checkpoint_dir"
                )
            position = checkpoint.load(marker["path"], parts=parts, restore_rng=same_layout)
            step, resumed_seen = position["step"], position["examples_seen"]
            if same_layout and position["data"]:
                stream.load_position(position["data"])
                skip_first = stream.skip
            else:  # another world size: the model and optimizer are resharded, the data order is not exact
                log.warning(
                    "resuming %s with world size %d (saved with %s): not an exact resume",
                    marker["path"],
                    env.world_size,
                    marker.get("world_size"),
                )
            hb.update(progress=0, epoch=position["epoch"])
            log.info("resumed from %s at step %d", marker["path"], step)
        last_saved = step if found[0] is not None else -1

        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        weights = cfg.label_weights()
        last_loss = math.nan
        hb.update(progress=0, force=True, phase="training", step=step, total_steps=total_steps)

        def examples_seen() -> int:
            """Examples trained on by all ranks, over every try (a collective)."""
            seen = torch.tensor([local_seen], dtype=torch.int64, device=device)
            dist.all_reduce(seen)
            return resumed_seen + int(seen.item())

        def save(batches_in_epoch: int) -> None:
            nonlocal last_saved
            hb.update(progress=0, force=True, phase="checkpointing")
            checkpoint.save(
                cfg.checkpoint_dir,
                step=step,
                epoch=epoch,
                examples_seen=examples_seen(),
                parts=parts,
                data=stream.position(epoch, batches_in_epoch),
                is_main=env.is_main,
                keep=cfg.keep_checkpoints,
                extra={"total_steps": total_steps, "strategy": cfg.strategy},
            )
            last_saved = step
            hb.update(progress=0, force=True, phase="training")

        epoch = 0
        batches_in_epoch = 0
        for module in modules.values():
            module.train()
        for epoch in range(cfg.epochs):
            if step >= total_steps:
                break
            if step >= epoch_start[epoch] + steps_per_epoch[epoch]:
                continue  # finished before the restart
            skip = step - epoch_start[epoch]
            if skip_first and stream.epoch == epoch and stream.skip != skip:
                raise ConfigError(  # a checkpoint whose data position disagrees with its step: a bug
                    f"checkpoint data position {stream.skip} disagrees with step {step} of epoch {epoch}"
                )
            stream.set_epoch(epoch, skip)  # the skipped batches are not read at all
            loader = DataLoader(
                stream,
                batch_size=None,
                num_workers=cfg.num_workers,
                pin_memory=device.type == "cuda",
                persistent_workers=False,
                # Its own generator: starting a loader draws a seed, which must not move the global RNG
                # (a resumed run starts one more loader than the uninterrupted run did).
                generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch),
            )
            batches_in_epoch = skip
            for batch in loader:
                if batches_in_epoch >= steps_per_epoch[epoch] or step >= total_steps:
                    break
                labels = batch.pop("labels").to(device, non_blocking=True)
                batch.pop("impression_id")
                inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                losses = []
                heads: dict[str, Any] = {}
                for name, module in modules.items():
                    with autocast:
                        logits = module(inputs)
                    loss, per_head = multitask_loss(logits, labels, weights)
                    if name == "model":
                        heads = per_head
                    losses.append(loss)
                if cfg.fail_nan_at_step is not None and step == cfg.fail_nan_at_step and env.rank == env.world_size - 1:
                    losses[0] = losses[0] * math.nan
                # The mean losses over ranks, for logging and for a NaN check every rank agrees on.
                reduced = torch.stack([*(v.detach() for v in losses), *(v.detach() for v in heads.values())]).float()
                dist.all_reduce(reduced)
                stats: list[float] = (reduced / env.world_size).cpu().tolist()
                if not all(math.isfinite(v) for v in stats):
                    raise NanLossError(
                        f"loss is {stats[0]} at step {step} (epoch {epoch}); per head "
                        f"{dict(zip(heads, stats[len(losses) :], strict=True))}: lower lr (now {cfg.lr}) or grad_clip"
                    )
                norms = []
                for (name, (module, optimizer, scheduler)), loss in zip(parts.items(), losses, strict=True):
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip or math.inf)
                    norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
                    if not math.isfinite(norms[-1]):
                        raise NanLossError(f"the gradient norm of {name} is {norms[-1]} at step {step}: lower lr")
                    optimizer.step()
                    scheduler.step()
                step += 1
                batches_in_epoch += 1
                local_seen += labels.shape[0]
                last_loss = stats[0]
                hb.update(examples=labels.shape[0], step=step, epoch=epoch, loss=last_loss)
                if self.tracker is not None and (step % cfg.log_every == 0 or step == total_steps):
                    lr = parts["model"][2].get_last_lr()[0]
                    metrics = {"train_loss": stats[0], "lr": lr, "grad_norm": norms[0]}
                    metrics.update({f"train_loss_{k}": v for k, v in zip(heads, stats[len(losses) :], strict=True)})
                    if cfg.ablation:
                        metrics["train_loss_ablation"] = stats[1]
                    self.tracker.log_metrics(metrics, step=step, flush=True)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    save(batches_in_epoch)
                if cfg.debug_step_sleep_s:
                    time.sleep(cfg.debug_step_sleep_s)
        if last_saved != step:
            save(batches_in_epoch)
        total_seen = examples_seen()
        # Rank 0 evaluates alone: gather full (unsharded) weights while every rank is still here.
        full = {name: gather_full(module, configs[name]) for name, module in modules.items()}
        hb.update(progress=0, force=True, phase="trained", step=step)
        dist.destroy_process_group()  # no collective may wait on rank 0 from here on
        if not env.is_main:
            return None
        return self.finish(full["model"], pins, step, total_seen, last_loss, device, ablation=full.get("ablation"))

    # ----------------------------------------------------------------------------------------------
    def finish(
        self,
        model: Any,
        pins: Any,
        step: int,
        examples_seen: int,
        last_loss: float,
        device: Any,
        ablation: Any = None,
    ) -> dict[str, Any]:
        """Rank 0: evaluate (and the ablation without the sequence), log to MLflow, register, write result.json."""
        from features.contracts import DENSE_FEATURES, LABELS
        from training.data import PINS, PinEmbeddings, history_priors, latest_complete_day
        from training.evaluate import evaluate, flat_metrics
        from training.model import COUNT_FEATURES, SERVING_INPUTS

        cfg, hb = self.config, self.heartbeat
        hb.update(progress=0, force=True, phase="evaluating")
        same_snapshot = latest_complete_day(cfg.root, PINS, cfg.eval_ds) == pins.ds
        eval_pins = pins if same_snapshot else PinEmbeddings.from_snapshot(cfg.root, cfg.eval_ds)
        model = model.to(device)
        metrics = evaluate(
            model,
            cfg.root,
            cfg.eval_ds,
            sequence_length=cfg.sequence_length,
            batch_size=cfg.eval_batch_size,
            pins=eval_pins,
            device=device,
            on_batch=lambda _: hb.update(phase="evaluating"),
            ablation=ablation.to(device) if ablation is not None else None,
        )
        aucs = [v for v in metrics["auc"].values() if v is not None]
        metrics["mean_auc"] = sum(aucs) / len(aucs) if aucs else None
        metrics["train_loss"] = last_loss if math.isfinite(last_loss) else None
        log.info("evaluation on %s: %s", cfg.eval_ds, json.dumps(metrics))

        hb.update(progress=0, force=True, phase="logging")
        seconds = time.monotonic() - self.started
        tracker = self.tracker
        tracker.log_metrics(
            {**flat_metrics(metrics), "examples_seen": examples_seen, "train_steps": step, "train_seconds": seconds},
            step=step,
            flush=True,
        )
        feature_spec = {
            "sequence_length": cfg.sequence_length,
            "dense_features": list(DENSE_FEATURES),
            "count_features": list(COUNT_FEATURES),
            "labels": list(LABELS),
            "serving_inputs": list(SERVING_INPUTS),
            "outputs": [f"p_{label}" for label in LABELS],
            "hash_buckets": {
                "pin_id": cfg.pin_buckets,
                "user_id": cfg.user_buckets,
                "creator_id": cfg.creator_buckets,
                "category": cfg.category_buckets,
            },
            "pins_snapshot_ds": pins.ds,
            "priors": history_priors(cfg.root, cfg.train_days[-1]),
            "model_config": cfg.model_config().to_dict(),
        }
        model_uri, version = tracker.log_model(model, feature_spec)
        tracker.end("FINISHED")
        result = {
            "mlflow_run_id": tracker.run_id,
            "model_uri": model_uri,
            "model_name": cfg.model_name,
            "model_version": version,
            "eval_ds": cfg.eval_ds,
            "train_days": list(cfg.train_days),
            "metrics": metrics,
            "steps": step,
            "examples_seen": examples_seen,
            "seconds": round(seconds, 3),
        }
        storage_io.write_json(storage_io.join(cfg.output_dir, RESULT_FILE), result)
        log.info("result: %s", json.dumps(result))
        return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = DistEnv.from_env()
    setup_logging(env.rank)
    try:
        config = RunConfig.from_json(args.config)
    except ConfigError as e:
        log.error("%s", e)
        return int(e.exit_code)
    storage_io.make_dirs(config.output_dir)
    storage_io.remove(failure_path(config.output_dir, env.rank))
    heartbeat = Heartbeat(config.output_dir, env, config.heartbeat_every_s)
    trainer = Trainer(config, env, heartbeat)
    try:
        trainer.run()
    except (Exception, KeyboardInterrupt) as exc:
        code = ExitCode.INFRA if isinstance(exc, KeyboardInterrupt) else exit_code_for(exc)
        log.error("rank %d failed (%s, exit %d): %s", env.rank, code.name, int(code), exc, exc_info=exc)
        write_failure(config.output_dir, env.rank, exc, code)
        heartbeat.update(progress=0, force=True, phase="failed", exit_code=int(code), error=str(exc)[:500])
        if trainer.tracker is not None:
            with contextlib.suppress(Exception):
                trainer.tracker.end("FAILED")
        return int(code)
    heartbeat.update(progress=0, force=True, phase="done")
    return int(ExitCode.OK)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
