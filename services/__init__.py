"""Platform services the Airflow layer uses but that need no Airflow: the job history and its costs
(``job_history``), the metadata database's engine (``metadata_db``), MLflow registry lookups (``model_registry``),
the promotion gate (``promotion``) and champion moves (``champions``). They import ``core/`` only
(docs/architecture.md §1)."""
