"""docker-compose.yaml: valid for Compose both ways, no default secret, and shaped like Airflow's own compose file.

Two validators, because each catches what the other misses: Debian's ``docker-compose`` 1.x (``config -q``
interpolates ``.env`` and resolves references: a missing secret, a dependency on an undefined service, an undefined
volume) and the compose-spec JSON schema (the current specification that ``docker compose`` v2 implements: a
long-syntax volume of an unknown type passes 1.x). Neither needs a Docker engine.
"""

from __future__ import annotations

import copy
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"
TEMPLATE = REPO / ".env.example"
SCHEMA = Path(__file__).parent / "schemas" / "compose-spec.json"
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_docker_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="Debian's docker-compose 1.x is not installed: `apt-get install docker-compose` (make test does it as root)",
)

AIRFLOW_SERVICES = [
    "airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-worker",
    "airflow-triggerer", "flower", "airflow-cli",
]
LONG_RUNNING = [
    "postgres", "redis", "minio", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-worker",
    "airflow-triggerer", "flower", "mlflow",
]
REQUIRED = re.compile(r"\$\{(?P<name>[A-Z][A-Z0-9_]*):\?(?P<message>[^}]+)\}")
REFERENCE = re.compile(r"(?<!\$)\$\{(?P<name>[A-Z][A-Z0-9_]*)(?P<rest>[^}]*)\}")


def _make_secrets() -> Any:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_secrets
    finally:
        sys.path.pop(0)
    return make_secrets


def secret_names() -> list[str]:
    """The variables of .env.example that `make secrets` generates."""
    rendered = _make_secrets().render(TEMPLATE.read_text())
    template = dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", TEMPLATE.read_text(), re.M))
    values = dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", rendered, re.M))
    return sorted(name for name, value in values.items() if value != template[name])


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    """A .env as `make secrets` writes it."""
    target = tmp_path / ".env"
    assert _make_secrets().main(["--output", str(target)]) == 0
    return target


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # anchors and merge keys resolved


def docker_compose_config(path: Path, env_file: Path) -> subprocess.CompletedProcess[str]:
    assert DOCKER_COMPOSE is not None
    return subprocess.run(
        [DOCKER_COMPOSE, "--project-directory", str(REPO), "-f", str(path), "--env-file", str(env_file),
         "config", "-q"],
        capture_output=True, text=True, timeout=120,
    )


def schema_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(SCHEMA), str(path)],
        capture_output=True, text=True, timeout=120,
    )


# --- both validators ---------------------------------------------------------------------------------------


@needs_docker_compose
def test_docker_compose_1x_accepts_the_file_with_the_secrets_of_make_secrets(env_file: Path):
    proc = docker_compose_config(COMPOSE, env_file)
    assert proc.returncode == 0, proc.stderr


def test_the_compose_spec_schema_accepts_the_file():
    proc = schema_check(COMPOSE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_docker_compose
@pytest.mark.parametrize("missing", ["AIRFLOW_FERNET_KEY", "POSTGRES_PASSWORD", "MLFLOW_ADMIN_PASSWORD"])
def test_a_missing_secret_stops_compose_naming_it(env_file: Path, tmp_path: Path, missing: str):
    without = tmp_path / "without.env"
    without.write_text("".join(line for line in env_file.read_text().splitlines(keepends=True)
                               if not line.startswith(f"{missing}=")))
    proc = docker_compose_config(COMPOSE, without)
    assert proc.returncode != 0
    assert f"{missing} is not set, run make secrets to write .env" in proc.stderr


@needs_docker_compose
def test_each_validator_catches_what_the_other_misses(env_file: Path, tmp_path: Path):
    def mutated(change: Any) -> Path:
        data = copy.deepcopy(compose())
        change(data)
        path = tmp_path / "docker-compose.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    only_1x = [
        lambda d: d["services"]["airflow-worker"]["depends_on"].update({"nope": {"condition": "service_healthy"}}),
        lambda d: d["services"]["mlflow"].update({"volumes": ["undeclared:/x"]}),
        lambda d: d["services"]["airflow-triggerer"].update({"pid": "service:nope"}),
    ]
    for change in only_1x:
        path = mutated(change)
        assert docker_compose_config(path, env_file).returncode != 0
        assert schema_check(path).returncode == 0
    # A long-syntax volume of an unknown type: docker compose v2 refuses it, 1.x does not look.
    path = mutated(lambda d: d["services"]["minio"].update(
        {"volumes": [{"type": "bogus", "source": "minio-data", "target": "/data"}]}))
    assert docker_compose_config(path, env_file).returncode == 0
    assert "is not one of ['bind', 'volume'" in schema_check(path).stdout


# --- no default secret ---------------------------------------------------------------------------------------


def test_every_secret_is_required_from_env_and_has_no_default():
    text = COMPOSE.read_text()
    secrets = secret_names()
    assert {"AIRFLOW_FERNET_KEY", "AIRFLOW_JWT_SECRET", "POSTGRES_PASSWORD", "MLFLOW_ADMIN_PASSWORD"} <= set(secrets)
    for match in REFERENCE.finditer(text):
        name, rest = match["name"], match["rest"]
        if name in secrets:
            assert rest == f":?{name} is not set, run make secrets to write .env", match.group(0)
    assert set(secrets) <= {m["name"] for m in REQUIRED.finditer(text)}, "a secret of .env.example is never used"
    # Every variable the file reads is documented in .env.example.
    documented = set(re.findall(r"^([A-Z][A-Z0-9_]*)=", TEMPLATE.read_text(), re.M))
    assert {m["name"] for m in REFERENCE.finditer(text)} <= documented


