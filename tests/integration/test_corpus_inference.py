"""Corpus inference with the real models and processes, on a corpus of 630 pins and freshly registered models
(``corpus_inference_world``):

- a local array job of three scoring processes, one SIGKILLed half-way through its shard: the job fails as INFRA
  once the others have ended, only that shard is missing, and the next job scores it alone; every pin is
  published exactly once;
- the Ray engine (a local cluster started here: token auth without writing under ``~``, Ray's temporary folder
  outside the data, an actor pool that leaves a CPU share to the readers) writes the same parts, row for row, as
  the scoring processes; so it does for a model exported sharded (a pin-rows plan: a Ray task per shard, each
  opening only its range's file of the pin table).

The same two through Airflow (``pin_corpus_inference`` with ``dag.test()`` in a subprocess; this file is also its
driver: ``python test_corpus_inference.py run CONF``): the task deferred, the retry after the kill, the Ray job
started by the stage. Those take minutes on a small machine: marked ``slow``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from corpus_inference_world import DAYS, World, copy_root, shared_world
from process_guard import no_orphans  # noqa: F401

from core.failures import FailureClass, UserError

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]

pytestmark = pytest.mark.integration


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def _run(conf: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["pin_corpus_inference"]
    for task in dag.tasks:
        task.retry_delay = timedelta(seconds=0.5)  # type: ignore[attr-defined]
        task.retry_exponential_backoff = 0  # type: ignore[attr-defined]
    dr = dag.test(run_conf=conf)  # type: ignore[attr-defined]
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    return {
        "state": str(dr.state),
        "tries": {task_id: ti.try_number for task_id, ti in tis.items()},
        "states": {task_id: str(ti.state) for task_id, ti in tis.items()},
        "plan": tis["plan_shards"].xcom_pull(task_ids="plan_shards"),
        "score": tis["score_shards"].xcom_pull(task_ids="score_shards"),
        "publish": tis["publish"].xcom_pull(task_ids="publish"),
    }


# -- the tests -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return shared_world(tmp_path_factory)


def stage_env(world: World, tmp_path: Path, **inference: Any) -> dict[str, str]:
    """The platform of this test: its own home and storage root, the world's MLflow, quick polls."""
    root = copy_root(world, tmp_path / "storage")
    env = {
        **os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "user-home"),
        "PINFLOW_HOME": str(tmp_path / "home"), "PINFLOW_STORAGE_ROOT": str(root),
        "PINFLOW_MLFLOW__TRACKING_URI": world.tracking_uri, "PINFLOW_INFERENCE__POLL_SECONDS": "0.3",
    }
    env.update({f"PINFLOW_INFERENCE__{key.upper()}": str(value) for key, value in inference.items()})
    return env


def start(conf: dict[str, Any], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(HERE), "run", json.dumps(conf)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO)


def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"the DAG run printed no summary:\n{log.read_text(errors='replace')[-6000:]}"
    return dict(json.loads(lines[-1][len("SUMMARY "):]))


