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
export AIRFLOW__API__PORT := 8080
# A laptop: a few task slots, not Airflow's default 32 worker processes.
export AIRFLOW__CORE__PARALLELISM := 4
export GX_ANALYTICS_ENABLED := False
export PATH := $(BIN):$(PATH)

.PHONY: help install demo test lint airflow constraints clean print-env

help:
	@echo "make demo     - install if needed, then run the whole chain on a synthetic world (summary: $(PINFLOW_HOME)/storage/demo-summary.json)"
	@echo "make test     - install if needed, then ruff, mypy and pytest"
	@echo "make airflow  - airflow standalone on http://localhost:8080 with these DAGs"
	@echo "make install  - .venv with the pinned constraints, and an Airflow home on SQLite under $(PINFLOW_HOME)"
	@echo "make clean    - delete $(PINFLOW_HOME) (the demo's data, MLflow store and Airflow home)"

install: $(VENV)/.installed $(AIRFLOW_HOME)/airflow.db

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

$(AIRFLOW_HOME)/airflow.db: $(VENV)/.installed
	mkdir -p $(AIRFLOW_HOME)
	$(BIN)/airflow db migrate > $(AIRFLOW_HOME)/db-migrate.log 2>&1 || (tail -20 $(AIRFLOW_HOME)/db-migrate.log; exit 1)

demo: install
	$(BIN)/python scripts/demo.py

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy core operators features training plugins dags scripts

test: install lint
	$(BIN)/python -m pytest

airflow: install
	@echo "Airflow UI: http://localhost:8080 — user 'admin', password in $(AIRFLOW_HOME)/simple_auth_manager_passwords.json.generated"
	$(BIN)/airflow standalone

# Regenerate the constraints from the working .venv (Airflow's convention for reproducible installs).
constraints:
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/' > constraints.txt

clean:
	rm -rf $(PINFLOW_HOME)

# The environment of these targets, for running airflow commands by hand: eval "$$(make -s print-env)"
print-env:
	@for v in PINFLOW_HOME AIRFLOW_HOME AIRFLOW__CORE__DAGS_FOLDER AIRFLOW__CORE__PLUGINS_FOLDER \
	  AIRFLOW__CORE__LOAD_EXAMPLES AIRFLOW__DATABASE__SQL_ALCHEMY_CONN AIRFLOW__CORE__PARALLELISM GX_ANALYTICS_ENABLED PATH; do \
	  echo "export $$v='$${!v}'"; done
