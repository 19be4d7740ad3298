"""The MLflow model registry as the Airflow layer uses it: find a version or the champion, classified.

"Not found" (an unknown version, alias or model) is an answer: a USER error for a requested version, no
champion for the alias. Anything else (the tracking server or its database does not answer) is classified by
``core.failures`` (INFRA: retried), never mistaken for "no champion", so an MLflow outage cannot promote a
model unconditionally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.config import MlflowConfig
from core.failures import UserError, as_typed

if TYPE_CHECKING:
    from mlflow import MlflowClient

# MLflow's error codes for a model, version or alias that does not exist.
NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
CHAMPION = "champion"


def client(mlflow: MlflowConfig) -> MlflowClient:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow.tracking_uri, registry_uri=mlflow.tracking_uri)


def is_not_found(err: BaseException) -> bool:
    # An MlflowException, or its RestException subclass from a tracking server (what the production stack raises).
    is_mlflow = any(cls.__name__ == "MlflowException" for cls in type(err).__mro__)
    return is_mlflow and getattr(err, "error_code", "") in NOT_FOUND


def model_version(registry: MlflowClient, name: str, version: str) -> Any:
    """The registered version ``version`` (a number or an alias such as ``champion``) of model ``name``."""
    try:
        if version.isdigit():
            return registry.get_model_version(name, version)
        return registry.get_model_version_by_alias(name, version)
    except Exception as err:
        if is_not_found(err):
            raise UserError(
                f"model {name} has no version or alias {version!r} in the registry ({err}); "
                "give a registered version number or an alias that is set"
            ) from err
        raise as_typed(err, f"the MLflow registry at {registry.tracking_uri}") from err


def champion(registry: MlflowClient, name: str) -> Any | None:
    """The version with the ``champion`` alias; None when the model or the alias does not exist yet."""
    try:
        return registry.get_model_version_by_alias(name, CHAMPION)
    except Exception as err:
        if is_not_found(err):
            return None
        raise as_typed(err, f"the MLflow registry at {registry.tracking_uri}") from err
