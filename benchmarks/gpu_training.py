"""The GPU check: one run of at most about 6 minutes on a CUDA machine, one JSON line at the end.

    benchmarks/gpu_training.sh                 # on a GPU machine (exits 75 where CUDA with bf16 is missing)
    DEVICE=cpu benchmarks/gpu_training.sh      # the rehearsal on CPU: every part at tiny sizes, no bf16, no compiler

(a) **the model step**: the production-size ranker (100-step sequences, a 2-layer d=128 transformer, 10M-row pin
    and user tables, 64-d sparse features, a 3-layer cross network, a 512-256 MLP) on batches held on the device:
    forward under bf16 autocast, backward, clip, fused AdamW, eager and ``torch.compile``, at two batch sizes;
    checks that the logits are bf16, every loss finite and the loss falling on repeated batches;
(b) **pinflow's own training job on the device** through ``training.launch``: the nodes' preflight (devices, the
    NCCL all-reduce, disk, data), an uninterrupted run, then a run whose last rank is SIGKILLed after a checkpoint
    and retried, which must resume exactly: its final checkpoint bitwise equal to the uninterrupted run's;
(c) **the input pipeline** (the local engine, its workers sized from this machine as the operator sizes them)
    at (a)'s first batch size, against (a)'s eager step at that size: can the input feed the model here?

It needs torch 2.x (any version: nothing here is pinned to the project's), numpy, pyarrow, fsspec, pyyaml and
pydantic; where one is missing it says which, with the wheel to carry. MLflow is not used: the job runs without
tracking (its model is exported beside its result). Exit codes: 0 every check held, 1 a check failed, 75 no usable
device. The last line printed is one JSON object: ``step`` (a), ``job`` (b), ``input`` (c), ``ok``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NEEDED = ("torch", "numpy", "pyarrow", "fsspec", "yaml", "pydantic")
DAYS = ["2026-01-01", "2026-01-02", "2026-01-03"]


def fail(message: str, code: int = 1) -> None:
    print(f"gpu_training: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def check_imports() -> None:
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        fail(f"missing Python packages {', '.join(missing)}: carry their wheels (the device README's pip download "
             "for Python 3.12) and put them on PYTHONPATH", 75)


# --- (a) the model step -----------------------------------------------------------------------------------------
def production_config(small: bool) -> Any:
    from training.models.pin_ranker.model import ModelConfig

    if small:
        return ModelConfig(sequence_length=20, d_model=16, n_heads=2, n_layers=1, ff_dim=32, first_k=2, sparse_dim=8,
                           pin_buckets=10_007, user_buckets=10_007, creator_buckets=1_009, category_buckets=101,
                           cross_layers=1, mlp_hidden=(32,))
    return ModelConfig(sequence_length=100, d_model=128, n_heads=4, n_layers=2, ff_dim=512, first_k=8, sparse_dim=64,
                       pin_buckets=10_000_019, user_buckets=10_000_019, creator_buckets=1_000_003,
                       category_buckets=10_007, cross_layers=3, mlp_hidden=(512, 256))


def random_batch(config: Any, batch: int, device: Any, seed: int) -> dict[str, Any]:
    import torch

    from core.contracts import ACTIONS, DENSE_FEATURES, LABELS, SURFACES

    g = torch.Generator(device=device).manual_seed(seed)
    n, dim = config.sequence_length, config.embedding_dim
    lengths = torch.randint(0, n + 1, (batch,), device=device, generator=g)
    mask = torch.arange(n, device=device)[None, :] < lengths[:, None]

    def ids(high: int) -> Any:
        return torch.randint(1, high, (batch,), device=device, generator=g)

    return {
        "seq_pin_emb": torch.randn(batch, n, dim, device=device, generator=g) * mask[..., None],
        "seq_actions": torch.where(mask, torch.randint(1, len(ACTIONS) + 1, (batch, n), device=device, generator=g), 0),
        "seq_categories": torch.where(mask, torch.randint(0, 1000, (batch, n), device=device, generator=g), -1),
        "seq_age_hours": torch.rand(batch, n, device=device, generator=g) * 720 * mask,
        "seq_mask": mask,
        "cand_pin_emb": torch.randn(batch, dim, device=device, generator=g),
        "pin_id": ids(10**12), "user_id": ids(10**12), "category": ids(1000), "creator_id": ids(10**9),
        "surface": torch.randint(1, len(SURFACES) + 1, (batch,), device=device, generator=g),
        "dense": torch.rand(batch, len(DENSE_FEATURES), device=device, generator=g) * 10,
        "labels": (torch.rand(batch, len(LABELS), device=device, generator=g) < 0.1).float(),
    }


def measure_step(config: Any, batch: int, device: Any, *, compiled: bool, steps: int, warmup: int) -> dict[str, Any]:
    """Examples/s of the ranker's training step on batches held on the device (the pipeline's ceiling)."""
    import contextlib

    import torch

    from core.contracts import LABELS
    from training.models.pin_ranker.model import PinRanker, multitask_loss

    torch.manual_seed(0)
    model = PinRanker(config).to(device)
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda)
    forward = torch.compile(model) if compiled else model
    batches = [random_batch(config, batch, device, i) for i in range(4)]

    def step(b: dict[str, Any]) -> tuple[Any, Any]:
        inputs = {k: v for k, v in b.items() if k != "labels"}
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            logits = forward(inputs)
        loss, _ = multitask_loss(logits, b["labels"], {})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss, logits

    losses = []
    for i in range(warmup):
        loss, logits = step(batches[i % len(batches)])
        losses.append(float(loss.detach()))
    if cuda and logits[LABELS[0]].dtype != torch.bfloat16:
        fail(f"logits are {logits[LABELS[0]].dtype} under autocast, expected torch.bfloat16")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    timed = [step(batches[i % len(batches)])[0] for i in range(steps)]
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    losses += [float(x.detach()) for x in timed]
    if not all(math.isfinite(x) for x in losses):
        fail(f"non-finite loss: {losses}")
    head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    if not tail < head:
        fail(f"the loss did not fall over {len(losses)} steps on repeated batches: {head:.4f} -> {tail:.4f}")
    return {"batch_size": batch, "compiled": compiled, "examples_per_s": round(batch * steps / seconds, 1),
            "step_ms": round(1000 * seconds / steps, 2),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "loss_first": round(head, 4), "loss_last": round(tail, 4)}


# --- (b) the training job ---------------------------------------------------------------------------------------
def launch(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def run_config(work: Path, root: Path, batch: int, name: str, **extra: Any) -> Path:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "root": str(root), "train_days": DAYS[:-1], "eval_ds": DAYS[-1], "output_dir": str(folder / "job"),
        "checkpoint_dir": str(folder / "checkpoints"), "mlflow_tracking_uri": "", "batch_size": batch, "epochs": 2,
        "min_steps": 0, "checkpoint_every": 4, "keep_checkpoints": 1, "heartbeat_every_s": 0.2, "deterministic": True,
        "num_workers": 0, "params": {"ablation": False}, **extra,
    }
    path = folder / "RUN.json"
    path.write_text(json.dumps(config))
    return path


def final_state(checkpoints: Path, work: Path, name: str) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from training.checkpoint import complete_checkpoints

    step, path = complete_checkpoints(checkpoints)[-1]
    target = work / f"{name}.pt"
    dcp_to_torch_save(str(path), str(target))
    return {"step": step, **torch.load(target, weights_only=False)}


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    import numpy as np
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys differ"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and np.array_equal(a, b) else [where]
    return [] if a == b else [where]


def check_job(work: Path, batch: int, procs: int, rows_per_day: int) -> dict[str, Any]:
    """Preflight, an uninterrupted run, a killed and retried run; their final checkpoints compared bitwise."""
    from training.smoke_data import write_tiny_world

    root = work / "storage"
    write_tiny_world(root, DAYS, rows_per_day=rows_per_day, pins=2000, users=500, row_group_size=max(64, batch))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    head = ["-m", "training.launch", "--nproc-per-node", str(procs), "--"]
    straight = run_config(work, root, batch, "straight")
    started = time.perf_counter()
    preflight = launch([*head, "-m", "training.preflight", "--config", str(straight)], env, 300)
    if preflight.returncode != 0:
        fail(f"preflight failed (exit {preflight.returncode}): {preflight.stdout[-2000:]}{preflight.stderr[-2000:]}")
    report = json.loads((work / "straight" / "job" / "preflight.json").read_text())
    first = launch([*head, "-m", "training.train", "--config", str(straight)], env, 600)
    if first.returncode != 0:
        fail(f"the uninterrupted run failed (exit {first.returncode}): {first.stderr[-3000:]}")
    killed = run_config(work, root, batch, "killed", debug_step_sleep_s=0.2)
    job = subprocess.Popen([sys.executable, *head, "-m", "training.train", "--config", str(killed)], cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    beat_file = work / "killed" / "job" / f"heartbeat-rank{procs - 1}.json"
    killed_at, deadline = None, time.monotonic() + 300
    while killed_at is None and job.poll() is None and time.monotonic() < deadline:
        try:
            beat = json.loads(beat_file.read_text())
        except (OSError, ValueError):
            beat = {}
        if beat.get("phase") == "training" and 5 <= beat.get("step", 0) < beat.get("total_steps", 0) - 2:
            os.kill(int(beat["pid"]), signal.SIGKILL)
            killed_at = int(beat["step"])
        time.sleep(0.02)
    _, stderr = job.communicate(timeout=300)
    if killed_at is None:
        fail(f"the job never reached a step to kill it at: {stderr[-2000:]}")
    if job.returncode != 75:
        fail(f"the killed job exited {job.returncode}, not 75 (INFRA, retried): {stderr[-2000:]}")
    retry = launch([*head, "-m", "training.train", "--config", str(killed)], env, 600)
    if retry.returncode != 0 or "resumed from" not in retry.stderr:
        fail(f"the retry did not resume (exit {retry.returncode}): {retry.stderr[-3000:]}")
    a = final_state(work / "straight" / "checkpoints", work, "straight")
    b = final_state(work / "killed" / "checkpoints", work, "killed")
    diff = differences(a, b)
    result = json.loads((work / "straight" / "job" / "result.json").read_text())
    return {"procs": procs, "batch_size": batch, "steps": a["step"], "killed_at_step": killed_at,
            "resumed_exact": not diff, "differences": diff[:5], "preflight_ok": bool(report.get("ok")),
            "backend": report.get("backend"), "allreduce": (report.get("ranks") or [{}])[0].get("checks", {}).get("allreduce"),
            "exported_model": Path(str(result.get("model_uri") or "")).name,
            "seconds": round(time.perf_counter() - started, 1), "input": result.get("input")}


# --- (c) the input pipeline ---------------------------------------------------------------------------------------
def check_input(work: Path, batch: int, procs: int, gpus: int) -> dict[str, Any]:
    """Examples/s the local engine delivers (workers sized from this machine), its second epoch."""
    import torch

    from operators.backends.resources import input_workers
    from training.config import RunConfig
    from training.data import ExampleStream

    cpus = len(os.sched_getaffinity(0))
    workers, threads = input_workers(cpus, procs, gpus)
    config = RunConfig.from_dict(json.loads(run_config(work, work / "storage", batch, "input").read_text()))
    family = config.family_instance()
    context = family.prepare(config.root, list(config.train_days), config.eval_ds)
    stream = ExampleStream(config.root, config.train_days, lambda t: family.encode(t, context), batch_size=batch,
                           encode_into=lambda t, alloc: family.encode_into(t, context, alloc),
                           dataset=family.dataset, columns=family.columns, num_workers=workers)
    loader = stream.loader(prefetch_factor=config.prefetch_factor, generator=torch.Generator().manual_seed(0))
    rates = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        started, rows = time.perf_counter(), 0
        for item in loader:
            rows += int(item["row_id"].shape[0])  # finish is the step's (on the GPU), not the input's
        rates.append(rows / (time.perf_counter() - started))
    return {"cpus": cpus, "num_workers": workers, "num_threads": threads, "batch_size": batch,
            "examples_per_s": round(rates[-1], 1)}


def main() -> int:
    check_imports()
    import torch

    want = os.environ.get("DEVICE", "cuda")
    cuda = want == "cuda"
    if cuda and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        fail("no CUDA device with bf16 support visible (torch.cuda.is_available() is False)", 75)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    batches = [int(b) for b in os.environ.get("BATCHES", "4096,16384" if cuda else "64,128").split(",")]
    steps, warmup = int(os.environ.get("STEPS", "20" if cuda else "4")), int(os.environ.get("WARMUP", "5" if cuda else "3"))
    compile_too = os.environ.get("COMPILE", "1" if cuda else "0") == "1"
    gpus = torch.cuda.device_count() if cuda else 0
    procs = max(1, gpus)
    with tempfile.TemporaryDirectory(prefix="pinflow-gpu-check-") as tmp:
        work = Path(tmp)
        config = production_config(small=not cuda)
        step = [measure_step(config, b, device, compiled=c, steps=steps, warmup=warmup)
                for b in batches for c in ((False, True) if compile_too else (False,))]
        print(f"(a) model step: {step}", file=sys.stderr, flush=True)
        job = check_job(work, batches[0] if cuda else 16, procs, int(os.environ.get("ROWS_PER_DAY", "40000" if cuda else "300")))
        print(f"(b) training job: {job}", file=sys.stderr, flush=True)
        pipeline = check_input(work, batches[0], procs, gpus)
        eager = next(s for s in step if s["batch_size"] == batches[0] and not s["compiled"])
        pipeline["vs_model_step"] = round(pipeline["examples_per_s"] / eager["examples_per_s"], 3)
        print(f"(c) input pipeline: {pipeline}", file=sys.stderr, flush=True)
    ok = job["resumed_exact"] and job["preflight_ok"]
    print(json.dumps({"ok": ok, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                      "step": step, "job": job, "input": pipeline}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
