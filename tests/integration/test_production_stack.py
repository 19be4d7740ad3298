"""The production topology of docker-compose.yaml, run natively, driven only through the REST API.

What the compose file starts in containers runs here as processes of this test, against the services of this
machine, each fresh for the run and removed afterwards:

- PostgreSQL: a new database for Airflow's metadata, and one for MLflow owned by its own role (created by
  ``scripts/compose_init.py``, the compose file's init step);
- Redis: the Celery broker, on an empty database index (flushed afterwards);
- a moto S3 server: the storage root ``s3://<bucket>/storage`` and MLflow's artifacts ``s3://<bucket>/mlflow``;
- ``mlflow server --app-name basic-auth`` (authentication on, runs in PostgreSQL, artifacts proxied to S3);
- Airflow with the CeleryExecutor: ``airflow api-server``, ``scheduler``, ``dag-processor``, ``triggerer`` and one
  ``airflow celery worker``, one Fernet key and JWT secret for all, the admin's password from the init step.

Then, as an external client would, with ``apache-airflow-client`` only: unpause ``pin_daily_features`` and create a
backfill over the three days of a synthetic world (with ``ds`` filled in the form, as the UI's Backfill dialog
may send it: each run must still build its own day), trigger ``pin_ranker_training`` on the first two days
(evaluated on the third), then ``pin_corpus_inference`` with the trained version. The results must equal those of
the embedded default, the same stages run in-process on a local root: every feature table, the training metrics
and every corpus score.

Small by design (a world of 40 users and 60 pins, two-day windows, one epoch, one training process); it prints the
time of each phase (``pytest -s``). Marked ``slow``: 3 min 40 s on two cores (218 s measured by the fixture).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import aws_environment, free_port, s3_bucket

from core import contracts, storage
from core.config import ValidationConfig
from features import build
from features.synthetic import WorldConfig, generate_world
from features.validate import validate_partition

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import compose_init  # noqa: E402  (scripts/ is not a package)

PG_HOST, PG_PORT, PG_ADMIN = "127.0.0.1", 5432, "postgres"
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379

WORLD = WorldConfig(start="2026-11-01", days=3, users=40, pins=60, seed=11, active_rate=0.9)
DAYS = WORLD.day_list
FEATURES = {"window_days": 2, "sequence_length": 4}
TRAIN_DAYS = 2
SHARDS = 2
# The platform configuration of every Airflow process (and so of the jobs they start): a small, fast chain.
PLATFORM = {
    **{f"PINFLOW_FEATURES__{k.upper()}": str(v) for k, v in FEATURES.items()},
    "PINFLOW_TRAINING__EPOCHS": "1",
    "PINFLOW_TRAINING__BATCH_SIZE": "64",
    "PINFLOW_TRAINING__PROCS_PER_NODE": "1",
    "PINFLOW_TRAINING__POLL_SECONDS": "2",
    "PINFLOW_INFERENCE__SHARDS": str(SHARDS),
    "PINFLOW_VALIDATION__SENSOR_POKE_SECONDS": "2",
}
RUN_TIMEOUT_S = 600


# --- the machine's services: a fresh database, an empty Redis index -------------------------------------------


def _postgres() -> Any:
    import psycopg2

    try:
        connection = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_ADMIN, dbname="postgres", connect_timeout=5)
    except psycopg2.OperationalError as error:
        pytest.skip(f"PostgreSQL is not reachable at {PG_HOST}:{PG_PORT} as {PG_ADMIN} (trust auth): {error}")
    connection.autocommit = True
    return connection


@pytest.fixture(scope="module")
def databases() -> Iterator[dict[str, str]]:
    """A fresh Airflow metadata database, and MLflow's database and role as compose_init creates them."""
    name = f"pinflow_test_{secrets.token_hex(4)}"
    admin = _postgres()
    with admin.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    airflow_url = f"postgresql+psycopg2://{PG_ADMIN}@{PG_HOST}:{PG_PORT}/{name}"
    compose_init.ensure_database(airflow_url, f"{name}_mlflow", f"{name}_mlflow", secrets.token_urlsafe(16))
    try:
        yield {
            "airflow": airflow_url,
            "celery_results": f"db+postgresql+psycopg2://{PG_ADMIN}@{PG_HOST}:{PG_PORT}/{name}",
            "mlflow": f"postgresql+psycopg2://{name}_mlflow@{PG_HOST}:{PG_PORT}/{name}_mlflow",
        }
    finally:
        with admin.cursor() as cursor:
            for database in (name, f"{name}_mlflow"):
                cursor.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            cursor.execute(f'DROP ROLE IF EXISTS "{name}_mlflow"')
        admin.close()


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    """The URL of an empty database index of the local Redis; flushed afterwards."""
    import redis

    indexes = list(range(1, 16))
    random.shuffle(indexes)
    for index in indexes:
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=index, socket_connect_timeout=5)
        try:
            if client.dbsize() == 0:
                break
        except redis.ConnectionError as error:
            pytest.skip(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT}: {error}")
    else:
        pytest.skip("no empty database index in the local Redis")
    try:
        yield f"redis://{REDIS_HOST}:{REDIS_PORT}/{index}"
    finally:
        client.flushdb()
        client.close()