def _values(node: Any) -> list[tuple[str, str]]:
    """(key, string value) of every mapping entry in the file."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str):
                found.append((str(key), value))
            found += _values(value)
    elif isinstance(node, list):
        for item in node:
            found += _values(item)
    return found


def test_no_literal_credential_anywhere():
    for key, value in _values(compose()):
        if re.search(r"(PASSWORD|SECRET|FERNET|_KEY)$", key) and not key.endswith("_KEY_ID"):
            assert REQUIRED.fullmatch(value), f"{key}: {value!r} is not ${{VAR:?...}}"
        for credentials in re.findall(r"://([^/@\s]*)@", value):  # user:password@ in a URL
            password = credentials.split(":", 1)[1] if ":" in credentials else ""
            assert REQUIRED.fullmatch(password), f"{key}: the password in {value!r} is not ${{VAR:?...}}"
        if key == "AIRFLOW__CELERY__FLOWER_BASIC_AUTH":
            assert REQUIRED.fullmatch(value.split(":", 1)[1]), value
    text = COMPOSE.read_text()
    assert "airflow:airflow@" not in text and "change-me" not in text.lower()


def test_one_fernet_key_jwt_secret_and_api_secret_for_every_airflow_container():
    services = compose()["services"]
    for setting in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY",
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        values = {services[name]["environment"][setting] for name in AIRFLOW_SERVICES}
        assert len(values) == 1, (setting, values)
    assert services["airflow-apiserver"]["environment"]["AIRFLOW__CORE__FERNET_KEY"].startswith("${AIRFLOW_FERNET_KEY:?")


# --- shaped like Airflow's compose file ----------------------------------------------------------------------


def test_health_checks_restart_policies_and_start_order():
    services = compose()["services"]
    assert set(LONG_RUNNING) | {"airflow-init", "airflow-cli"} == set(services)
    for name in LONG_RUNNING:
        assert services[name]["healthcheck"]["test"], name
        assert services[name]["restart"] == "always", name
    assert "restart" not in services["airflow-init"]
    for name, service in services.items():
        for needed, how in (service.get("depends_on") or {}).items():
            assert needed in services, (name, needed)
            assert how["condition"] in ("service_healthy", "service_completed_successfully", "service_started"), name
    for name in AIRFLOW_SERVICES[1:] + ["mlflow"]:
        assert services[name]["depends_on"]["airflow-init"] == {"condition": "service_completed_successfully"}
    for name in AIRFLOW_SERVICES:
        for store in ("postgres", "minio"):
            assert services[name]["depends_on"][store] == {"condition": "service_healthy"}, (name, store)
    # Task processes report to the execution API: the worker starts once the API server is healthy.
    assert services["airflow-worker"]["depends_on"]["airflow-apiserver"] == {"condition": "service_healthy"}
    assert services["flower"]["profiles"] == ["flower"]
    env = services["airflow-worker"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
    assert float(env["AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT"]) >= 30


def test_mlflow_authenticates_keeps_runs_in_postgres_and_artifacts_on_s3():
    mlflow = compose()["services"]["mlflow"]
    command = mlflow["command"]
    assert "--app-name=basic-auth" in command
    assert any(arg.startswith("--artifacts-destination=s3://") for arg in command)
    assert mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://mlflow:${MLFLOW_DB_PASSWORD:?")
    assert REQUIRED.fullmatch(mlflow["environment"]["MLFLOW_AUTH_ADMIN_PASSWORD"])
    ini = (REPO / mlflow["environment"]["MLFLOW_AUTH_CONFIG_PATH"].removeprefix("/opt/pinflow/src/")).read_text()
    assert "admin_password" not in ini.replace("# ", "")  # the password comes from .env only
    airflow = compose()["services"]["airflow-worker"]["environment"]
    assert airflow["PINFLOW_MLFLOW__TRACKING_URI"] == "http://mlflow:5000"
    assert airflow["MLFLOW_TRACKING_PASSWORD"] == mlflow["environment"]["MLFLOW_AUTH_ADMIN_PASSWORD"]
    assert airflow["PINFLOW_STORAGE_ROOT"].startswith("s3://")


def test_published_ports_bind_to_the_configured_address_only():
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("${PINFLOW_BIND_ADDRESS:-127.0.0.1}:"), (name, port)


# --- make secrets -----------------------------------------------------------------------------------------------


def test_make_secrets_generates_every_secret_once_and_keeps_an_existing_env(env_file: Path):
    from cryptography.fernet import Fernet

    values = dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", env_file.read_text(), re.M))
    secrets = secret_names()
    assert all(values[name] for name in secrets)
    assert len({values[name] for name in secrets}) == len(secrets)  # no value shared
    Fernet(values["AIRFLOW_FERNET_KEY"].encode())  # a valid Fernet key
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    before = env_file.read_text()
    assert _make_secrets().main(["--output", str(env_file)]) == 0
    assert env_file.read_text() == before  # kept: its Fernet key decrypts what Airflow stored
    assert _make_secrets().main(["--output", str(env_file), "--force"]) == 0
    assert env_file.read_text() != before
