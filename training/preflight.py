"""Health check of a training job's nodes before it trains: ``python -m training.preflight --config RUN.json``.

Run it under ``torchrun`` (or ``python -m training.launch ... -- -m training.preflight --config RUN.json``)
with the same world as the training job. Every rank checks:

- ``devices``: CUDA is there (and its count covers ``LOCAL_RANK``) when ``device`` asks for it, with the
  name and free memory of this rank's GPU; on CPU the thread count;
- ``allreduce``: an all-reduce over the process group (gloo on CPU, NCCL on GPU) returns the exact sum,
  and its bandwidth (bus bandwidth, as nccl-tests counts it) is at least ``--min-bus-gbps``;
- ``disk``: free space where ``checkpoint_dir`` lives covers ``keep_checkpoints + 1`` checkpoints of the
  configured model (parameters + AdamW moments) plus ``--min-free-gb``, and it is writable; on an object
  store (``s3://...``) free space is not a question (the check says so) and writing and deleting a probe
  object proves access;
- ``data``: the pins snapshot and the examples partitions of ``train_days`` and ``eval_ds`` are complete
  and their first row group reads (rank 0 only: the footers of every file, one row group);
- ``mlflow``: the tracking server answers (rank 0 only).

Rank 0 gathers every rank's checks and writes ``<output_dir>/preflight.json`` (``ok``, ``exit_code``,
``failure_class``, the checks per rank, their timings) and prints it as one JSON line. Exit codes
(``core.failures.ExitCode``): 0 all checks pass; 65 DATA (an input is missing or unreadable: fail
now, a retry cannot help); 75 INFRA (a device, the network, the disk or MLflow: retry, maybe elsewhere);
1 USER (RUN.json is invalid). DATA wins over INFRA when both fail.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import shutil
import sys
import time
from typing import Any

from core import storage
from core.failures import ConfigError, ExitCode, FailureClass, exit_code_for
from training.config import RunConfig
from training.runtime import DistEnv, now_iso, setup_logging

log = logging.getLogger("training.preflight")

REPORT_FILE = "preflight.json"
# Which failure class a failed check stands for.
CHECK_CLASS = {
    "devices": FailureClass.INFRA,
    "allreduce": FailureClass.INFRA,
    "disk": FailureClass.INFRA,
    "data": FailureClass.DATA,
    "mlflow": FailureClass.INFRA,
}


def check_devices(config: RunConfig, env: DistEnv) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {"cuda_available": cuda, "torch": torch.__version__, "threads": torch.get_num_threads()}
    if config.device == "cuda" and not cuda:
        raise RuntimeError("device='cuda' but CUDA is not available on this node")
    if cuda and config.device != "cpu":
        count = torch.cuda.device_count()
        info["cuda_devices"] = count
        if env.local_rank >= count:
            raise RuntimeError(f"LOCAL_RANK {env.local_rank} but only {count} CUDA device(s) on this node")
        free, total = torch.cuda.mem_get_info(env.local_rank)
        info.update(
            device=torch.cuda.get_device_name(env.local_rank),
            free_gib=round(free / 2**30, 2),
            total_gib=round(total / 2**30, 2),
            bf16=torch.cuda.is_bf16_supported(),
        )
    return info


def check_allreduce(device: Any, world_size: int, megabytes: float, min_bus_gbps: float) -> dict[str, Any]:
    """Exact sum of rank-valued tensors, then the bus bandwidth of a ``megabytes`` float32 all-reduce."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    probe = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    expected = world_size * (world_size + 1) / 2
    if not torch.all(probe == expected):
        raise RuntimeError(f"all-reduce returned {probe[:4].tolist()}..., expected {expected} everywhere")
    n = max(1, int(megabytes * 2**20 / 4))
    payload = torch.ones(n, device=device)
    dist.all_reduce(payload)  # warm-up (connection setup, NCCL communicator)
    iters = 5
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(payload)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    size = n * 4
    alg = size / seconds / 1e9
    bus = alg * (2 * (world_size - 1) / world_size) if world_size > 1 else alg
    info = {
        "sum_ok": True,
        "bytes": size,
        "iter_seconds": round(seconds, 6),
        "alg_gbps": round(alg, 3),
        "bus_gbps": round(bus, 3),
    }
    if world_size > 1 and bus < min_bus_gbps:
        raise RuntimeError(f"all-reduce bus bandwidth {bus:.3f} GB/s is below --min-bus-gbps {min_bus_gbps}")
    return info


