"""MLflow's registry as every layer reads it: a version by number or alias, and "not found" as an answer.

"Not found" (an unknown version, alias or model) is a USER error for a requested version; anything else (the
tracking server or its database does not answer) is classified by ``core.failures`` (INFRA: retried).
``services.model_registry`` builds the Airflow layer's uses (the champion) on these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.failures import UserError, as_typed

if TYPE_CHECKING:
    from mlflow import MlflowClient

# MLflow's error codes for a model, version or alias that does not exist.
NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


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
