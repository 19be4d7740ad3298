"""Distributed training of any model family: ``python -m training.train --config RUN.json``.

The platform half of the model SDK (``training.sdk``): RUN.json names the ``family`` (and its ``params``);
the family supplies its input rows, ``encode``, models, loss, evaluation and serving form; everything here
is the same for every family. Runs under ``torchrun`` (any number of nodes and processes; it reads RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun sets them) or alone as a world of one. CPU:
gloo; CUDA: nccl and bf16 autocast. ``strategy``: DDP (the default); TorchRec (``torchrec``: the family's
``sparse_features`` sharded model-parallel by ``DistributedModelParallel`` with the plan of ``sharding``, a
row-wise Adagrad fused into their backward, the dense rest under DDP; ``training.torchrec_sharding``); or, as
a fallback, FSDP2 per table (``fsdp``: ``fully_shard``, each step gathers whole tables: on one 1M-row table
60x to 300x slower per step than TorchRec, ``benchmarks/embeddings.py``). AdamW for dense parameters, warmup +
cosine LR, gradient clipping. A family's extra
``variants`` (the ranker's ablation without the action sequence) train in lockstep on the same batches.

Each rank writes ``<output_dir>/heartbeat-rank{r}.json`` every few seconds and, when it fails,
``<output_dir>/failure-rank{r}.json`` (exit code, failure class, message, traceback). Checkpoints go to
``<checkpoint_dir>/step-XXXXXXXX/`` every ``checkpoint_every`` steps and at the end; a (re)started job
resumes exactly from the newest complete one: model, optimizer, LR schedule, every rank's RNG states and
the input position (the data order is a function of seed and epoch; the batches already trained on in
that epoch are skipped without being read). At the end rank 0 evaluates on ``eval_ds`` (strategy torchrec with tables
above ``sharded_export_above_mib``: every rank exports its rows, ``training.sharded_export``, and every rank evaluates
its share of the day with the sharded model, never gathered: ``ModelFamily.evaluate_part``), logs to MLflow (params,
train loss, metrics, the exported model + feature spec), registers the model and writes ``<output_dir>/result.json``
atomically. ``root``, ``output_dir``, ``checkpoint_dir`` and the ``--config`` file itself may be local paths or URLs
such as ``s3://bucket/prefix/...`` (``core.storage``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib.util
import json
import logging
import math
import os
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core import lease, storage
from core.failures import (
    ConfigError,
    ExitCode,
    FailureClass,
    InfraError,
    NanLossError,
    PinflowError,
    TaskGoneError,
    exit_code_for,
)
from training.config import RunConfig, fields_help
from training.faults import FaultInjector, LossHook
from training.launch import AGENT_PID_ENV
from training.runtime import (
    DistEnv,
    Heartbeat,
    InputClock,
    cpus_per_process,
    failure_path,
    hold_run_folders,
    input_verdict,
    setup_logging,
    write_failure,
)

if TYPE_CHECKING:  # torch is imported only when training starts
    from training.checkpoint import Part
    from training.checkpoint_manager import CheckpointManager, Resumed
    from training.data import ExampleStream
    from training.sdk import ModelFamily

log = logging.getLogger("training.train")

RESULT_FILE = "result.json"
LOCAL_MODEL_FILE = "model.pt2"  # the exported serving module of a run without MLflow tracking


def export_serving(family: ModelFamily, model: Any, output_dir: str) -> str:
    """The family's serving module exported with ``torch.export`` to ``<output_dir>/model.pt2`` (a run without
    MLflow: the same program MLflow would have logged); returns its path."""
    import copy
    import io

    import torch

    serving = family.serving(copy.deepcopy(model).cpu().float()).eval()
    example = family.example_inputs()
    program = torch.export.export(serving, tuple(torch.from_numpy(example[n]) for n in family.serving_inputs))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    path = storage.join(output_dir, LOCAL_MODEL_FILE)
    storage.write_bytes(path, buffer.getvalue())
    return path

EPILOG = f"""\
{fields_help()}

Exit codes (core.failures.ExitCode), one per failure class (docs/architecture.md §4):
  0    OK
  1    USER      a bug in the model code or an invalid RUN.json: fail now, fix the named field
  65   DATA      a missing, incomplete or malformed input partition: fail now, nothing downstream runs
  75   INFRA     a lost peer, a collective (gloo/NCCL) timeout, MLflow not answering, killed from outside:
                 retry; the job resumes exactly from the newest complete checkpoint
  76   NAN_LOSS  (class USER) the loss or the gradient norm became NaN/Inf on some rank: fail now; lower lr
  137  OOM       out of (GPU) memory, or the kernel's OOM killer: fail; lower batch_size or shard (torchrec)
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


# The most passes a target_examples budget may take (the platform configuration's limit on epochs).
MAX_EPOCHS = 100


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
    only while it computes. On CUDA its parameters compute in bf16 and gradients reduce in fp32. ``fsdp`` is
    the fallback for tables TorchRec cannot take: every step gathers each whole table (strategy ``torchrec``,
    ``training.torchrec_sharding``, looks up only the rows a batch needs).
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


def gather_full(module: Any, build: Any) -> Any:
    """A plain CPU model (``build()``) with the full weights of a wrapped one on rank 0 (None elsewhere); a collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    plain = build()
    plain.load_state_dict(state)
    return plain


@dataclass(frozen=True)
class StepStats:
    """One step's numbers: each part's loss and the model's per-head losses (means over the ranks)."""

    examples: int  # in this rank's batch
    losses: dict[str, float]  # per part, the trained model ("model") first
    heads: dict[str, float]  # the trained model's loss per head
    grad_norm: float  # the trained model's, before clipping