def checkpoint_bytes(config: RunConfig) -> int:
    """Bytes of one checkpoint of the family's models: fp32 parameters + two AdamW moments, every variant."""
    import torch

    family = config.family_instance()
    with torch.device("meta"):
        params = sum(p.numel() for v in family.variants() for p in family.build_model(v).parameters())
    return params * 4 * 3


def check_disk(config: RunConfig, min_free_gb: float, env: DistEnv) -> dict[str, Any]:
    if storage.is_remote(config.checkpoint_dir):
        return check_object_store(config.checkpoint_dir, env)
    target = storage.local_path(config.checkpoint_dir)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    usage = shutil.disk_usage(existing)
    need = checkpoint_bytes(config) * (config.keep_checkpoints + 1) + int(min_free_gb * 1e9)
    info = {"path": str(existing), "free_gb": round(usage.free / 1e9, 3), "need_gb": round(need / 1e9, 3)}
    if usage.free < need:
        raise RuntimeError(
            f"{usage.free / 1e9:.2f} GB free at {existing} for checkpoints in {target}, need {need / 1e9:.2f} GB "
            f"({config.keep_checkpoints + 1} checkpoints + --min-free-gb {min_free_gb})"
        )
    target.mkdir(parents=True, exist_ok=True)
    probe = target / f".preflight-{env.rank}-{os.getpid()}"
    probe.write_bytes(b"ok")
    probe.unlink()
    info["writable"] = True
    return info


def check_object_store(url: str, env: DistEnv) -> dict[str, Any]:
    """Write, read back and delete a probe object under ``url`` (credentials, bucket, permissions)."""
    probe = storage.join(url, f".preflight-{env.rank}-{os.getpid()}.json")
    storage.write_json(probe, {"rank": env.rank, "time": now_iso()})
    try:
        storage.read_text(probe)
    finally:
        storage.remove(probe)
    return {"path": url, "writable": True, "free_gb": None, "note": "object store: no free-space limit to check"}


def check_data(config: RunConfig) -> dict[str, Any]:
    """The family's dataset has rows on the training and evaluation days, its columns, and encodes."""
    from training.data import example_units, read_unit

    family = config.family_instance()
    context = family.prepare(config.input_root, list(config.train_days), config.eval_ds)
    units = example_units(config.input_root, config.train_days, dataset=family.dataset, columns=family.columns)
    eval_units = example_units(config.input_root, [config.eval_ds], dataset=family.dataset, columns=family.columns)
    if not units or not eval_units:
        from core.failures import DataError

        which = "train_days" if not units else "eval_ds"
        raise DataError(f"no rows in {family.dataset} of {which} under {config.root}")
    first = units[0]
    table = read_unit(config.input_root, first, list(family.columns))  # examples' sequence references resolved
    family.encode(table.slice(0, 8), context)  # the rows join what they need (pins of the snapshot)
    return {
        "dataset": family.dataset,
        "snapshot_ds": getattr(context, "ds", None),
        "train_rows": sum(u.rows for u in units),
        "eval_rows": sum(u.rows for u in eval_units),
        "row_groups": len(units),
        "read_rows": table.num_rows,
    }


def check_mlflow(config: RunConfig) -> dict[str, Any]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=config.mlflow_tracking_uri, registry_uri=config.mlflow_tracking_uri)
    start = time.perf_counter()
    experiments = client.search_experiments(max_results=1)
    client.search_registered_models(max_results=1)
    return {
        "uri": config.mlflow_tracking_uri.split("@")[-1],
        "experiments_seen": len(experiments),
        "seconds": round(time.perf_counter() - start, 3),
    }


