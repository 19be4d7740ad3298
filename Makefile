# pinflow: `make demo` runs the whole chain on the embedded default; `make test` runs the tests.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3.11
VENV := $(CURDIR)/.venv
BIN := $(VENV)/bin

# Everything the embedded default writes lives under PINFLOW_HOME: delete it to reset the demo.
export PINFLOW_HOME ?= $(CURDIR)/.pinflow
export AIRFLOW_HOME := $(PINFLOW_HOME)/airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN := sqlite:///$(AIRFLOW_HOME)/airflow.db
# Importing torchrec creates torch's compile cache folder: here, not /tmp/torchinductor_<user>.
export TORCHINDUCTOR_CACHE_DIR ?= $(PINFLOW_HOME)/torchinductor
# Ports and URLs in one place: `make airflow PORT=9090` moves the API server (UI, REST API and the execution API
# that task processes report to) and the log servers next to it; print-env gives the same to a shell.
PORT ?= 8080
export AIRFLOW__API__PORT := $(PORT)
# The embedded default serves this machine only (Airflow's default 0.0.0.0 is for a production stack behind a
# proxy); HOST=0.0.0.0 opens it to the network.
HOST ?= 127.0.0.1
export AIRFLOW__API__HOST := $(HOST)
export AIRFLOW__API__BASE_URL := http://localhost:$(PORT)
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL := http://localhost:$(PORT)/execution/
# Airflow's defaults (8793, 8794, 8974) for PORT=8080, shifted with it.
export AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT := $(shell echo $$(($(PORT) + 713)))
export AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT := $(shell echo $$(($(PORT) + 714)))
export AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT := $(shell echo $$(($(PORT) + 894)))
# The MLflow UI beside it (scripts/mlflow_ui.py; the training runs' "MLflow run" links point there): MLflow's default
# 5000 for PORT=8080, shifted with it; MLFLOW_PORT=... moves it alone.
MLFLOW_PORT ?= $(shell echo $$(($(PORT) - 3080)))
# A loaded laptop answers slowly: Airflow's 5 s default failed tasks with an empty log.
export AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT := 60
# A laptop: a few task slots, not Airflow's default 32 worker processes.
export AIRFLOW__CORE__PARALLELISM := 4
export GX_ANALYTICS_ENABLED := False
export PATH := $(BIN):$(PATH)

.PHONY: help install demo test test-extended lint airflow constraints clean print-env secrets dev-tools pools screenshots

help:
	@echo "make demo     - install if needed, then run the whole chain on a synthetic world (summary: $(PINFLOW_HOME)/storage/demo-summary.json)"
	@echo "make test     - install if needed, then ruff, mypy and pytest (TEST_WORKERS=2; make test-extended: the extended ones)"
	@echo "make airflow  - airflow standalone on http://localhost:$(PORT) with these DAGs, the MLflow UI on $(MLFLOW_PORT) (PORT=... moves both)"
	@echo "make secrets  - write .env with generated secrets for docker-compose.yaml (kept if it exists)"
	@echo "make install  - .venv with the pinned constraints, an Airflow home on SQLite under $(PINFLOW_HOME), the teams' pools"
	@echo "make pools    - create or update each team's Airflow pool (team-<name>) from config/platform.yaml"
	@echo "make screenshots - the pages' browser test, saving its screenshots as docs/*.png (docs/using-airflow.md shows them)"
	@echo "make clean    - delete $(PINFLOW_HOME) (the demo's data, MLflow store and Airflow home)"

install: $(VENV)/.installed $(AIRFLOW_HOME)/airflow.db $(AIRFLOW_HOME)/.pools-synced

# TorchRec is installed without its declared dependency on the CUDA fbgemm-gpu (a 500 MB wheel): the extra `cpu`
# (in dev) brings fbgemm-gpu-cpu. `pip check` then reports only that declaration ("torchrec 1.8.0 requires
# fbgemm-gpu, which is not installed"); nothing else is missing. RecBole is installed without its dependencies
# too: only the MovieLens 100K copy in its wheel is read (features/movielens.py, the real-data test), never its code.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps -c constraints.txt torchrec==1.8.0 recbole==1.2.1
	$(BIN)/python -c "import torchrec, fbgemm_gpu, importlib.util; assert importlib.util.find_spec('recbole')"
	touch $@

$(AIRFLOW_HOME)/airflow.db: $(VENV)/.installed
	mkdir -p $(AIRFLOW_HOME)
	$(BIN)/airflow db migrate > $(AIRFLOW_HOME)/db-migrate.log 2>&1 || (tail -20 $(AIRFLOW_HOME)/db-migrate.log; exit 1)