def scorer_pid(index: int, timeout: float = 120) -> int:
    """The pid of the scoring process of array child ``index``, once it scores (its node log says so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"training.inference" in cmdline and f"PINFLOW_ARRAY_INDEX={index}".encode() in environ \
                    and not any(arg.endswith(b"local_node.py") for arg in cmdline):
                return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"no scoring process of array child {index} within {timeout}s")


def published(root: Path, model: str) -> tuple[dict[str, Any], list[Any]]:
    import pyarrow.parquet as pq

    out = root / "inference" / model / "1" / f"ds={DAYS[-1]}"
    manifest = json.loads((out / "_MANIFEST.json").read_text())
    return manifest, [pq.read_table(out / part["file"]) for part in manifest["parts"]]


def wait_until_ended(backend: Any, job_id: str, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = backend.status(job_id)
        if status.state.terminal:
            return status
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still running after {timeout}s:\n{backend.logs(job_id)}")


def test_a_killed_shard_fails_the_array_job_as_infra_and_the_next_job_scores_only_it(
    world, tmp_path, monkeypatch, no_orphans  # noqa: F811
):
    import dataclasses

    from core.config import PlatformConfig
    from operators.backends import JobState
    from operators.backends.local import LocalBackend
    from operators.inference import scoring_job_spec
    from training import inference

    monkeypatch.setenv("HOME", str(tmp_path / "user-home"))  # the children's (the backend passes the environment on)
    root = copy_root(world, tmp_path / "storage")
    plan = inference.make_plan(model_uri="models:/pin_content/1", tracking_uri=world.tracking_uri, root=str(root),
                               ds=DAYS[-1], out_dir=tmp_path / "out", num_shards=2, batch_size=20)
    summary = {"plan_file": inference.write_plan(plan)}
    cfg = PlatformConfig(storage_root=str(root), inference={"parallelism": 2})
    backend = LocalBackend(tmp_path / "home")
    spec = scoring_job_spec(summary, [0, 1], name="score-try1", engine="processes", backend="local", cfg=cfg)
    # Batches of 20 pins, each followed by a 0.2 s sleep (the fault injection): a shard scores for about 3 s.
    spec = dataclasses.replace(spec, env={**spec.env, inference.DEBUG_SLEEP_VARIABLE: "0.2"})
    job = backend.submit(spec)
    victim = scorer_pid(1)
    node_log = tmp_path / "home" / "jobs" / job / "node-1.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not node_log.exists()
                                           or "scoring shard 1 of plan" not in node_log.read_text(errors="replace")):
        time.sleep(0.05)
    time.sleep(0.5)  # a few batches in
    os.kill(victim, signal.SIGKILL)
    status = wait_until_ended(backend, job)
    assert status.state is JobState.FAILED and status.failure_class is FailureClass.INFRA, status
    assert "child-1 was killed by SIGKILL" in status.reason and "1 of 2 array children failed" in status.reason
    assert inference.missing_shards(plan) == [1]  # the killed shard left nothing behind; the others are kept

    retry = scoring_job_spec(summary, inference.missing_shards(plan), name="score-try2", engine="processes",
                             backend="local", cfg=cfg)
    assert retry.array_size == 1 and retry.command[-3] == "1"
    assert wait_until_ended(backend, backend.submit(retry)).state is JobState.SUCCEEDED
    manifest = inference.publish_plan(plan)
    ids = pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).column("pin_id").to_pylist()
    assert sorted(ids) == world.pin_ids and manifest["rows"] == manifest["pins"] == 630
    assert manifest["throughput"]["parts"] == 2  # each part timed its own scoring


@pytest.fixture
def ray_temp() -> Iterator[Path]:
    """A short temporary folder for Ray: its socket paths must fit in 107 bytes, which pytest's own temporary
    folders (under a pytest-xdist worker's) do not leave room for."""
    import shutil
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="pf-ray-"))
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


RAY_TOKEN = secrets.token_hex(32)


@pytest.fixture
def local_ray(
    ray_temp: Path, monkeypatch: pytest.MonkeyPatch, no_orphans: None  # noqa: F811
) -> Iterator[Path]:
    """A local Ray cluster of 2 CPUs in this process (``training.ray_inference.start_ray``), stopped after the test
    and before ``no_orphans`` looks for leftovers; its environment (token auth with a token of this test process,
    a home of its own) restored. One token for every cluster of the process: Ray's client keeps the first token
    it read, and a later cluster started with another refuses it."""
    from training.ray_inference import start_ray

    temp = ray_temp
    monkeypatch.setenv("HOME", str(temp / "home"))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", RAY_TOKEN)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # Ray's workers import training.*
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import ray

    try:
        assert start_ray(2, str(temp / "t")) is True
        yield temp
    finally:
        ray.shutdown()


def test_the_ray_path_writes_the_parts_of_the_processes_path_row_for_row(world, tmp_path, local_ray):
    import torch

    from training import inference
    from training.ray_inference import score_with_ray

    root = copy_root(world, tmp_path / "storage")

    def plan_for(out: str) -> inference.ScoringPlan:
        return inference.make_plan(model_uri="models:/pin_content/1", tracking_uri=world.tracking_uri, root=str(root),
                                   ds=DAYS[-1], out_dir=tmp_path / out, num_shards=3, batch_size=50)

    ray_plan, plan = plan_for("ray"), plan_for("processes")
    assert ray_plan.plan_id == plan.plan_id
    # One actor of 1 CPU beside readers of 0.5 on 2 CPUs: never every CPU to the pool.
    summary = score_with_ray(ray_plan, [0, 1, 2], actors=1, actor_cpus=1.0, reader_cpus=0.5, threads=1)
    assert summary["rows"] == 630 and summary["actors"] == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scorer = inference.Scorer.load(plan.model_uri, plan.tracking_uri)
        for shard in range(3):
            inference.score_plan_shard(plan, shard, scorer)
    finally:
        torch.set_num_threads(threads)
    for shard in range(3):
        ray_part = pq.read_table(inference.staged_part(ray_plan, shard))
        assert ray_part.equals(pq.read_table(inference.staged_part(plan, shard))), shard
        assert inference.part_record(inference.staged_part(ray_plan, shard))["engine"] == "ray"
    ray_manifest, manifest = inference.publish_plan(ray_plan), inference.publish_plan(plan)
    assert ray_manifest["ids_checksum"] == manifest["ids_checksum"] and ray_manifest["rows"] == 630
    # Ray wrote nothing under the home nor the storage root.
    assert not (local_ray / "home").exists() and not list(root.rglob("session_*"))
    assert any((local_ray / "t").glob("session_*"))


