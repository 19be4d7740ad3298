"""``torchrun`` with two CPU processes trains, checkpoints, evaluates, registers; the corpus gets scored.

Real processes, a real gloo process group, a real MLflow store (SQLite in tmp_path). Tiny sizes: a few
hundred examples over two days, a small model, one thread per process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from core.failures import ExitCode
from core.storage import read_table
from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN_DAYS = ["2026-01-01", "2026-01-02"]
EVAL_DS = "2026-01-03"


def run_config(tmp_path: Path, **overrides) -> Path:
    config = {
        "root": str(tmp_path / "storage"),
        "train_days": TRAIN_DAYS,
        "eval_ds": EVAL_DS,
        "output_dir": str(tmp_path / "job"),
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "mlflow_artifact_location": str(tmp_path / "artifacts"),
        "experiment": "pin_ranker_test",
        "model_name": "pin_ranker_test",
        "run_name": "integration",
        "epochs": 2,
        "batch_size": 32,
        "lr": 3e-3,
        "warmup_steps": 2,
        "checkpoint_every": 4,
        "heartbeat_every_s": 0.2,
        "log_every": 2,
        "num_workers": 0,
        "min_steps": 0,  # short on purpose: exactly the epochs asked for
        **overrides,
        # The ranker's hyperparameters, small; ``params`` in the overrides add to them.
        "params": {
            "sequence_length": 16,
            "first_k": 2,
            "d_model": 16,
            "ff_dim": 32,
            "pin_buckets": 503,
            "user_buckets": 503,
            "creator_buckets": 101,
            "category_buckets": 31,
            "mlp_hidden": [32],
            **overrides.get("params", {}),
        },
    }
    path = tmp_path / "RUN.json"
    path.write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture
def world(tmp_path: Path) -> dict[str, object]:
    return write_tiny_world(
        tmp_path / "storage", [*TRAIN_DAYS, EVAL_DS], rows_per_day=160, pins=90, row_group_size=40, max_sequence=20
    )


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_torchrun_trains_registers_and_the_corpus_is_scored_once(tmp_path: Path, world):
    from mlflow import MlflowClient

    from training.inference import MANIFEST, publish_manifest, score_shard
    from training.inference import main as inference_main

    config = run_config(tmp_path)
    proc = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "training.train",
            "--config",
            str(config),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    job = tmp_path / "job"
    result = json.loads((job / "result.json").read_text())
    assert result["model_name"] == "pin_ranker_test"
    assert result["model_version"] == "1"
    assert result["model_uri"] == "models:/pin_ranker_test/1"
    assert result["steps"] > 0 and result["examples_seen"] > 0 and result["seconds"] > 0
    metrics = result["metrics"]
    assert metrics["examples"] == 160
    for key in ("auc", "baseline_auc", "oracle_auc", "logloss", "calibration"):
        assert set(metrics[key]) == {"click", "repin", "hide"}, key
    for rank in (0, 1):
        beat = json.loads((job / f"heartbeat-rank{rank}.json").read_text())
        assert beat["rank"] == rank and beat["world_size"] == 2
        assert beat["step"] == result["steps"]
        assert beat["phase"] == "done"
    assert not list(job.glob("failure-rank*.json"))
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert checkpoints[-1] == f"step-{result['steps']:08d}"
    assert all((tmp_path / "checkpoints" / name / "COMPLETE.json").exists() for name in checkpoints)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version("pin_ranker_test", "1")
    assert version.run_id == result["mlflow_run_id"]
    mlflow_run = client.get_run(result["mlflow_run_id"])
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["eval_ds"] == EVAL_DS
    assert "eval_auc_click" in mlflow_run.data.metrics and "eval_mean_auc" in mlflow_run.data.metrics
    assert len(client.get_metric_history(result["mlflow_run_id"], "train_loss")) >= 2
    assert (tmp_path / "artifacts").is_dir()  # the experiment's artifact location

    # A rerun into the finished run's checkpoints with another lr: refused in one line before a step is trained; the
    # MLflow run it continued stays FINISHED (it turned FAILED) and its version stays the only one.
    proc = run(["-m", "training.train", "--config", str(run_config(tmp_path, lr=1e-2))])
    assert proc.returncode == ExitCode.USER, proc.stderr[-4000:]
    assert "lr: saved 0.003, now 0.01" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert client.get_run(result["mlflow_run_id"]).info.status == "FINISHED"
    # A job of one rank in the folder of a job of two: rank 1's heartbeat is not this job's (the progress tab showed it).
    assert (job / "failure-rank0.json").exists() and not (job / "heartbeat-rank1.json").exists()
    assert [str(v.version) for v in client.search_model_versions("name='pin_ranker_test'")] == ["1"]

    # Corpus inference: shard 0 through the CLI, shard 1 in process, then a rerun that skips.
    out = tmp_path / "inference"
    common = [
        "--model-uri",
        result["model_uri"],
        "--tracking-uri",
        uri,
        "--root",
        str(tmp_path / "storage"),
        "--ds",
        EVAL_DS,
        "--num-shards",
        "2",
        "--out-dir",
        str(out),
    ]
    proc = run(["-m", "training.inference", *common, "--shard", "0"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["shard"] == 0 and line["skipped"] is False
    shard1 = score_shard(
        model_uri=result["model_uri"],
        tracking_uri=uri,
        root=str(tmp_path / "storage"),
        ds=EVAL_DS,
        shard=1,
        num_shards=2,
        out_dir=out,
    )
    assert shard1["skipped"] is False
    assert inference_main([*common, "--shard", "1"]) == 0  # already there: skipped

    manifest = publish_manifest(out, 2, result["model_uri"], EVAL_DS)
    assert json.loads((out / MANIFEST).read_text()) == manifest
    scored = [p for part in manifest["parts"] for p in pq.read_table(out / part["file"]).column("pin_id").to_pylist()]
    corpus = read_table(tmp_path / "storage", "raw/pins", EVAL_DS, columns=["pin_id"]).column("pin_id").to_pylist()
    assert sorted(scored) == sorted(corpus)  # every pin exactly once
    assert manifest["rows"] == len(corpus) == line["rows"] + shard1["rows"]
    # Each shard is a contiguous range of the snapshot's rows (the plan), in the manifest's order.
    assert [part["rows"] for part in manifest["parts"]] == [line["rows"], shard1["rows"]]
    scores = pq.read_table(out / "part-00001.parquet").to_pandas()
    for label in ("p_click", "p_repin", "p_hide"):
        assert np.all((scores[label] > 0) & (scores[label] < 1))


def test_nan_loss_fails_every_rank_with_the_nan_exit_code(tmp_path: Path, world):
    config = run_config(tmp_path, fail_nan_at_step=2, checkpoint_every=0)
    proc = run(
        ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config", str(config)]
    )
    assert proc.returncode == ExitCode.NAN_LOSS, proc.stderr[-4000:]
    for rank in (0, 1):  # the NaN was injected on rank 1 only; the all-reduced check stops both
        failure = json.loads((tmp_path / "job" / f"failure-rank{rank}.json").read_text())
        assert failure["exit_code"] == ExitCode.NAN_LOSS
        assert failure["failure_class"] == "USER"
        assert "at step 2" in failure["message"]
    assert not (tmp_path / "job" / "result.json").exists()


def final_state(checkpoint_dir: Path, tmp_path: Path, name: str) -> dict[str, object]:
    """The newest checkpoint of ``checkpoint_dir`` as one flat dict (DCP → torch.save, read back)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from training.checkpoint import complete_checkpoints

    step, path = complete_checkpoints(checkpoint_dir)[-1]
    target = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(path), str(target))
    return {"step": step, **torch.load(target, weights_only=False)}


