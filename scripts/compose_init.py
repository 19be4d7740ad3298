"""What the production stack needs before its services start: the init service of ``docker-compose.yaml``.

    python scripts/compose_init.py && airflow db migrate && python -m operators.quotas sync-pools   # airflow-init's

Idempotent (every ``docker compose up`` runs it again), each step from the environment of the Airflow services:

1. the bucket of the storage root (``PINFLOW_STORAGE_ROOT=s3://<bucket>/...``) on the S3 store (MinIO in the
   compose file; ``AWS_ENDPOINT_URL_S3``), which also holds MLflow's artifacts;
2. MLflow's role and database, and the job history's database (``PINFLOW_JOB_HISTORY__URL``, owned by its role),
   on the PostgreSQL server of Airflow's metadata database (reached as its owner, from
   ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``), the role's password set from ``MLFLOW_DB_PASSWORD`` on every run, so
   that a password changed in ``.env`` takes effect;
3. the password file of Airflow's simple auth manager (``AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE``,
   mode 0600) with the admin's password from ``AIRFLOW_ADMIN_PASSWORD``, instead of one generated and printed to
   the API server's log.

tests/integration/test_production_stack.py runs the same functions against the local PostgreSQL and a moto S3.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit


def require(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise SystemExit(f"compose init: {name} is not set (run `make secrets` to write .env, then `docker compose up`)")
    return value


def ensure_bucket(storage_root: str) -> str:
    """Create the bucket of an ``s3://bucket/prefix`` storage root if it is not there; its name."""
    import boto3
    from botocore.exceptions import ClientError

    parts = urlsplit(storage_root)
    if parts.scheme != "s3" or not parts.netloc:
        raise SystemExit(f"compose init: PINFLOW_STORAGE_ROOT={storage_root!r} is not an s3://bucket/prefix URL")
    client = boto3.client("s3")
    try:
        client.head_bucket(Bucket=parts.netloc)
    except ClientError:
        client.create_bucket(Bucket=parts.netloc)
    return parts.netloc


def ensure_database(admin_url: str, database: str, role: str, password: str) -> None:
    """A login role with this password owning this database, on the server of ``admin_url`` (a SQLAlchemy URL)."""
    import psycopg2
    from psycopg2 import sql
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    connection = psycopg2.connect(
        host=url.host, port=url.port or 5432, user=url.username, password=url.password, dbname=url.database
    )
    connection.autocommit = True  # CREATE DATABASE cannot run inside a transaction
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            verb = "ALTER" if cursor.fetchone() else "CREATE"
            cursor.execute(sql.SQL(verb + " ROLE {} WITH LOGIN PASSWORD %s").format(sql.Identifier(role)), (password,))
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
            if not cursor.fetchone():
                cursor.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(role))
                )
    finally:
        connection.close()


def write_passwords_file(path: str | os.PathLike[str], passwords: dict[str, str]) -> None:
    """The simple auth manager's password file (``{"user": "password"}``), readable by its owner only."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(json.dumps(passwords) + "\n")
    os.chmod(target, 0o600)


def admin_username(users: str) -> str:
    """The first user of ``[core] simple_auth_manager_users`` (``name:role,...``)."""
    return users.split(",")[0].split(":")[0].strip()


def main() -> int:
    bucket = ensure_bucket(require("PINFLOW_STORAGE_ROOT"))
    print(f"compose init: bucket {bucket} is there")
    ensure_database(require("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"), "mlflow", "mlflow", require("MLFLOW_DB_PASSWORD"))
    print("compose init: MLflow's database and role are there")
    # The platform's own databases on the same server: the job history and the Optuna studies.
    for what, variable in (("the job history", "PINFLOW_JOB_HISTORY__URL"), ("the HPO studies", "PINFLOW_HPO__STORAGE_URL")):
        location = os.environ.get(variable, "")
        if location.startswith("postgresql"):
            from sqlalchemy.engine import make_url

            url = make_url(location)
            ensure_database(require("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"), str(url.database), str(url.username),
                            str(url.password))
            print(f"compose init: the database {url.database} of {what} is there")
    user = admin_username(require("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"))
    write_passwords_file(
        require("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"), {user: require("AIRFLOW_ADMIN_PASSWORD")}
    )
    print(f"compose init: Airflow user {user!r} has the password AIRFLOW_ADMIN_PASSWORD of .env")
    return 0


if __name__ == "__main__":
    sys.exit(main())
