# One image for the Airflow services, the MLflow server and the training / feature / inference jobs (one standard
# stack): docker-compose.yaml builds it. Runs as the user AIRFLOW_UID (50000) in group 0, as Airflow's own image.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 AIRFLOW_HOME=/opt/airflow PINFLOW_HOME=/opt/pinflow/home
# curl: the services' health checks.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential curl \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pinflow/src
COPY pyproject.toml constraints.txt README.md ./
COPY core ./core
COPY services ./services
COPY operators ./operators
COPY features ./features
COPY training ./training
# The CPU build of torch; a GPU image installs torch from the CUDA index instead (build arg). The `production`
# extra: the Celery provider (with Redis), psycopg2 and asyncpg for PostgreSQL.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# TorchRec (strategy torchrec) with the CPU fbgemm and --no-deps: it declares the CUDA fbgemm-gpu (500 MB).
RUN pip install --extra-index-url ${TORCH_INDEX} -c constraints.txt ".[production,cpu]" \
 && pip install --no-deps -c constraints.txt torchrec==1.8.0 \
 && python -c "import torchrec, fbgemm_gpu"
COPY dags ./dags
COPY plugins ./plugins
COPY config ./config
COPY scripts ./scripts
# The services run as AIRFLOW_UID and cannot write __pycache__ here: compiled now, or the DAG processor would
# compile every module a DAG file imports at every parse.
RUN python -m compileall -q /opt/pinflow/src
# Folders the named volumes are mounted on: a new volume takes their owner, so the services can write there.
ARG AIRFLOW_UID=50000
RUN useradd --uid ${AIRFLOW_UID} --gid 0 --home-dir /opt/airflow --create-home airflow \
    && mkdir -p /opt/airflow/auth /opt/pinflow/home /opt/mlflow/auth \
    && chown -R ${AIRFLOW_UID}:0 /opt/airflow /opt/pinflow/home /opt/mlflow \
    && chmod -R g+rwX /opt/airflow /opt/pinflow/home /opt/mlflow
USER ${AIRFLOW_UID}:0
ENV PYTHONPATH=/opt/pinflow/src \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/pinflow/src/dags AIRFLOW__CORE__PLUGINS_FOLDER=/opt/pinflow/src/plugins