class Trainer:
    """One rank's training job, in torchtitan's shape: set up, resume, a short :meth:`train` loop over
    :meth:`train_step`, then :meth:`end` (rank 0 evaluates and registers in :meth:`finish`).

    The loop's state lives here: ``step``, ``epoch``, ``batches_in_epoch``, the examples seen by this rank in
    this try (``local_seen``) and by all ranks before it (``resumed_seen``); :attr:`checkpoints` saves and
    restores it together with the trained parts and the input position.
    """

    def __init__(self, config: RunConfig, env: DistEnv, heartbeat: Heartbeat) -> None:
        self.config = config
        self.env = env
        self.heartbeat = heartbeat
        self.tracker: Any = None
        self.input_clock = InputClock()
        self.loader: Any = None  # the local engine's StreamLoader (its input workers), made by the first epoch
        self.ray_input: Any = None  # training.ray_input.RayExampleBatches under input_engine ray
        self.ray_started = False  # this rank started the node's Ray cluster (it stops it)
        self.started = time.monotonic()
        self.faults = FaultInjector(config, env)
        self.family = config.family_instance()
        # Set up by run():
        self.device: Any = None
        self.context: Any = None  # what the family's encode joins the rows with (e.g. a pin snapshot)
        self.stream: ExampleStream | None = None
        self.steps_per_epoch: list[int] = []
        self.epoch_start: list[int] = []
        self.total_steps = 0
        self.parts: dict[str, Part] = {}
        self.sharded_exports: dict[str, str] = {}  # variant -> its sharded export's folder (end() writes them)
        self.checkpoints: CheckpointManager | None = None
        self.resumed: Resumed | None = None  # the checkpoint this try resumed from (result.json says how)
        self.checkpoint_past_run = False  # it trained more than this run asks (fewer epochs now): nothing to train
        # Advanced by train():
        self.step = 0
        self.epoch = 0
        self.batches_in_epoch = 0
        self.local_seen = 0
        self.resumed_seen = 0
        self.resume_skip = 0  # batches of the resumed epoch trained on before the restart
        self.last_loss = math.nan
        self.last_progress_log = 0.0
        self.epochs = config.epochs  # planned in plan_data (a target_examples budget may take more)

    def run(self) -> dict[str, Any] | None:
        """Train, resuming from the newest complete checkpoint; return the result on rank 0 (None elsewhere)."""
        self.set_threads_and_seed()
        self.phase("starting: joining the other ranks")
        self.setup_distributed()
        log.info("rank %d/%d on %s, family %s, strategy %s, input %s (%d worker(s), %d thread(s))", self.env.rank,
                 self.env.world_size, self.device, self.family.name, self.config.strategy, self.config.input_engine,
                 self.config.num_workers, self.config.num_threads)
        self.phase("loading data: planning the epochs")
        self.plan_data()
        self.setup_ray_input()
        self.phase("building the model")
        self.build_parts()
        self.seed_rank_stream()
        self.setup_tracking()
        self.phase("resuming from the newest checkpoint")
        self.resume()
        self.train()
        return self.end()

    def phase(self, what: str) -> None:
        """Say in the heartbeat what the rank does before its first step (the progress tab shows it)."""
        self.heartbeat.update(progress=0, force=True, phase=what)

    # --- setup ------------------------------------------------------------------------------------
    def set_threads_and_seed(self) -> None:
        """torch's threads and determinism; Python's, NumPy's and torch's seeds (the same on every rank)."""
        import numpy as np
        import torch

        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)

    def setup_distributed(self) -> Any:
        """Pick the device, join the process group (gloo on CPU, nccl on CUDA); return the device."""
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
        self.device = device
        return device

    def setup_ray_input(self) -> None:
        """input_engine ray: join the job's Ray cluster (RAY_ADDRESS, else the node's, started by local rank 0)."""
        if self.config.input_engine != "ray":
            return
        import socket
        import tempfile

        import torch.distributed as dist

        from training.ray_input import RayExampleBatches, connect

        env = self.env
        node = os.environ.get("GROUP_RANK") or socket.gethostname()

        def exchange(value: Any) -> Any:  # local rank 0's cluster address, to the ranks of its node
            gathered: list[Any] = [None] * env.world_size
            dist.all_gather_object(gathered, (node, env.local_rank, value))
            return next((v for n, r, v in gathered if n == node and r == 0), None)

        temp_dir = os.path.join(tempfile.gettempdir(), "pinflow-ray")
        # Not imported here (nor ray.data, whose lookup imports ray): Ray reads its authentication settings when it
        # is imported, and connect sets them first.
        if importlib.util.find_spec("ray") is None:
            exchange(None)
            raise ConfigError("input_engine ray needs Ray Data in the training image: pip install -c constraints.txt "
                              "'ray[data]', or use input_engine local")
        self.ray_started = connect(env.local_rank, exchange, self.config.ray_cpus, temp_dir)
        assert self.stream is not None
        self.ray_input = RayExampleBatches(self.stream, self.config.to_dict(), cpus_per_task=self.config.ray_task_cpus)

    def plan_data(self) -> None:
        """This rank's example stream, the steps of each epoch (the same on every rank) and the total."""
        from core.failures import DataError
        from training.data import ExampleStream

        cfg, env, family = self.config, self.env, self.family
        self.context = context = family.prepare(cfg.input_root, list(cfg.train_days), cfg.eval_ds)
        self.stream = stream = ExampleStream(
            cfg.input_root,
            cfg.train_days,
            lambda table: family.encode(table, context),
            encode_into=lambda table, alloc: family.encode_into(table, context, alloc),
            batch_size=cfg.batch_size,
            dataset=family.dataset,
            columns=family.columns,
            rank=env.rank,
            world_size=env.world_size,
            num_workers=cfg.num_workers if cfg.input_engine == "local" else 0,  # ray: one ordered reader per rank
            seed=cfg.seed,
            drop_last=cfg.strategy == "torchrec",  # its lookups need one batch size on every rank
        )
        budget = 0
        if cfg.target_examples:  # a budget in examples: as many epochs as it takes (each epoch has its own order)
            budget = math.ceil(cfg.target_examples / (cfg.batch_size * env.world_size))
        self.steps_per_epoch = []
        for epoch in range(MAX_EPOCHS):
            if budget and sum(self.steps_per_epoch) >= budget:
                break
            # By epochs: at least min_steps steps, so that a small dataset is not under-trained at the defaults.
            if not budget and epoch >= cfg.epochs and sum(self.steps_per_epoch) >= cfg.min_steps:
                break
            self.steps_per_epoch.append(stream.steps_per_epoch(epoch))
        self.epochs = len(self.steps_per_epoch)
        if not budget and self.epochs > cfg.epochs:
            log.info("%d epoch(s) of %d steps are fewer than min_steps=%d: training %d epochs instead", cfg.epochs,
                     sum(self.steps_per_epoch[: cfg.epochs]), cfg.min_steps, self.epochs)
        if min(self.steps_per_epoch) == 0:
            raise DataError(
                f"{stream.total_rows} training rows in {len(stream.units)} row groups over {env.world_size} "
                f"ranks x {max(1, cfg.num_workers)} workers leave some rank without a batch: train on more "
                "days or use fewer processes"
            )
        self.epoch_start = [sum(self.steps_per_epoch[:e]) for e in range(self.epochs)]
        self.total_steps = sum(self.steps_per_epoch)
        for cap in (budget, cfg.max_steps):
            if cap:
                self.total_steps = min(self.total_steps, cap)
        log.info("training plan: %d steps over %d epoch(s) of %s steps, global batch %d",
                 self.total_steps, self.epochs, self.steps_per_epoch, cfg.batch_size * env.world_size)

    def budget_warnings(self) -> list[str]:
        """Why this run may be too short to trust (fewer steps than the warmup or than the configured minimum) or
        differ from one never stopped (a resume on another world size or sharding)."""
        cfg, warnings = self.config, []
        if self.resumed is not None and not self.resumed.exact:
            warnings.append(f"resumed {self.resumed.path} at step {self.resumed.step}: not an exact resume: "
                            f"{self.resumed.reason}")
        if self.resumed is not None and self.checkpoint_past_run:
            warnings.append(f"the checkpoint {self.resumed.path} is at step {self.resumed.step}, past this run's "
                            f"{self.total_steps} steps ({self.epochs} epoch(s)): nothing was trained, and the model is "
                            "the checkpoint's, trained longer than this run asks")
        if self.step < cfg.warmup_steps:
            warnings.append(
                f"trained {self.step} steps, fewer than the {cfg.warmup_steps} warmup steps: the learning rate never "
                "reached its peak; raise epochs or target_examples, or lower batch_size"
            )
        if self.step < cfg.min_steps:
            warnings.append(
                f"trained {self.step} steps, fewer than min_steps={cfg.min_steps}: the model may be undertrained; "
                "raise epochs or target_examples, or lower batch_size"
            )
        if cfg.train_days_requested > len(cfg.train_days):
            warnings.append(
                f"trained on {len(cfg.train_days)} of the {cfg.train_days_requested} days asked for: the run accepted "
                "fewer days"
            )
        return warnings

    def build_parts(self) -> None:
        """The trained parts, each (module, optimizer, LR scheduler), into ``parts``.

        One part per variant of the family: ``model`` is the trained (and registered) model, the others (the
        ranker's ablation) train in lockstep on the same batches. Every part starts from the same seed on
        every rank. The one place that builds models: the family's ``build_model``.
        """
        import torch

        cfg, device = self.config, self.device
        for name in self.family.variants():
            torch.manual_seed(cfg.seed)  # the same initialisation on every rank
            if cfg.strategy == "torchrec":
                module, optimizer = self.build_torchrec(name)
            else:
                module = wrap(self.family.build_model(name).to(device), cfg.strategy, device)
                optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lr_lambda(self.total_steps, cfg.warmup_steps, cfg.min_lr_ratio)
            )
            self.parts[name] = (module, optimizer, scheduler)

    def build_torchrec(self, variant: str) -> tuple[Any, Any]:
        """``variant`` with its sparse features sharded by TorchRec (DMP) and its optimizer (fused sparse + AdamW)."""
        from training import torchrec_sharding as ts

        ts.quiet_library_logs()  # before torchrec's import: fbgemm logs every library it loads
        try:
            import fbgemm_gpu  # noqa: F401
            import torchrec  # noqa: F401
        except ImportError as e:  # torchrec is installed --no-deps by make install and the images
            raise ConfigError(
                f"strategy torchrec needs torchrec and fbgemm ({e}): pip install -c constraints.txt "
                "'.[cpu]' (or '.[cuda]') && pip install --no-deps torchrec==1.8.0"
            ) from e
        cfg = self.config
        # Built sharded: the tables on the meta device (no rank ever holds one whole), the dense part as the family
        # builds it; shard() then gives each rank its rows of every table, initialised per global row.
        names = self.family.sparse_features(variant)
        model = ts.build_meta(lambda: self.family.build_model(variant), names)
        model = ts.to_torchrec(model, names, seed=cfg.seed, init_std=self.family.sparse_init_std(variant))
        marker = self.latest_checkpoint()  # every rank, before the plan: a plan that fails names it
        try:
            dmp = ts.shard(
                ts.to_device(model, self.device), sharding=cfg.sharding, device=self.device, lr=cfg.sparse_lr,
                weight_decay=cfg.weight_decay,
                memory_per_rank=int(cfg.embedding_memory_mb * 2**20) if cfg.embedding_memory_mb else None,
            )
        except ConfigError as e:  # no plan fits: say so of the checkpoint it was to resume, if it is another layout
            if marker is None or (marker.get("world_size"), marker.get("sharding")) == (self.env.world_size,
                                                                                         cfg.sharding):
                raise
            raise ConfigError(
                f"cannot reshard checkpoint {marker['path']} (saved by {marker.get('world_size')} rank(s), "
                f"{marker.get('sharding')}) onto {self.env.world_size} rank(s) {cfg.sharding}: {e}"
            ) from e
        return dmp, ts.make_optimizer(dmp, lr=cfg.lr, weight_decay=cfg.weight_decay).optimizer

    def latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete checkpoint's marker (rank 0 looks, every rank gets it; a collective)."""
        import torch.distributed as dist

        from training.checkpoint import latest_checkpoint

        found = [latest_checkpoint(self.config.checkpoint_dir) if self.env.is_main else None]
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def seed_rank_stream(self) -> None:
        """From here each rank draws its own random numbers (dropout); every checkpoint saves them."""
        import torch

        torch.manual_seed(self.config.seed + 1 + self.env.rank)

    def setup_tracking(self) -> None:
        """Rank 0: start (or continue) the MLflow run and log the run's parameters; nothing without a tracking URI
        (MLflow is then not even imported: a node that cannot reach a tracking server still trains)."""
        if not self.env.is_main:
            return
        if not self.config.mlflow_tracking_uri:
            log.info("no MLflow tracking (mlflow_tracking_uri is empty): the model is exported to %s, not registered",
                     storage.join(self.config.output_dir, LOCAL_MODEL_FILE))
            return
        from training.tracking import Tracker

        cfg, stream = self.config, self.stream
        assert stream is not None
        self.tracker = Tracker(cfg)
        self.tracker.log_params(
            {
                **{k: v for k, v in cfg.to_dict().items()
                   if k not in ("mlflow_tracking_uri", "params", "tags", "inputs")},
                **{f"params.{k}": v for k, v in dataclasses.asdict(self.family.params).items()},
                "world_size": self.env.world_size,
                "device": str(self.device.type),
                "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps,
                "train_rows": stream.total_rows,
                "snapshot_ds": getattr(self.context, "ds", None),
                "parameters": sum(p.numel() for p in self.parts["model"][0].parameters()),
            }
        )
        self.tracker.log_inputs(cfg.inputs)

    def resume(self) -> None:
        """Continue from the newest complete checkpoint, if any: parts, RNG states, input and loop position."""
        from training.checkpoint_manager import CheckpointManager, resume_settings

        assert self.stream is not None
        self.checkpoints = CheckpointManager(
            self.config,
            self.env,
            self.heartbeat,
            parts=self.parts,
            stream=self.stream,
            examples_seen=self.examples_seen,
            extra={
                "total_steps": self.total_steps, "steps_per_epoch": list(self.steps_per_epoch),
                "strategy": self.config.strategy, "settings": resume_settings(self.config),
                **({"sharding": self.config.sharding} if self.config.strategy == "torchrec" else {}),
            },
        )
        resumed = self.checkpoints.resume()
        if resumed is None:
            return
        self.step, self.resumed_seen = resumed.step, resumed.examples_seen
        self.checkpoint_past_run = resumed.step > self.total_steps
        if resumed.saved_world_size != self.env.world_size:
            resumed = self.continue_at_same_share(resumed)
        self.resumed = resumed
        if resumed.data_restored:
            self.resume_skip = self.stream.skip
        if resumed.exact:
            log.info("exact resume of %s at step %d: %s", resumed.path, resumed.step, resumed.reason)
        else:  # another world size or sharding: the model and optimizer are resharded, the continuation differs
            log.warning("resuming %s at step %d: not an exact resume: %s", resumed.path, resumed.step, resumed.reason)
        self.heartbeat.update(progress=0, epoch=resumed.epoch)
        log.info("resumed from %s at step %d", resumed.path, self.step)

    def continue_at_same_share(self, resumed: Resumed) -> Resumed:
        """A checkpoint of another world size: continue at the step of this world that is as far into the same epoch
        (each step reads a batch per rank, so another world takes another number of steps an epoch: continuing from
        the saved step count trained epochs again, a finished run a second time), with the LR schedule moved there."""
        import itertools

        saved = resumed.saved_steps_per_epoch
        if not saved:  # a checkpoint of older code: its step is taken as this world's
            return resumed
        starts = list(itertools.accumulate(saved, initial=0))
        if resumed.step >= starts[-1]:
            epoch, share = len(saved), 0.0  # every epoch of the saved run was trained
        else:
            epoch = max(e for e in range(len(saved)) if starts[e] <= resumed.step)
            share = (resumed.step - starts[epoch]) / saved[epoch]
        as_far = None if epoch >= self.epochs else self.epoch_start[epoch] + round(share * self.steps_per_epoch[epoch])
        # Past this run: more epochs than it asks, or further than its cap (max_steps, target_examples).
        self.checkpoint_past_run = epoch + share > self.epochs or (as_far is not None and as_far > self.total_steps)
        step = self.total_steps if as_far is None else min(self.total_steps, as_far)
        if step == resumed.step:
            return resumed
        self.step = step
        for _, optimizer, scheduler in self.parts.values():
            scheduler.last_epoch = step
            for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
                group["lr"] = base * factor(step)
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        where = (f"epoch {epoch + 1} of {len(saved)}, {share:.0%} through it" if epoch < len(saved)
                 else f"the end of its {len(saved)} epoch(s)")
        return dataclasses.replace(resumed, reason=(
            f"{resumed.reason}; saved at step {resumed.step} of its {starts[-1]} ({where}): continued at step {step} "
            f"of this world's {self.total_steps}"))

    # --- training ---------------------------------------------------------------------------------
    def train(self) -> None:
        """The epochs from the resumed position: a step per batch, heartbeats, metrics, checkpoints."""
        assert self.checkpoints is not None
        self.heartbeat.update(progress=0, force=True, phase="training", step=self.step, total_steps=self.total_steps,
                              epochs=self.epochs)
        self.log_progress(force=True)
        for module, _, _ in self.parts.values():
            module.train()
        for epoch in range(self.epochs):
            self.epoch = epoch
            if self.step >= self.total_steps:
                break
            if self.step >= self.epoch_start[epoch] + self.steps_per_epoch[epoch]:
                continue  # finished before the restart
            batches = iter(self.batches())
            while True:
                waited = time.perf_counter()
                batch = next(batches, None)  # the time spent here is time waiting for input
                if batch is None:
                    break
                computed = time.perf_counter()
                stats = self.train_step(batch, loss_hook=self.faults.loss_hook(self.step))
                self.input_clock.add(computed - waited, time.perf_counter() - computed)
                self.heartbeat.update(examples=stats.examples, step=self.step, epoch=epoch, loss=self.last_loss,
                                      input_wait_share=self.input_clock.share,
                                      data_bound_share=self.config.data_bound_share)
                self.log_progress(force=self.step == self.total_steps)
                self.log_step(stats)
                if self.checkpoints.due(self.step):
                    self.save()
                self.faults.after_step()
        if self.checkpoints.last_saved != self.step:
            self.save()

    def log_progress(self, force: bool = False, every_s: float = 30.0) -> None:
        """Rank 0: a progress line (step of total, %, examples/s, ETA; the loss once a step has run) every
        ``every_s`` seconds and at the last step."""
        if not self.env.is_main or not (force or time.monotonic() - self.last_progress_log >= every_s):
            return
        self.last_progress_log = time.monotonic()
        log.info("progress: %s", self.heartbeat.progress_line())

    def batches(self) -> Iterator[dict[str, Any]]:
        """This rank's batches of ``epoch`` after those already trained on, up to its steps (or the total)."""
        import torch

        cfg, stream, epoch = self.config, self.stream, self.epoch
        assert stream is not None
        skip = self.step - self.epoch_start[epoch]
        if self.resume_skip and stream.epoch == epoch and stream.skip != skip:
            raise ConfigError(  # a checkpoint whose data position disagrees with its step: a bug
                f"checkpoint data position {stream.skip} disagrees with step {self.step} of epoch {epoch}"
            )
        stream.set_epoch(epoch, skip)  # the skipped batches are not read at all
        self.batches_in_epoch = skip
        if self.ray_input is not None:
            limit = min(self.steps_per_epoch[epoch], self.total_steps - self.epoch_start[epoch])
            yield from self.ray_input.batches(epoch, skip, limit)
            return
        if self.loader is None:  # its workers serve every epoch of this try
            self.loader = stream.loader(
                pin_memory=self.device.type == "cuda" if cfg.pin_memory is None else cfg.pin_memory,
                prefetch_factor=cfg.prefetch_factor,
                # Its own generator: starting a loader draws a seed, which must not move the global RNG
                # (a resumed run starts one more loader than the uninterrupted run did).
                generator=torch.Generator().manual_seed(cfg.seed * 1000),
            )
        for batch in self.loader:
            if self.batches_in_epoch >= self.steps_per_epoch[epoch] or self.step >= self.total_steps:
                break
            yield batch

    def train_step(self, batch: dict[str, Any], loss_hook: LossHook | None = None) -> StepStats:
        """Forward, backward, clip and step every part on ``batch``; then advance the loop position.

        A loss or gradient norm that is NaN/Inf raises NanLossError on every rank: the losses are checked
        after an all-reduce, so all ranks agree. ``loss_hook`` sees the losses before that (fault injection).
        """
        import torch
        import torch.distributed as dist

        cfg, device = self.config, self.device
        # The family finishes the batch on the device, as part of the step (a GPU's gather, not the input's work).
        inputs = self.family.finish({k: v.to(device, non_blocking=True) for k, v in batch.items()}, self.context)
        examples = int(inputs["row_id"].shape[0])
        losses = []
        heads: dict[str, Any] = {}
        for _, optimizer, _ in self.parts.values():
            # Before the forward: TorchRec's fused sparse optimizer updates the tables inside backward with the
            # LR its kernel took at the forward, which its zero_grad sets (after a resume: the schedule's, not
            # the LR the kernel was built with).
            optimizer.zero_grad(set_to_none=True)
        for name, (module, _, _) in self.parts.items():
            with self.autocast():
                outputs = module(inputs)
            loss, per_head = self.family.loss(outputs, inputs)
            if name == "model":
                heads = per_head
            losses.append(loss)
        if loss_hook is not None:
            loss_hook(losses)
        # The mean losses over ranks, for logging and for a NaN check every rank agrees on.
        reduced = torch.stack([*(v.detach() for v in losses), *(v.detach() for v in heads.values())]).float()
        dist.all_reduce(reduced)
        stats: list[float] = (reduced / self.env.world_size).cpu().tolist()
        if not all(math.isfinite(v) for v in stats):
            raise NanLossError(
                f"loss is {stats[0]} at step {self.step} (epoch {self.epoch}); per head "
                f"{dict(zip(heads, stats[len(losses) :], strict=True))}: lower lr (now {cfg.lr}) or grad_clip"
            )
        norms = []
        for (name, (module, optimizer, scheduler)), loss in zip(self.parts.items(), losses, strict=True):
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip or math.inf)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            if not math.isfinite(norms[-1]):
                raise NanLossError(f"the gradient norm of {name} is {norms[-1]} at step {self.step}: lower lr")
            optimizer.step()
            scheduler.step()
        self.step += 1
        self.batches_in_epoch += 1
        self.local_seen += examples
        self.last_loss = stats[0]
        return StepStats(
            examples=examples,
            losses=dict(zip(self.parts, stats[: len(losses)], strict=True)),
            heads=dict(zip(heads, stats[len(losses) :], strict=True)),
            grad_norm=norms[0],
        )

    def autocast(self) -> Any:
        """bf16 autocast on CUDA; nothing on CPU."""
        import torch

        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def log_step(self, stats: StepStats) -> None:
        """Rank 0: the train losses, LR and gradient norm to MLflow every ``log_every`` steps and at the last."""
        if self.tracker is None or not (self.step % self.config.log_every == 0 or self.step == self.total_steps):
            return
        lr = self.parts["model"][2].get_last_lr()[0]
        metrics = {"train_loss": stats.losses["model"], "lr": lr, "grad_norm": stats.grad_norm}
        metrics.update({f"train_loss_{k}": v for k, v in stats.heads.items()})
        metrics.update({f"train_loss_{name}": v for name, v in stats.losses.items() if name != "model"})
        self.tracker.log_metrics(metrics, step=self.step, flush=True)

    def save(self) -> None:
        assert self.checkpoints is not None
        self.checkpoints.save(self.step, self.epoch, self.batches_in_epoch)

    def examples_seen(self) -> int:
        """Examples trained on by all ranks, over every try (a collective)."""
        import torch
        import torch.distributed as dist

        seen = torch.tensor([self.local_seen], dtype=torch.int64, device=self.device)
        dist.all_reduce(seen)
        return self.resumed_seen + int(seen.item())

    # --- the end ----------------------------------------------------------------------------------
    def end(self) -> dict[str, Any] | None:
        """Every rank: the last collectives (count, gather the full weights), then leave; rank 0 finishes."""
        import torch.distributed as dist

        total_seen = self.examples_seen()
        input_summary = self.input_summary()
        # Rank 0 evaluates alone: gather full (unsharded) weights while every rank is still here. The result is the
        # family's plain model under every strategy: what is registered loads without a process group or TorchRec.
        # Tables above sharded_export_above_mib are never gathered: every rank exports its own rows
        # (training.sharded_export), every rank evaluates its share of the day with the sharded model itself (a family
        # that splits its evaluation; else rank 0 over the exported files), and rank 0 registers the export.
        full: dict[str, Any] = {}
        for name, (module, _, _) in self.parts.items():
            build = lambda name=name: self.family.build_model(name)  # noqa: E731
            if self.config.strategy == "torchrec":
                from training import sharded_export
                from training import torchrec_sharding as ts

                names = self.family.sparse_features(name)
                if self.export_sharded():
                    folder = self.export_folder(name)
                    # An earlier try of this step published it already: kept as it is, never rewritten (a version
                    # it registered points at that manifest; rank 0 decides for every rank).
                    done = [sharded_export.published(folder) if self.env.is_main else None]
                    dist.broadcast_object_list(done, src=0)
                    if done[0]:
                        if self.env.is_main:
                            log.info("%s: the sharded export of step %d is published already (an earlier try): "
                                     "kept as it is, %s", name, self.step, folder)
                    else:
                        self.phase(f"exporting {name} sharded")
                        sharded_export.export(module, names, folder)
                        if self.env.is_main:
                            log.info("%s exported sharded to %s (tables %.1f MiB > sharded_export_above_mib %s)",
                                     name, folder, sharded_export.tables_bytes(module) / 2**20,
                                     self.config.sharded_export_above_mib)
                    self.sharded_exports[name] = folder
                    full[name] = None
                else:
                    full[name] = ts.gather_full(module, names, build)
            else:
                full[name] = gather_full(module, build)
        metrics = self.evaluate_in_world() if self.sharded_exports and self.family.splits_evaluation else None
        self.heartbeat.update(progress=0, force=True, phase="trained", step=self.step)
        self.loader = None  # its input workers stop
        self.stop_ray_input()  # its barrier is the last collective
        dist.destroy_process_group()  # no collective may wait on rank 0 from here on
        if not self.env.is_main:
            return None
        return self.finish(full, total_seen, input_summary, metrics)

    def evaluate_in_world(self) -> dict[str, Any] | None:
        """Every rank evaluates its share of the evaluation day with the trained models as they are, sharded (their
        lookups TorchRec's all-to-alls: no rank reads a table file or holds more than its shards), rank 0 gathers
        the parts and returns the family's metrics (None elsewhere)."""
        import torch.distributed as dist

        cfg, family, hb = self.config, self.family, self.heartbeat
        self.phase("evaluating")
        models = {name: module for name, (module, _, _) in self.parts.items()}
        part = family.evaluate_part(models, cfg.input_root, cfg.eval_ds, self.context, device=self.device,
                                    batch_size=cfg.eval_batch_size, rank=self.env.rank,
                                    world_size=self.env.world_size, on_batch=lambda _: hb.update(phase="evaluating"))
        parts: list[Any] | None = [None] * self.env.world_size if self.env.is_main else None
        dist.gather_object(part, parts, dst=0)
        if parts is None:
            return None
        return family.evaluate_parts(parts, cfg.input_root, cfg.eval_ds, self.context)

    def sharded_table_rows(self) -> int | None:
        """Rows of the family's corpus table in the model's sharded export (None: not exported sharded)."""
        from training.sharded_export import read_manifest

        table = self.family.corpus_table
        if "model" not in self.sharded_exports or not table:
            return None
        return int(read_manifest(self.sharded_exports["model"])[1]["tables"][table]["rows"])

    def export_sharded(self) -> bool:
        """Whether the trained model's tables are above ``sharded_export_above_mib`` (strategy torchrec only)."""
        from training.sharded_export import tables_bytes

        module = self.parts["model"][0]
        return tables_bytes(module) > self.config.sharded_export_above_mib * 2**20

    def export_folder(self, variant: str) -> str:
        """``<run folder>/export/step-XXXXXXXX/<variant>``, beside the checkpoints: a retry of the same step
        writes the same files again, and the registered model keeps pointing at a folder that never moves."""
        run_folder = self.config.checkpoint_dir.rstrip("/").rsplit("/", 1)[0]
        return storage.join(run_folder, "export", f"step-{self.step:08d}", variant)

    def input_summary(self) -> dict[str, Any]:
        """Every rank: the job's data-bound verdict (a collective: the waits of every rank, and the worst rank's share)."""
        import torch
        import torch.distributed as dist

        clock = self.input_clock
        totals = torch.tensor([clock.wait_s, clock.compute_s], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        worst = torch.tensor([clock.share or 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        cfg = self.config
        verdict = input_verdict(float(totals[0]), float(totals[1]), float(worst[0]), threshold=cfg.data_bound_share,
                                engine=cfg.input_engine, num_workers=cfg.num_workers, cpus=cpus_per_process())
        if self.env.is_main:
            (log.warning if verdict["data_bound"] else log.info)(
                "input: %s of step time waiting for input (worst rank %s)%s", f"{verdict['wait_share'] or 0:.0%}",
                f"{verdict['worst_rank_wait_share'] or 0:.0%}", f": {verdict['advice']}" if verdict["advice"] else "")
        return verdict

    def stop_ray_input(self) -> None:
        """Leave the job's Ray cluster. The ranks that joined it disconnect first; the rank that started the node's
        cluster stops it only once every rank has (a barrier): stopped under a rank still connected, the cluster
        took that rank down with it (its Ray core worker exits the process with 1 when its raylet dies)."""
        if self.ray_input is None:
            return
        import ray
        import torch.distributed as dist

        if not self.ray_started:
            ray.shutdown()
        if self.env.world_size > 1:
            dist.barrier()  # needs the process group: called before it is destroyed
        if self.ray_started:
            ray.shutdown()

    def finish(
        self, models: dict[str, Any], examples_seen: int, input_summary: dict[str, Any],
        metrics: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Rank 0: the family evaluates every variant (``metrics``: already evaluated by the training world),
        then MLflow gets the metrics and the registered model, and result.json is written."""
        from training.evaluate import flat_metrics

        cfg, hb, device, step, family = self.config, self.heartbeat, self.device, self.step, self.family
        sharded = self.sharded_exports
        if metrics is None:
            if sharded:
                from training import sharded_export

                # A family that does not split its evaluation: rank 0 evaluates the sharded export's model (its
                # tables read from their row-range files, only the rows looked up).
                models = {name: model if model is not None else sharded_export.load(sharded[name], family, name)
                          for name, model in models.items()}
            hb.update(progress=0, force=True, phase="evaluating")
            metrics = family.evaluate(
                {name: model.to(device) for name, model in models.items()},
                cfg.input_root,
                cfg.eval_ds,
                self.context,
                device=device,
                batch_size=cfg.eval_batch_size,
                on_batch=lambda _: hb.update(phase="evaluating"),
            )
        evaluated_by = self.env.world_size if self.sharded_exports and family.splits_evaluation else 1
        metrics["train_loss"] = self.last_loss if math.isfinite(self.last_loss) else None
        log.info("evaluation on %s: %s", cfg.eval_ds, json.dumps(metrics))
        champion = None
        tracker = self.tracker
        if cfg.evaluate_champion and tracker is not None:  # the promotion gate compares with the champion on this day
            from training.champion import evaluate_champion

            hb.update(progress=0, force=True, phase="evaluating the champion")
            champion = evaluate_champion(cfg, family, tracker.run_id, device=device,
                                         on_batch=lambda _: hb.update(phase="evaluating the champion"))

        hb.update(progress=0, force=True, phase="logging")
        seconds = time.monotonic() - self.started
        if tracker is not None:
            tracker.log_metrics(
                {**flat_metrics(metrics), **flat_metrics((champion or {}).get("metrics") or {}, "champion_eval_"),
                 "examples_seen": examples_seen, "train_steps": step, "train_seconds": seconds},
                step=step,
                flush=True,
            )
        feature_spec = {
            "family": family.name,
            "family_module": cfg.family_module,
            "params": dataclasses.asdict(family.params),
            "serving_inputs": list(family.serving_inputs),
            "outputs": list(family.outputs),
            **family.feature_spec(cfg.input_root, list(cfg.train_days), cfg.eval_ds, self.context),
            **({"corpus_table": family.corpus_table} if "model" in sharded else {}),
        }
        # The decisive point: a job whose task is gone (its lease not renewed) registers nothing (core.lease).
        lease.check(cfg.output_dir, cfg.lease_s)
        if tracker is not None:
            model_uri, version = tracker.log_model(family, models["model"], feature_spec, sharded=sharded.get("model"),
                                                examples_seen=examples_seen)
            tracker.end("FINISHED")
        elif "model" in sharded:  # no tracking: the sharded export is the model, nothing registered
            model_uri, version = sharded["model"], None
        else:  # no tracking: the serving module exported beside the result, nothing registered
            model_uri, version = export_serving(family, models["model"], cfg.output_dir), None
        result = {
            "family": family.name,
            "mlflow_run_id": tracker.run_id if tracker is not None else None,
            "model_uri": model_uri,
            "model_name": cfg.registered_model,
            "model_version": version,
            "sharded_export": sharded.get("model"),  # the export folder of a model exported sharded, else None
            "evaluated_by_ranks": evaluated_by,  # the training world's ranks, for a sharded export the family splits
            # Rows of the family's corpus table in the sharded export (its version's SHARDED_ROWS_TAG), else None.
            "sharded_table_rows": self.sharded_table_rows(),
            "eval_ds": cfg.eval_ds,
            "train_days": list(cfg.train_days),
            "metrics": metrics,
            "steps": step,
            "epochs": self.epochs,
            "min_steps": cfg.min_steps,
            "warmup_steps": cfg.warmup_steps,
            "train_days_requested": cfg.train_days_requested or len(cfg.train_days),
            "champion": champion,  # the registered champion evaluated on eval_ds (training.champion), or None
            "examples_seen": examples_seen,
            # The checkpoint this try resumed from, and whether the resume was exact and why (None: from scratch).
            "resume": self.resumed.summary() if self.resumed is not None else None,
            "seconds": round(seconds, 3),
            "warnings": self.budget_warnings() + ([input_summary["advice"]] if input_summary["advice"] else []),
            "input": input_summary,  # the data-bound verdict (training.runtime.input_verdict)
            "inputs": cfg.input_versions(),  # the pinned version of each partition read (RUN.json inputs)
        }
        for warning in result["warnings"]:
            log.warning("%s", warning)
        storage.write_json(storage.join(cfg.output_dir, RESULT_FILE), result)
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
    try:  # before anything is written; under training.launch its node-0 agent holds the claim for every rank
        on_its_own = env.rank == 0 and not os.environ.get(AGENT_PID_ENV)
        claims = hold_run_folders(config.checkpoint_dir, config.output_dir) if on_its_own else []
    except InfraError as e:
        log.error("%s", e)
        return int(e.exit_code)
    try:
        return _train(config, env)
    finally:
        for fd in claims:
            os.close(fd)


def _train(config: RunConfig, env: DistEnv) -> int:
    storage.make_dirs(config.output_dir)
    storage.remove(failure_path(config.output_dir, env.rank))
    if env.rank == 0:  # an earlier job of more ranks in this folder: its other ranks' files are not this job's
        for name in storage.list_names(config.output_dir):
            rank = re.fullmatch(r"(?:failure|heartbeat)-rank(\d+)\.json", name)
            if rank and int(rank[1]) >= env.world_size:
                storage.remove(storage.join(config.output_dir, name))
    heartbeat = Heartbeat(config.output_dir, env, config.heartbeat_every_s)
    trainer: Trainer | None = None
    try:
        trainer = Trainer(config, env, heartbeat)  # a family or params the registry refuses: a USER error, as below
        trainer.run()
    except (Exception, KeyboardInterrupt) as exc:
        code = ExitCode.INFRA if isinstance(exc, KeyboardInterrupt) else exit_code_for(exc)
        # A refusal of the run's own settings or data says it all in one line; anything else keeps its traceback.
        expected = isinstance(exc, PinflowError) and exc.failure_class in (FailureClass.USER, FailureClass.DATA)
        log.error("rank %d failed (%s, exit %d): %s", env.rank, code.name, int(code), exc,
                  exc_info=None if expected else exc)
        write_failure(config.output_dir, env.rank, exc, code)
        heartbeat.update(progress=0, force=True, phase="failed", exit_code=int(code), error=str(exc)[:500])
        if trainer is not None and trainer.tracker is not None:
            # A try that trained nothing (a resume refused for its settings, say) leaves a run it continued as it
            # found it: a finished run whose model is registered does not turn FAILED.
            untouched = not trainer.local_seen and trainer.tracker.continued_status == "FINISHED"
            with contextlib.suppress(Exception):
                trainer.tracker.end("FINISHED" if untouched else "KILLED" if isinstance(exc, TaskGoneError) else "FAILED")
        return int(code)
    heartbeat.update(progress=0, force=True, phase="done")
    return int(ExitCode.OK)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