# Each team's Airflow pool (team-<name>, teams.<name>.quota.jobs slots, deferred tasks counted) from the
# configuration; again whenever it changes (`make pools` forces it: after changing PINFLOW_CONFIG or PINFLOW_TEAMS__*).
$(AIRFLOW_HOME)/.pools-synced: $(AIRFLOW_HOME)/airflow.db config/platform.yaml core/config.py
	$(BIN)/python -m operators.quotas sync-pools
	touch $@

pools: $(AIRFLOW_HOME)/airflow.db
	$(BIN)/python -m operators.quotas sync-pools
	touch $(AIRFLOW_HOME)/.pools-synced

demo: install
	$(BIN)/python scripts/demo.py

# The screenshots of the pages (docs/*.png, shown in docs/using-airflow.md), taken by the pages' browser test (Debian's chromium).
screenshots: install dev-tools
	PINFLOW_SCREENSHOTS=docs $(BIN)/python -m pytest -q tests/integration/test_ui_pages.py

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy core services operators features training plugins dags scripts

# Two pytest workers (pytest-xdist), a test file per worker at a time (module fixtures stay whole), the longest files
# first (tests/conftest.py); each worker has its own PINFLOW_HOME and Airflow home. TEST_WORKERS=0 runs in one process.
# Tests marked `extended` (DAG-level variants of what faster tests cover) run with `make test-extended`.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) --durations=25
test: install dev-tools lint
	$(PYTEST) -m "not extended" $(PYTEST_ARGS)

test-extended: install dev-tools
	$(PYTEST) -m extended $(PYTEST_ARGS)

# Debian's docker-compose 1.x validates docker-compose.yaml without a Docker engine (tests/unit/test_compose.py
# skips that check without it), and Debian's chromium renders the pages in tests/integration/test_ui_pages.py
# (Playwright drives it; its own browser download is not used): installed here when this runs as root with
# apt-get, named otherwise.
dev-tools:
	@command -v docker-compose >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's docker-compose (validates docker-compose.yaml)"; \
	    { apt-get install -y -qq docker-compose || { apt-get update -qq && apt-get install -y -qq docker-compose; }; } >/dev/null; \
	  else echo "docker-compose not found: sudo apt-get install docker-compose (tests/unit/test_compose.py skips its check)"; fi; }
	@test -x /usr/bin/chromium || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's chromium (the pages' browser test)"; \
	    { apt-get install -y -qq chromium || { apt-get update -qq && apt-get install -y -qq chromium; }; } >/dev/null; \
	  else echo "chromium not found: sudo apt-get install chromium (tests/integration/test_ui_pages.py skips its browser part)"; fi; }

# The secrets of docker-compose.yaml: .env from .env.example with generated values (never overwrites an .env).
secrets:
	python3 scripts/make_secrets.py

# The MLflow UI runs as long as Airflow does (stopped with it); its log is $(PINFLOW_HOME)/mlflow-ui.log.
airflow print-env: export PINFLOW_MLFLOW__UI_URL = http://localhost:$(MLFLOW_PORT)
airflow: install
	@echo "Airflow UI: http://localhost:$(PORT) — user 'admin', password in $(AIRFLOW_HOME)/simple_auth_manager_passwords.json.generated"
	@echo "MLflow UI:  http://localhost:$(MLFLOW_PORT) (log: $(PINFLOW_HOME)/mlflow-ui.log)"
	@mkdir -p $(PINFLOW_HOME)
	@$(BIN)/python scripts/mlflow_ui.py --host $(HOST) --port $(MLFLOW_PORT) > $(PINFLOW_HOME)/mlflow-ui.log 2>&1 & ui=$$!; \
	  trap 'kill $$ui 2>/dev/null' EXIT INT TERM; $(BIN)/airflow standalone

# Regenerate the constraints from the working .venv (Airflow's convention for reproducible installs).
constraints:
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/' > constraints.txt

clean:
	rm -rf $(PINFLOW_HOME)

# The environment of these targets, for running airflow commands by hand: eval "$$(make -s print-env)"
print-env:
	@for v in PINFLOW_HOME AIRFLOW_HOME AIRFLOW__CORE__DAGS_FOLDER AIRFLOW__CORE__PLUGINS_FOLDER \
	  AIRFLOW__CORE__LOAD_EXAMPLES AIRFLOW__DATABASE__SQL_ALCHEMY_CONN AIRFLOW__CORE__PARALLELISM GX_ANALYTICS_ENABLED \
	  AIRFLOW__API__HOST AIRFLOW__API__PORT AIRFLOW__API__BASE_URL AIRFLOW__CORE__EXECUTION_API_SERVER_URL \
	  AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT \
	  AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT \
	  PINFLOW_MLFLOW__UI_URL TORCHINDUCTOR_CACHE_DIR PATH; do \
	  echo "export $$v='$${!v}'"; done
