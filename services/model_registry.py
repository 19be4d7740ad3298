"""The MLflow model registry as the Airflow layer uses it: the champion, classified (a version by number or alias:
``core.model_versions``).

"Not found" (no such model or alias) is an answer: no champion. Anything else (the tracking server or its database
does not answer) is classified by ``core.failures`` (INFRA: retried), never mistaken for "no champion", so an MLflow
outage cannot promote a model unconditionally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.config import MlflowConfig
from core.failures import as_typed
from core.model_versions import is_not_found

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"


def client(mlflow: MlflowConfig) -> MlflowClient:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow.tracking_uri, registry_uri=mlflow.tracking_uri)


def champion(registry: MlflowClient, name: str) -> Any | None:
    """The version with the ``champion`` alias; None when the model or the alias does not exist yet."""
    try:
        return registry.get_model_version_by_alias(name, CHAMPION)
    except Exception as err:
        if is_not_found(err):
            return None
        raise as_typed(err, f"the MLflow registry at {registry.tracking_uri}") from err