@pytest.mark.slow
def test_the_ray_engine_scores_a_sharded_model_by_pin_rows_each_task_opening_only_its_pin_file(
    world, tmp_path, local_ray
):
    """A model exported sharded by a 2-rank world (two files per table), its pin-rows plan in 2 shards: each Ray
    task opens only its range's file of the pin table, and the parts are the processes engine's, row for row."""
    pytest.importorskip("torchrec", reason="torchrec is installed by make install (pip install --no-deps torchrec)")
    import torch
    from corpus_inference_world import register_sharded
    from mlflow import MlflowClient

    from training import inference
    from training.ray_inference import score_with_ray

    uri = register_sharded(world.root, tmp_path / "scratch", world.tracking_uri)
    version = MlflowClient(tracking_uri=world.tracking_uri).get_model_version("pin_ranker_sharded", uri.split("/")[-1])
    rows = int(version.tags[inference.SHARDED_ROWS_TAG])
    assert rows == 101  # the world's pin_buckets: files of rows [0, 51) and [51, 101)
    root = copy_root(world, tmp_path / "storage")

    def plan_for(out: str) -> inference.ScoringPlan:
        plan = inference.make_plan(model_uri=uri, tracking_uri=world.tracking_uri, root=str(root), ds=DAYS[-1],
                                   out_dir=tmp_path / out, num_shards=2, batch_size=50, table_rows=rows)
        inference.write_plan(plan)
        return plan

    ray_plan, plan = plan_for("ray"), plan_for("processes")
    assert ray_plan.sharding == inference.PIN_ROWS and ray_plan.plan_id == plan.plan_id
    with pytest.raises(UserError, match="a scoring task of 3 CPU does not fit the cluster's 2 CPUs"):
        score_with_ray(ray_plan, [0, 1], actor_cpus=3.0)  # it would wait forever
    summary = score_with_ray(ray_plan, [0, 1], actor_cpus=1.0, threads=1)
    assert summary["rows"] == 630 and summary["tasks"] == 2
    for part, first in zip(summary["parts"], (0, 51), strict=True):
        pin_files = [f for f in part["model_files"] if "/pin_emb/" in f]
        assert len(pin_files) == 1 and f"rows-{first:012d}" in pin_files[0], part["model_files"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for shard in range(2):  # a scorer per shard, as each scoring process of the array job loads its own
            inference.score_plan_shard(plan, shard, inference.Scorer.load(plan.model_uri, plan.tracking_uri))
    finally:
        torch.set_num_threads(threads)
    for shard in range(2):
        ray_part = pq.read_table(inference.staged_part(ray_plan, shard))
        assert ray_part.num_rows > 0 and ray_part.equals(pq.read_table(inference.staged_part(plan, shard))), shard
        record = inference.part_record(inference.staged_part(ray_plan, shard))
        assert record["engine"] == "ray" and record["peak_rss_mib"] > 0 and record["model_files_opened"] >= 1
    ray_manifest, manifest = inference.publish_plan(ray_plan), inference.publish_plan(plan)
    assert ray_manifest["ids_checksum"] == manifest["ids_checksum"] and ray_manifest["rows"] == 630
    assert ray_manifest["engines"] == ["ray"] and ray_manifest["sharding"] == inference.PIN_ROWS


@pytest.mark.slow
@pytest.mark.extended
def test_a_shard_killed_half_way_is_infra_and_the_retry_scores_only_that_shard(world, tmp_path, airflow_db, no_orphans):  # noqa: F811
    # 630 pins, shards of at least 200 and 3 processes at once: three shards; batches of 20 pins, each followed by
    # a 0.2 s sleep (the test's fault injection), so that a shard scores for about 2 s.
    env = stage_env(world, tmp_path, min_pins_per_shard=200, parallelism=3, batch_size=20)
    env["PINFLOW_INFERENCE_DEBUG_BATCH_SLEEP_S"] = "0.2"
    log = tmp_path / "dag.log"
    proc = start({"model": "pin_content", "model_version": "1"}, env, log)
    victim = scorer_pid(1)
    node_log = next((tmp_path / "home" / "jobs").glob("*/node-1.log"))
    deadline = time.monotonic() + 60
    while "scoring shard 1 of plan" not in node_log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # a few batches in
    os.kill(victim, signal.SIGKILL)
    summary = finish(proc, log)

    assert summary["state"] == "success", summary
    assert summary["tries"]["score_shards"] == 2 and summary["tries"]["publish"] == 1
    plan = summary["plan"]
    assert plan["shards"] == 3 and "3 at once" in plan["sizing"]
    jobs = sorted((tmp_path / "home" / "jobs").iterdir(), key=lambda p: p.stat().st_mtime)
    first, retry = (json.loads((job / "request.json").read_text()) for job in jobs)
    assert first["array"]["size"] == 3 and [n["argv"][-3] for n in first["nodes"]] == ["0-2"] * 3
    assert json.loads((jobs[0] / "node-1.end.json").read_text())["signal"] == "SIGKILL"
    assert [(jobs[0] / f"node-{i}.exit").read_text().strip() for i in range(3)] == ["0", "-9", "0"]
    # The retry's job: shard 1 alone.
    assert retry["array"]["size"] == 1 and retry["nodes"][0]["argv"][-3] == "1"
    assert summary["score"]["scored_shards"] == 1
    dag_log = log.read_text(errors="replace")
    assert "child-1 was killed by SIGKILL" in dag_log and "INFRA" in dag_log

    manifest, parts = published(tmp_path / "storage", "pin_content")
    ids = [pin for part in parts for pin in part.column("pin_id").to_pylist()]
    assert sorted(ids) == world.pin_ids and manifest["rows"] == manifest["pins"] == 630
    assert summary["publish"]["plan_id"] == plan["plan_id"] == manifest["plan_id"]
    assert manifest["throughput"]["parts"] == 3  # each part timed its own scoring
    throughput = json.loads((tmp_path / "storage" / "inference" / "pin_content" / "_THROUGHPUT.json").read_text())
    assert throughput["runs"][-1]["plan_id"] == plan["plan_id"]


@pytest.mark.slow
@pytest.mark.extended
def test_the_ray_engine_starts_its_own_cluster_and_publishes_the_rows_of_the_processes_engine(
    world, tmp_path, tmp_path_factory, airflow_db, no_orphans, ray_temp  # noqa: F811
):
    from training import inference

    shared_world(tmp_path_factory, ("pin_ranker",))
    ray_tmp = ray_temp
    env = stage_env(world, tmp_path, batch_size=50, ray_cpus=2, ray_actor_cpus=0.75, ray_temp_dir=ray_tmp)
    env.pop("RAY_AUTH_MODE", None)  # the job's default: token auth, with its own token in the environment
    log = tmp_path / "dag.log"
    summary = finish(start({"model": "pin_ranker", "model_version": "1", "shards": 3, "engine": "ray"}, env, log), log)
    assert summary["state"] == "success", summary
    assert summary["tries"]["score_shards"] == 1 and summary["plan"]["engine"] == "ray"
    manifest, parts = published(tmp_path / "storage", "pin_ranker")
    assert manifest["engines"] == ["ray"] and manifest["rows"] == 630

    # The processes engine's parts of the same plan (scored here, in this process): the same rows, in order.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = inference.make_plan(model_uri="models:/pin_ranker/1", tracking_uri=world.tracking_uri,
                                   root=str(tmp_path / "storage"), ds=DAYS[-1], out_dir=tmp_path / "processes",
                                   num_shards=3, batch_size=50)
        assert plan.plan_id == manifest["plan_id"]
        scorer = inference.Scorer.load(plan.model_uri, plan.tracking_uri)
        for shard in range(3):
            inference.score_plan_shard(plan, shard, scorer)
    finally:
        torch.set_num_threads(threads)
    assert inference.publish_plan(plan)["ids_checksum"] == manifest["ids_checksum"]
    for shard, part in enumerate(parts):
        import pyarrow.parquet as pq

        assert pq.read_table(tmp_path / "processes" / inference.part_name(shard)).equals(part), shard
    # Ray wrote nothing under the user's home (its auth token stayed in the job's environment) nor the storage root.
    assert not (tmp_path / "user-home" / ".ray").exists()
    assert any(ray_tmp.glob("session_*")) and not list((tmp_path / "storage").rglob("session_*"))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        print("SUMMARY " + json.dumps(_run(json.loads(sys.argv[2])), default=str), flush=True)