def _run_check(name: str, fn: Any, *args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        info = fn(*args)
        return {"ok": True, "seconds": round(time.perf_counter() - start, 3), **info}
    except Exception as exc:  # a check reports, it does not crash the preflight
        # A DataError anywhere is DATA; any other failure takes the class of its check (a data file that
        # does not parse is DATA, a device or disk error INFRA).
        klass = FailureClass.DATA if exit_code_for(exc) == ExitCode.DATA else CHECK_CLASS[name]
        log.error("preflight check %s failed: %s", name, exc)
        return {
            "ok": False,
            "seconds": round(time.perf_counter() - start, 3),
            "error": f"{type(exc).__name__}: {exc}",
            "failure_class": klass.value,
        }


def verdict(ranks: list[dict[str, dict[str, Any]]]) -> tuple[ExitCode, FailureClass | None]:
    """The exit code of a set of checks: DATA if any data check failed, else INFRA if anything failed."""
    failed = [check for checks in ranks for check in checks.values() if not check["ok"]]
    if not failed:
        return ExitCode.OK, None
    if any(check["failure_class"] == FailureClass.DATA.value for check in failed):
        return ExitCode.DATA, FailureClass.DATA
    return ExitCode.INFRA, FailureClass.INFRA


def preflight(config: RunConfig, env: DistEnv, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    checks: dict[str, dict[str, Any]] = {"devices": _run_check("devices", check_devices, config, env)}
    use_cuda = config.device != "cpu" and torch.cuda.is_available() and checks["devices"]["ok"]
    device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = dt.timedelta(seconds=args.timeout_s)
    backend = "nccl" if use_cuda else "gloo"
    if env.launched:
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        checks["allreduce"] = _run_check(
            "allreduce", check_allreduce, device, env.world_size, args.allreduce_mb, args.min_bus_gbps
        )
        checks["disk"] = _run_check("disk", check_disk, config, args.min_free_gb, env)
        if env.is_main:
            checks["data"] = _run_check("data", check_data, config)
            if config.mlflow_tracking_uri:  # a run without tracking needs no server (nor MLflow installed)
                checks["mlflow"] = _run_check("mlflow", check_mlflow, config)
        gathered: list[Any] = [None] * env.world_size
        dist.all_gather_object(gathered, {"rank": env.rank, "checks": checks})
    finally:
        dist.destroy_process_group()
    ranks = sorted(gathered, key=lambda r: r["rank"])
    code, klass = verdict([r["checks"] for r in ranks])
    return {
        "ok": code == ExitCode.OK,
        "exit_code": int(code),
        "failure_class": klass.value if klass else None,
        "world_size": env.world_size,
        "backend": backend,
        "time": now_iso(),
        "ranks": ranks,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.preflight",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="the run's RUN.json (see python -m training.train --help)")
    parser.add_argument("--report", help=f"where rank 0 writes the report (default: <output_dir>/{REPORT_FILE})")
    parser.add_argument("--allreduce-mb", type=float, default=16.0, help="size of the bandwidth all-reduce (MB)")
    parser.add_argument("--min-bus-gbps", type=float, default=0.05, help="lowest acceptable bus bandwidth (GB/s)")
    parser.add_argument("--min-free-gb", type=float, default=1.0, help="free space to keep beyond the checkpoints")
    parser.add_argument("--timeout-s", type=int, default=300, help="timeout of the process group's collectives")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = DistEnv.from_env()
    setup_logging(env.rank)
    try:
        config = RunConfig.from_json(args.config)
    except ConfigError as e:
        log.error("%s", e)
        return int(e.exit_code)
    try:
        report = preflight(config, env, args)
    except Exception as exc:  # the process group itself did not come up: a lost peer or a bad address
        code = exit_code_for(exc)
        log.error("preflight failed before its checks (exit %d): %s", int(code), exc)
        return int(code)
    if env.is_main:
        storage.write_json(args.report or storage.join(config.output_dir, REPORT_FILE), report)
        print(json.dumps(report), flush=True)
    return int(report["exit_code"])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
