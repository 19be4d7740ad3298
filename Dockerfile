# One image for the Airflow services and the training / feature / inference jobs (one standard stack).
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 AIRFLOW_HOME=/opt/airflow PINFLOW_HOME=/opt/pinflow
RUN apt-get update && apt-get install -y --no-install-recommends build-essential curl \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pinflow/src
COPY pyproject.toml constraints.txt README.md ./
COPY operators ./operators
COPY features ./features
COPY training ./training
# The CPU build of torch; a GPU image installs torch from the CUDA index instead (build arg).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url ${TORCH_INDEX} -c constraints.txt . \
      "apache-airflow[celery,postgres,redis]==3.3.2" "apache-airflow-providers-celery" "psycopg2-binary"
COPY dags ./dags
COPY plugins ./plugins
COPY config ./config
ENV AIRFLOW__CORE__DAGS_FOLDER=/opt/pinflow/src/dags AIRFLOW__CORE__PLUGINS_FOLDER=/opt/pinflow/src/plugins