def assert_bitwise_equal(a: object, b: object, where: str = "") -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs: max |a-b| = {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def kill_a_ray_worker(tasks_only: bool) -> bool:
    """SIGKILL a Ray worker process running a read-and-encode task (``ray::MapBatches(...)``), or, unless
    ``tasks_only``, an idle one of the pool (``ray::IDLE``); never Ray's own actors. True if one was killed."""
    import signal

    idle = None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::MapBatches"):
            os.kill(int(proc.name), signal.SIGKILL)
            return True
        if title.startswith("ray::IDLE"):
            idle = int(proc.name)
    if idle is not None and not tasks_only:
        os.kill(idle, signal.SIGKILL)
        return True
    return False


@pytest.mark.parametrize(("strategy", "engine"), [("ddp", "workers"), ("fsdp", ""), ("torchrec", ""), ("ddp", "ray")])
def test_sigkill_of_one_rank_then_restart_is_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path, world, strategy: str, engine: str
):
    """With input workers (ddp) and with the Ray engine: for Ray, the uninterrupted run reads with the local engine
    (no workers) and the killed one with Ray, which also loses one of its workers mid-epoch: the same batches."""
    import signal
    import time

    inputs = {"workers": {"num_workers": 1}, "ray": {"input_engine": "ray"}}.get(engine, {})
    common = {
        "strategy": strategy,
        "deterministic": True,
        "register": False,
        "epochs": 2,
        "batch_size": 16,
        "checkpoint_every": 3,
        "keep_checkpoints": 1,
        "min_steps": 0,  # short on purpose: exactly the epochs asked for
        "params": {"ablation": strategy != "fsdp"},
        # TorchRec: the tables row-wise (by hand on CPU), each rank holding half of every table's rows.
        **({"sharding": "row_wise"} if strategy == "torchrec" else {}),
    }
    launch = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config"]

    # Uninterrupted.
    straight = tmp_path / "straight"
    straight.mkdir()
    proc = run([*launch, str(run_config(straight, **common, **({} if engine == "ray" else inputs),
                                        root=str(tmp_path / "storage")))])
    assert proc.returncode == 0, proc.stderr[-4000:]

    # Killed: SIGKILL rank 1 once it is past a checkpoint, in the middle of the run, then restart.
    killed = tmp_path / "killed"
    killed.mkdir()
    config = run_config(killed, **common, **inputs, root=str(tmp_path / "storage"), debug_step_sleep_s=0.25)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [sys.executable, *launch, str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    beat_file = killed / "job" / "heartbeat-rank1.json"
    deadline = time.monotonic() + 240
    killed_at = None
    ray_worker_killed = engine != "ray"
    while time.monotonic() < deadline and job.poll() is None:
        try:
            beat = json.loads(beat_file.read_text())
        except (OSError, ValueError):
            beat = {}
        if not ray_worker_killed and beat.get("phase") == "training" and beat.get("step", 0) >= 2:
            # A task's worker if one is caught running (its task is retried), else an idle one of the pool.
            ray_worker_killed = kill_a_ray_worker(tasks_only=beat.get("step", 0) < 4)
        if ray_worker_killed and beat.get("phase") == "training" and 5 <= beat.get("step", 0) < beat.get("total_steps", 0) - 3:
            os.kill(beat["pid"], signal.SIGKILL)
            killed_at = beat["step"]
            break
        time.sleep(0.02)
    _, stderr = job.communicate(timeout=240)
    assert killed_at is not None, f"rank 1 never reached a step to kill it at: {stderr[-3000:]}"
    assert ray_worker_killed
    assert job.returncode == ExitCode.INFRA, stderr[-3000:]  # a lost peer is retried
    assert not (killed / "job" / "result.json").exists()

    proc = run([*launch, str(config)])  # the retry: resumes from the newest complete checkpoint
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr
    assert "not an exact resume" not in proc.stderr
    resume = json.loads((killed / "job" / "result.json").read_text())["resume"]
    assert resume["exact"] is True and resume["data_restored"] is True, resume
    assert resume["reason"].startswith("same layout as saved (2 rank(s)")
    if engine == "ray":
        assert "input ray" in proc.stderr

    # FSDP2 and TorchRec row-wise save each rank's rows of a table (sharded at rest); DDP one replicated copy.
    import torch.distributed.checkpoint as dcp

    from training.checkpoint import complete_checkpoints

    metadata = dcp.FileSystemReader(str(complete_checkpoints(killed / "checkpoints")[-1][1])).read_metadata()
    key = "model.pin_emb.ebc.embedding_bags.pin_emb.weight" if strategy == "torchrec" else "model.pin_emb.weight"
    chunks = metadata.state_dict_metadata[key].chunks
    assert len(chunks) == (1 if strategy == "ddp" else 2)
    a = final_state(straight / "checkpoints", tmp_path, "straight")
    b = final_state(killed / "checkpoints", tmp_path, "killed")
    assert a["step"] == b["step"] and a["step"] > killed_at
    assert_bitwise_equal(a, b)  # model, optimizer (and ablation), scheduler, data position, RNG states
    result_a = json.loads((straight / "job" / "result.json").read_text())
    result_b = json.loads((killed / "job" / "result.json").read_text())
    assert result_a["metrics"]["auc"] == result_b["metrics"]["auc"]
    assert result_a["examples_seen"] == result_b["examples_seen"]


@pytest.mark.slow  # about 90 s on 2 cores: three ranks
def test_torchrec_resumes_on_three_ranks_what_two_saved_and_says_why_it_is_not_exact(tmp_path: Path, world):
    """A 2-rank row-wise job's checkpoint continued by a 3-rank one from the same step (the tables' bitwise reshard
    at 3 ranks and at 1 rank table-wise: ``test_sharded_tables.py``)."""
    common = {
        "strategy": "torchrec", "sharding": "row_wise", "register": False, "batch_size": 16, "checkpoint_every": 0,
        "min_steps": 0, "params": {"ablation": False}, "root": str(tmp_path / "storage"),
        "checkpoint_dir": str(tmp_path / "checkpoints"),
    }
    launch = ["-m", "training.launch", "--nproc-per-node"]
    first, second = tmp_path / "two", tmp_path / "three"
    first.mkdir()
    second.mkdir()
    proc = run([*launch, "2", "--", "-m", "training.train", "--config", str(run_config(first, **common, epochs=1))])
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads((first / "job" / "result.json").read_text())
    assert saved["resume"] is None and saved["steps"] > 0

    # Three epochs: 3 ranks take fewer steps an epoch (each reads whole row groups), the first epoch is past.
    proc = run([*launch, "3", "--", "-m", "training.train", "--config", str(run_config(second, **common, epochs=3))])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "not an exact resume: saved by 2 rank(s), resumed on 3" in proc.stderr
    result = json.loads((second / "job" / "result.json").read_text())
    resume = result["resume"]
    assert resume["step"] == saved["steps"] and resume["exact"] is False and not resume["data_restored"]
    assert resume["saved"] == {"world_size": 2, "sharding": "row_wise"}
    assert resume["now"] == {"world_size": 3, "sharding": "row_wise"}
    assert "resharded bit for bit" in resume["reason"]
    assert any(w.startswith(f"resumed {resume['from']} at step {saved['steps']}: not an exact resume: saved by 2")
               for w in result["warnings"]), result["warnings"]
    # The end of the 2-rank epoch is the end of the 3-rank world's first epoch: the two epochs left are trained.
    continued = re.search(rf"saved at step {saved['steps']} of its {saved['steps']} \(the end of its 1 epoch\(s\)\): "
                          r"continued at step (\d+) of this world's (\d+)", resume["reason"])
    assert continued, resume["reason"]
    first_epoch, total = int(continued[1]), int(continued[2])
    assert total == 3 * first_epoch == result["steps"]  # epochs 2 and 3 trained, the first not again
    assert f"resumed from {resume['from']} at step" in proc.stderr


def test_torchrec_refuses_a_checkpoint_of_another_model_or_a_world_too_small_before_training(tmp_path: Path, world):
    """Both USER errors name the table and the numbers, and come before a step is trained. Worlds of one rank."""
    common = {
        "strategy": "torchrec", "register": False, "batch_size": 16, "checkpoint_every": 0, "min_steps": 0,
        "params": {"ablation": False}, "root": str(tmp_path / "storage"), "checkpoint_dir": str(tmp_path / "ckpt"),
    }
    jobs = {name: tmp_path / name for name in ("saved", "small", "other")}
    for folder in jobs.values():
        folder.mkdir()
    proc = run(["-m", "training.train", "--config", str(run_config(jobs["saved"], **common, epochs=1))])
    assert proc.returncode == 0, proc.stderr[-4000:]

    # Table-wise on one rank with a budget smaller than the largest table: no plan, named with the checkpoint.
    config = run_config(jobs["small"], **common, epochs=2, sharding="table_wise", embedding_memory_mb=0.01)
    proc = run(["-m", "training.train", "--config", str(config)])
    assert proc.returncode == ExitCode.USER, proc.stderr[-4000:]
    failure = json.loads((jobs["small"] / "job" / "failure-rank0.json").read_text())
    assert failure["failure_class"] == "USER"
    assert "cannot reshard checkpoint" in failure["message"] and "(saved by 1 rank(s), row_wise)" in failure["message"]
    assert "onto 1 rank(s) table_wise" in failure["message"] and "pin_emb 503x16" in failure["message"]
    assert "resumed from" not in proc.stderr and "step 1/" not in proc.stderr

    # The same run with another number of pin buckets: the checkpoint is of another model.
    config = run_config(jobs["other"], **{**common, "params": {"ablation": False, "pin_buckets": 1009}}, epochs=2)
    proc = run(["-m", "training.train", "--config", str(config)])
    assert proc.returncode == ExitCode.USER, proc.stderr[-4000:]
    failure = json.loads((jobs["other"] / "job" / "failure-rank0.json").read_text())
    assert failure["failure_class"] == "USER"
    assert "pin_emb is 503 x 16 in the checkpoint, 1009 x 16 in this model" in failure["message"], failure["message"]
    assert "resumed from" not in proc.stderr


@pytest.mark.parametrize("strategy", ["ddp", "torchrec"])
def test_a_managed_id_model_trains_on_two_ranks_registers_and_scores_the_corpus(tmp_path: Path, world, strategy):
    """id_tables managed through the whole job (2 ranks, MLflow): the registered program carries the mapping the job
    chose (under torchrec: gathered beside the sharded tables), and corpus inference scores every pin with it."""
    import torch
    from mlflow import MlflowClient

    from training.inference import load_model, score_shard

    config = run_config(tmp_path, epochs=1, strategy=strategy,
                        params={"id_tables": "managed", "pin_buckets": 31, "ablation": False})
    launch = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config", str(config)]
    proc = run(launch)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "job" / "result.json").read_text())
    assert result["metrics"]["examples"] == 160 and result["metrics"]["mean_auc"] is not None
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    version = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version("pin_ranker_test", "1")
    assert version.run_id == result["mlflow_run_id"]

    module, spec = load_model(result["model_uri"], uri)
    assert spec["params"]["id_tables"] == "managed" and spec["model_config"]["id_tables"] == "managed"
    managed = dict(module.named_buffers())["ranker.managed_pin_id"]
    assert (managed[:-1] != torch.iinfo(torch.int64).max).sum() == 27  # 31 rows: 27 own, 3 tail, row 0 absent
    out = score_shard(model_uri=result["model_uri"], tracking_uri=uri, root=str(tmp_path / "storage"), ds=EVAL_DS,
                      shard=0, num_shards=1, out_dir=tmp_path / "inference")
    corpus = read_table(tmp_path / "storage", "raw/pins", EVAL_DS, columns=["pin_id"])
    assert out["skipped"] is False and out["rows"] == corpus.num_rows


