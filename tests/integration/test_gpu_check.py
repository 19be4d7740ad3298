"""The GPU check (``benchmarks/gpu_training.sh``) rehearsed on CPU: every part that is not CUDA keeps working (the
step's measurement and checks, the training job's preflight, SIGKILL and exact resume without MLflow, the input
pipeline against the step), so that the one run on a GPU machine does not fail on something a CPU could have shown."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_the_gpu_check_runs_every_part_on_cpu():
    env = {**os.environ, "DEVICE": "cpu", "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": ""}
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_training.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["device"] == "cpu"
    assert [s["batch_size"] for s in summary["step"]] == [64, 128]
    assert all(s["examples_per_s"] > 0 and s["loss_last"] < s["loss_first"] for s in summary["step"])
    job = summary["job"]
    assert job["resumed_exact"] and job["differences"] == [] and job["killed_at_step"] >= 5
    assert job["preflight_ok"] and job["allreduce"]["sum_ok"] and job["exported_model"] == "model.pt2"
    assert job["input"]["wait_share"] is not None  # the data-bound verdict of the job
    assert summary["input"]["examples_per_s"] > 0 and summary["input"]["vs_model_step"] > 0


def test_without_a_device_it_says_so_and_exits_infra():
    env = {**os.environ, "DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_training.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert "no CUDA device with bf16 support" in proc.stderr