# --- the stack --------------------------------------------------------------------------------------------------


class Stack:
    """The services of docker-compose.yaml as subprocesses of this test (each in its own session)."""

    def __init__(self, home: Path, databases: dict[str, str], broker: str, moto: str, bucket: str) -> None:
        self.home = home
        self.url = f"http://127.0.0.1:{free_port()}"
        self.mlflow_url = f"http://127.0.0.1:{free_port()}"
        self.storage_root = f"s3://{bucket}/storage"
        self.admin_password = secrets.token_urlsafe(16)
        self.mlflow_password = secrets.token_urlsafe(16)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        airflow_home = home / "airflow"
        airflow_home.mkdir(parents=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "PINFLOW_", "AWS_", "MLFLOW_"))}
        aws = aws_environment(moto, home)
        self.mlflow_env = {
            **base, **aws,
            "MLFLOW_BACKEND_STORE_URI": databases["mlflow"],
            "MLFLOW_AUTH_CONFIG_PATH": str(self._auth_config(home)),
            "MLFLOW_AUTH_ADMIN_USERNAME": "admin",
            "MLFLOW_AUTH_ADMIN_PASSWORD": self.mlflow_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),
            "MLFLOW_SERVER_ALLOWED_HOSTS": self.mlflow_url.removeprefix("http://"),
            "MLFLOW_S3_ENDPOINT_URL": moto,
            # Natively, the queue folder of MLflow's server-side jobs (unused here) would outlive the test in /dev/shm
            # (the compose file's container has a /dev/shm of its own).
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        passwords = airflow_home / "auth" / "passwords.json"
        compose_init.write_passwords_file(passwords, {"admin": self.admin_password})
        self.env = {
            **base, **aws, **PLATFORM,
            "PINFLOW_HOME": str(home / "pinflow"),
            "PINFLOW_STORAGE_ROOT": self.storage_root,
            "PINFLOW_MLFLOW__TRACKING_URI": self.mlflow_url,
            "PINFLOW_MLFLOW__ARTIFACT_ROOT": "",  # the tracking server's: proxied to s3://<bucket>/mlflow
            "PINFLOW_MLFLOW__UI_URL": self.mlflow_url,
            "MLFLOW_TRACKING_USERNAME": "admin",
            "MLFLOW_TRACKING_PASSWORD": self.mlflow_password,
            "AIRFLOW_HOME": str(airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__FERNET_KEY": compose_secret("fernet"),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": databases["airflow"],
            "AIRFLOW__CELERY__BROKER_URL": broker,
            "AIRFLOW__CELERY__RESULT_BACKEND": databases["celery_results"],
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": self.url.rsplit(":", 1)[1],
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            # Runs are created through the API only: without this, unpausing the daily DAG would also create
            # the run of the newest interval (today's world has no data for it).
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "GX_ANALYTICS_ENABLED": "False",
            "OMP_NUM_THREADS": "1",
        }

    @staticmethod
    def _auth_config(home: Path) -> Path:
        """config/mlflow_basic_auth.ini with the user store in this test's folder."""
        text = (REPO / "config" / "mlflow_basic_auth.ini").read_text()
        path = home / "mlflow_basic_auth.ini"
        path.write_text(text.replace("sqlite:////opt/mlflow/auth/basic_auth.db", f"sqlite:///{home / 'basic_auth.db'}"))
        return path

    def start(self, name: str, command: list[str], env: dict[str, str]) -> None:
        log = (self.home / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.home
        )

    def airflow(self, name: str, *args: str) -> None:
        self.start(name, [sys.executable, "-m", "airflow", *args], self.env)

    def stop(self) -> None:
        """SIGTERM every service's process group, then SIGKILL what is left."""
        for proc in self.processes.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for proc in self.processes.values():  # task processes the services left behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        import psutil

        for process in psutil.process_iter(["cmdline"]):  # jobs (own sessions) of a run cut short: their files are here
            try:
                if str(self.home) in " ".join(process.info["cmdline"] or []):
                    process.kill()
            except psutil.Error:
                pass

    def token(self) -> str:
        request = urllib.request.Request(
            f"{self.url}/auth/token", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"username": "admin", "password": self.admin_password}).encode(),
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return str(json.loads(response.read())["access_token"])

    def answers(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def diagnostics(self) -> str:
        parts = [f"--- {name}.log ---\n{(self.home / f'{name}.log').read_text(errors='replace')[-2500:]}"
                 for name in self.processes]
        for log in sorted((self.home / "airflow" / "logs").rglob("*.log"), key=lambda p: p.stat().st_mtime)[-3:]:
            parts.append(f"--- {log} ---\n{log.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def wait(self, what: str, done: Callable[[], bool], timeout: float, every: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{self.diagnostics()}"
            if done():
                return
            time.sleep(every)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")


def compose_secret(kind: str) -> str:
    """A secret as `make secrets` generates it."""
    import make_secrets

    return str(make_secrets.GENERATORS[kind]())


# --- the chain through the REST API ---------------------------------------------------------------------------


class Api:
    """The REST API through apache-airflow-client, as the admin user."""

    def __init__(self, stack: Stack) -> None:
        from airflow_client import client

        self.client = client
        self.stack = stack
        configuration = client.Configuration(host=stack.url)
        configuration.access_token = stack.token()
        self.api = client.ApiClient(configuration)
        self.dags = client.DAGApi(self.api)
        self.runs = client.DagRunApi(self.api)
        self.backfills = client.BackfillApi(self.api)
        self.task_instances = client.TaskInstanceApi(self.api)
        self.xcoms = client.XComApi(self.api)

    def dag_ready(self, dag_id: str) -> bool:
        try:
            self.dags.get_dag(dag_id)
            return True
        except self.client.ApiException as error:
            if error.status == 404:
                return False
            raise

    def unpause(self, dag_id: str) -> None:
        assert self.dags.patch_dag(dag_id, self.client.DAGPatchBody(is_paused=False)).is_paused is False

    def finished(self, dag_id: str, count: int) -> bool:
        runs = self.runs.get_dag_runs(dag_id).dag_runs
        return len(runs) == count and all(run.state in ("success", "failed") for run in runs)

    def trigger(self, dag_id: str, run_id: str, conf: dict[str, Any]) -> None:
        body = self.client.TriggerDAGRunPostBody(dag_run_id=run_id, conf=conf, logical_date=None)
        assert self.runs.trigger_dag_run(dag_id, body).dag_run_id == run_id

    def states(self, dag_id: str) -> dict[str, str]:
        return {run.dag_run_id: str(run.state.value) for run in self.runs.get_dag_runs(dag_id).dag_runs}

    def failed_tasks(self, dag_id: str) -> dict[str, list[str]]:
        failed = {}
        for run_id, state in self.states(dag_id).items():
            if state != "success":
                tis = self.task_instances.get_task_instances(dag_id, run_id).task_instances
                failed[run_id] = [f"{ti.task_id}:{ti.state}" for ti in tis if str(ti.state) != "TaskInstanceState.SUCCESS"]
        return failed

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        entry = self.xcoms.get_xcom_entry(dag_id, task_id, run_id, "return_value").actual_instance
        return json.loads(entry.value) if isinstance(entry.value, str) else entry.value


@dataclasses.dataclass
class Production:
    backfill_runs: list[Any]  # DAGRunResponse of the backfill's runs
    backfill_conf: dict[str, Any]
    states: dict[str, dict[str, str]]
    train_result: dict[str, Any]
    manifest: dict[str, Any]
    run_config: dict[str, Any]  # the training job's RUN.json
    features: dict[tuple[str, str], Any]
    scores: list[Any]
    mlflow_versions: list[Any]
    seconds: dict[str, float]


def wait_for(stack: Stack, api: Api, dag_id: str, count: int) -> None:
    stack.wait(f"{count} run(s) of {dag_id}", lambda: api.finished(dag_id, count), RUN_TIMEOUT_S)
    states = api.states(dag_id)
    assert set(states.values()) == {"success"}, f"{dag_id}: {api.failed_tasks(dag_id)}\n{stack.diagnostics()}"


def run_production(stack: Stack, seconds: dict[str, float]) -> Production:
    t0 = time.monotonic()
    stack.start("mlflow", [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
                           "--host", "127.0.0.1", "--port", stack.mlflow_url.rsplit(":", 1)[1], "--workers", "1",
                           "--serve-artifacts", "--artifacts-destination", stack.storage_root.replace("/storage", "/mlflow")],
                stack.mlflow_env)
    proc = subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=stack.env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seconds["db migrate"] = time.monotonic() - t0
    stack.airflow("api-server", "api-server", "--workers", "1")
    stack.airflow("dag-processor", "dag-processor")
    stack.airflow("scheduler", "scheduler")
    stack.airflow("triggerer", "triggerer")
    stack.wait("the API server", lambda: stack.answers(f"{stack.url}/api/v2/version"), 180)
    # As in the compose file: the worker starts once the API server answers.
    stack.airflow("celery-worker", "celery", "worker")
    stack.wait("the MLflow server", lambda: stack.answers(f"{stack.mlflow_url}/health"), 180)
    api = Api(stack)
    for dag_id in ("pin_daily_features", "pin_ranker_training", "pin_corpus_inference"):
        stack.wait(f"the DAG processor to serialize {dag_id}", lambda d=dag_id: api.dag_ready(d), 300)
    seconds["stack up"] = time.monotonic() - t0

    t0 = time.monotonic()
    api.unpause("pin_daily_features")
    # What the Backfill dialog sends with its form's `ds` filled in: ignored, each run builds its own day.
    conf = {"ds": DAYS[0]}
    backfill = api.backfills.create_backfill(api.client.BackfillPostBody(
        dag_id="pin_daily_features", from_date=f"{DAYS[0]}T00:00:00Z", to_date=f"{DAYS[-1]}T00:00:00Z",
        reprocess_behavior="completed", max_active_runs=len(DAYS), dag_run_conf=conf,
    ))
    wait_for(stack, api, "pin_daily_features", len(DAYS))
    backfill_runs = api.runs.get_dag_runs("pin_daily_features").dag_runs
    seconds["features backfill"] = time.monotonic() - t0

    t0 = time.monotonic()
    api.trigger("pin_ranker_training", f"prod__{DAYS[-1]}", {"end_ds": DAYS[-1], "train_days": TRAIN_DAYS})
    api.unpause("pin_ranker_training")
    wait_for(stack, api, "pin_ranker_training", 1)
    train_result = api.xcom("pin_ranker_training", f"prod__{DAYS[-1]}", "train")
    seconds["training"] = time.monotonic() - t0

    t0 = time.monotonic()
    api.trigger("pin_corpus_inference", f"prod__{DAYS[-1]}",
                {"model_version": str(train_result["model_version"]), "ds": DAYS[-1], "shards": SHARDS})
    api.unpause("pin_corpus_inference")
    wait_for(stack, api, "pin_corpus_inference", 1)
    manifest = api.xcom("pin_corpus_inference", f"prod__{DAYS[-1]}", "publish")
    seconds["inference"] = time.monotonic() - t0

    (run_json,) = (stack.home / "pinflow" / "runs").glob("*/RUN.json")
    out_dir = manifest["manifest"].rsplit("/", 1)[0]
    from mlflow import MlflowClient

    with pytest.MonkeyPatch.context() as patch:  # as the workers do: logged in to the tracking server
        patch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        patch.setenv("MLFLOW_TRACKING_PASSWORD", stack.mlflow_password)
        versions = MlflowClient(stack.mlflow_url, stack.mlflow_url).search_model_versions()
    return Production(
        backfill_runs=backfill_runs,
        backfill_conf=dict(backfill.dag_run_conf or {}),
        states={d: api.states(d) for d in ("pin_daily_features", "pin_ranker_training", "pin_corpus_inference")},
        train_result=train_result,
        manifest=manifest,
        run_config=json.loads(run_json.read_text()),
        features={(d, ds): storage.read_table(stack.storage_root, d, ds)
                  for d in contracts.FEATURE_OUTPUTS for ds in DAYS},
        scores=[storage.read_parquet(storage.join(out_dir, f"part-{s:05d}.parquet")) for s in range(SHARDS)],
        mlflow_versions=versions,
        seconds=seconds,
    )


# --- the embedded default: the same stages in this process on a local root ----------------------------------------


def run_embedded(root: Path, home: Path, run_config: dict[str, Any], model_version: str) -> dict[str, Any]:
    from training import inference

    generate_world(root, WORLD)
    for ds in DAYS:
        for dataset in contracts.RAW_DATASETS:
            report = validate_partition(str(root), dataset, ds, config=ValidationConfig(), data_docs=False,
                                        quarantine=True)
            assert report.success, (dataset, ds)
    for ds in DAYS:
        build.build_day(root, ds, **FEATURES)
    # The production job's own RUN.json, pointed at this root and a local MLflow.
    tracking = f"sqlite:///{home / 'mlflow.db'}"
    job = home / "train"
    # Its pinned inputs are the production root's partitions: this root's are read live.
    config = {**run_config, "inputs": {}, "root": str(root), "output_dir": str(job), "checkpoint_dir": str(home / "checkpoints"),
              "mlflow_tracking_uri": tracking, "mlflow_artifact_location": str(home / "artifacts")}
    job.mkdir(parents=True)
    (job / "RUN.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PINFLOW_", "MLFLOW_"))}
    proc = subprocess.run([sys.executable, "-m", "training.train", "--config", str(job / "RUN.json")],
                          env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((job / "result.json").read_text())
    assert str(result["model_version"]) == model_version == "1"  # a fresh registry on both sides
    out_dir = storage.partition(root, f"{contracts.INFERENCE}/{result['model_name']}/{model_version}", DAYS[-1])
    uri = f"models:/{result['model_name']}/{model_version}"
    for shard in range(SHARDS):
        inference.score_shard(model_uri=uri, tracking_uri=tracking, root=str(root), ds=DAYS[-1], shard=shard,
                              num_shards=SHARDS, out_dir=out_dir)
    inference.publish_manifest(out_dir, SHARDS, uri, DAYS[-1])  # the parts move from their plan's staging folder
    return {
        "result": result,
        "features": {(d, ds): storage.read_table(root, d, ds) for d in contracts.FEATURE_OUTPUTS for ds in DAYS},
        "scores": [storage.read_parquet(storage.join(out_dir, f"part-{s:05d}.parquet")) for s in range(SHARDS)],
        "corpus_pins": storage.read_table(root, contracts.RAW_PINS, DAYS[-1], columns=["pin_id"]).num_rows,
    }


@pytest.fixture(scope="module")
def chains(
    moto_server: str, databases: dict[str, str], broker: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    started = time.monotonic()
    scratch = tmp_path_factory.mktemp("production")
    bucket = f"pinflow-production-{secrets.token_hex(3)}"
    seconds: dict[str, float] = {}
    with s3_bucket(moto_server, scratch, bucket):
        compose_init.ensure_bucket(f"s3://{bucket}/storage")  # the init step: the bucket is there, kept
        generate_world(f"s3://{bucket}/storage", WORLD)
        stack = Stack(scratch / "stack", databases, broker, moto_server, bucket)
        try:
            production = run_production(stack, seconds)
        finally:
            stack.stop()
    t0 = time.monotonic()
    embedded = run_embedded(scratch / "embedded" / "storage", scratch / "embedded",
                            production.run_config, str(production.train_result["model_version"]))
    seconds["embedded reference"] = time.monotonic() - t0
    seconds["total"] = time.monotonic() - started
    print("\nproduction-stack test, seconds per phase: " + json.dumps({k: round(v, 1) for k, v in seconds.items()}))
    yield {"production": production, "embedded": embedded}


def test_the_backfill_built_each_day_through_celery(chains):
    production: Production = chains["production"]
    runs = sorted(production.backfill_runs, key=lambda run: run.logical_date)
    assert [run.logical_date.date().isoformat() for run in runs] == DAYS
    assert {str(run.run_type.value) for run in runs} == {"backfill"}
    assert all(run.conf == {"ds": DAYS[0]} for run in runs)  # the form's ds reached every run: and was ignored
    assert production.backfill_conf == {"ds": DAYS[0]}
    assert all(set(states.values()) == {"success"} for states in production.states.values())


def test_features_equal_the_embedded_default(chains):
    production, embedded = chains["production"], chains["embedded"]
    for key, table in embedded["features"].items():
        assert production.features[key].equals(table), key
    assert embedded["features"][(contracts.EXAMPLES, DAYS[-1])].num_rows > 0


def test_training_and_inference_equal_the_embedded_default(chains):
    production, embedded = chains["production"], chains["embedded"]
    ours, theirs = production.train_result, embedded["result"]
    for key in ("steps", "examples_seen"):
        assert ours[key] == theirs[key], key
    assert ours["metrics"]["auc"] == theirs["metrics"]["auc"]
    for a, b in zip(production.scores, embedded["scores"], strict=True):
        assert a.equals(b)
    assert production.manifest["rows"] == embedded["corpus_pins"] > 0


def test_the_model_is_in_the_authenticated_registry_with_artifacts_on_s3(chains):
    production: Production = chains["production"]
    (version,) = production.mlflow_versions
    assert str(version.version) == str(production.train_result["model_version"])
    assert version.status == "READY"
    assert production.run_config["mlflow_artifact_location"] in ("", None)  # the server's proxied S3 store