def test_a_sharded_export_evaluates_registers_and_scores_what_the_gathered_model_does(tmp_path: Path, world):
    """strategy torchrec with sharded_export_above_mib 0 on two ranks: each rank exports its rows, both ranks evaluate
    their share of the day through the trained sharded model (never the gathered model, nor the files), MLflow
    registers the pointer, and the corpus plan by pin-table rows gives each scorer only its rank's file of the pin
    table. The gathered path, run from the same final checkpoint
    without tracking, gives the same metrics and the same scores."""
    import shutil

    import torch

    from training import sharded_export
    from training.inference import (
        PIN_ROWS,
        SHARDED_ROWS_TAG,
        Scorer,
        load_model,
        make_plan,
        publish_plan,
        score_plan_shard,
        write_plan,
    )

    def train(config: Path) -> dict[str, Any]:
        launch = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config",
                  str(config)]
        proc = run(launch)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(Path(json.loads(config.read_text())["output_dir"], "result.json").read_text())

    root = tmp_path / "storage"
    sharded_config = run_config(tmp_path, epochs=1, strategy="torchrec", sharding="row_wise",
                                sharded_export_above_mib=0)
    sharded = train(sharded_config)
    folder = sharded["sharded_export"]
    manifest = json.loads((Path(folder) / sharded_export.MANIFEST_FILE).read_text())
    pin_files = [(s["row_start"], s["row_end"]) for s in manifest["tables"]["pin_emb"]["shards"]]
    assert pin_files == [(0, 252), (252, 503)] and manifest["world_size"] == 2
    assert (Path(folder).parent / "ablation" / sharded_export.MANIFEST_FILE).exists()

    # The gathered path: the same final checkpoint resumed (nothing left to train), gathered, without MLflow.
    (tmp_path / "gathered").mkdir()
    shutil.copytree(tmp_path / "checkpoints", tmp_path / "gathered" / "checkpoints",
                    ignore=shutil.ignore_patterns("mlflow_run.json"))
    gathered = train(run_config(tmp_path / "gathered", epochs=1, strategy="torchrec", sharding="row_wise",
                                root=str(root), mlflow_tracking_uri=""))
    assert gathered["sharded_export"] is None and gathered["steps"] == sharded["steps"]
    assert (sharded["evaluated_by_ranks"], gathered["evaluated_by_ranks"]) == (2, 1)
    assert (sharded["sharded_table_rows"], gathered["sharded_table_rows"]) == (503, None)
    assert sharded["metrics"]["examples"] == gathered["metrics"]["examples"] == 160
    for key in ("auc", "ablation_auc", "logloss"):
        for label, value in sharded["metrics"][key].items():
            assert value == pytest.approx(gathered["metrics"][key][label], abs=1e-6), (key, label)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from mlflow import MlflowClient

    version = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version("pin_ranker_test", "1")
    assert version.tags[SHARDED_ROWS_TAG] == "503"
    plan = make_plan(model_uri=sharded["model_uri"], tracking_uri=uri, root=str(root), ds=EVAL_DS,
                     out_dir=tmp_path / "inference", num_shards=2, table_rows=503)
    assert plan.sharding == PIN_ROWS
    write_plan(plan)
    for shard in range(2):
        scorer = Scorer.load(plan.model_uri, uri)
        record = score_plan_shard(plan, shard, scorer)
        opened = [f for f in sharded_export.opened_files(scorer.module) if "/pin_emb/" in f]
        assert len(opened) == 1 and f"rows-{pin_files[shard][0]:012d}" in opened[0], opened
        assert record["rows"] > 0
    published = publish_plan(plan)
    scores = read_table(root, "raw/pins", EVAL_DS, columns=["pin_id"])  # every pin, once
    assert published["rows"] == scores.num_rows
    parts = pq.read_table(tmp_path / "inference").to_pandas().set_index("pin_id").sort_index()

    _, spec = load_model(sharded["model_uri"], uri)
    family = Scorer.load(sharded["model_uri"], uri).family
    # The gathered weights (the exported program of the run without tracking) in the family's serving module.
    plain = family.model_from_serving(torch.export.load(gathered["model_uri"]).module()).eval()
    pins = read_table(root, "raw/pins", EVAL_DS)
    want = family.score_corpus(family.serving(plain), pins, spec, str(root), EVAL_DS)
    want = want.to_pandas().set_index("pin_id").sort_index()
    assert list(parts.index) == list(want.index)
    for column in want.columns:
        np.testing.assert_allclose(parts[column].to_numpy(), want[column].to_numpy(), rtol=0, atol=1e-6)

    # The promotion gate's check of a sharded champion (the next run's): over its table files, never built whole
    # (model_from_serving could not: ShardedRows hold no weights), with the metrics its own run's ranks computed.
    from training.champion import CHAMPION_ALIAS, evaluate_champion
    from training.config import RunConfig

    MlflowClient(tracking_uri=uri, registry_uri=uri).set_registered_model_alias("pin_ranker_test", CHAMPION_ALIAS, "1")
    champion = evaluate_champion(RunConfig.from_json(sharded_config), family, None, device="cpu")
    assert champion is not None and "error" not in champion, champion
    for label, value in sharded["metrics"]["auc"].items():
        assert champion["metrics"]["auc"][label] == pytest.approx(value, abs=1e-6), label


def test_the_launcher_leaves_no_folder_of_torchrun_behind(tmp_path: Path):
    """torchrun keeps its ranks' error files in a folder of its own, in the temp directory unless told, and leaves it
    there: the launcher gives it one and removes it after the workers, whether they succeed or fail."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    for code in (0, 3):
        done = subprocess.run(
            [sys.executable, "-m", "training.launch", "--nproc-per-node", "2", "--", "-c", f"raise SystemExit({code})"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )
        assert (done.returncode == 0) == (code == 0), done.stderr[-2000:]
    assert sorted(p.name for p in temp.iterdir()) == []
