"""The URLs of pinflow's pages in the Airflow UI (the plugin's FastAPI app, ``plugins/pinflow_ui/web.py``).

The operators' extra links point here, so that every link is ``http(s)`` (the Airflow UI shows nothing else): the
Data Docs and validation reports and a local job's page are served by the plugin, and the "MLflow run" link
resolves, when clicked, to the run the job recorded in its checkpoint folder (``mlflow_run.json``), so it is
there from the moment the job is submitted. The base is Airflow's ``[api] base_url`` (``AIRFLOW__API__BASE_URL``,
which the Makefile and the compose file set), where the API server serves the UI and the plugin.
"""

from __future__ import annotations

from urllib.parse import quote

URL_PREFIX = "/pinflow"


def base_url() -> str:
    """Airflow's public URL (``[api] base_url``; unset: the API server's port on localhost), without a trailing
    slash."""
    from airflow.configuration import conf

    url = conf.get("api", "base_url", fallback="") or f"http://localhost:{conf.get('api', 'port', fallback='8080')}"
    return url.rstrip("/")


def page_url(*parts: str) -> str:
    """``<base_url>/pinflow/<parts...>``, each part quoted."""
    return base_url() + URL_PREFIX + "".join("/" + quote(str(p), safe="") for p in parts)


def run_page_url(dag_id: str, run_id: str) -> str:
    return page_url("runs", dag_id, run_id)


def mlflow_run_url(dag_id: str, run_id: str) -> str:
    """Redirects to the MLflow run of the DAG run's newest training job (a page saying so until it exists)."""
    return page_url("runs", dag_id, run_id, "mlflow")


def data_docs_url(dataset: str, ds: str) -> str:
    """The partition's validation report, pinflow's own page (every check, what it observed and expected; no
    asset from the internet, so it reads the same on a closed network), which links GX's Data Docs."""
    return page_url("data-quality", "report", dataset, ds)


def job_page_url(backend: str, job_id: str) -> str:
    return page_url("jobs", backend, job_id)


def console_url(backend: str, job_id: str, native: str) -> str:
    """The job's console: the backend's own when it is a web page (AWS console, Kubernetes dashboard), else the
    plugin's job page (a local job's folder: its nodes' logs and request)."""
    return native if native.startswith(("http://", "https://")) else job_page_url(backend, job_id)
