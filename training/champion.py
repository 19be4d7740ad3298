"""The registered champion, evaluated by a training job on its own evaluation day.

The promotion gate (``services.promotion``) compares a new model with its family's champion on the same day and
the same examples. The job that trained the new model has that day's inputs pinned and its family's evaluation
at hand, so rank 0 evaluates the champion there (``RunConfig.evaluate_champion``) right after the new model, and
``result.json`` carries both: the gate never has to trust numbers from another day.

The champion is the version the MLflow alias ``champion`` of ``model_name`` points at. Its exported serving
module is loaded from the registry, its weights put into the family's trainable model
(``ModelFamily.model_from_serving``) built with the params it was trained with (its feature spec); a champion exported
sharded is loaded over its table files instead (``training.inference.load_trainable``: never built whole). The
family's ``evaluate`` runs on it exactly as on the new model. What could not be evaluated is reported, not raised: the
gate then refuses to decide and says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from training.config import RunConfig
from training.sdk import ModelFamily

log = logging.getLogger("training.champion")

CHAMPION_ALIAS = "champion"


def evaluate_champion(
    config: RunConfig,
    family: ModelFamily,
    mlflow_run_id: str | None,
    *,
    device: Any,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any] | None:
    """``{"version", "run_id", "eval_ds", "metrics"}`` of the champion of ``config.registered_model`` on ``config.eval_ds``;
    ``{"version", "run_id", "is_this_run": True}`` when the champion is this run's own model (a rerun after its
    promotion); ``{"version", "error"}`` when it could not be evaluated; None when there is no champion."""
    from mlflow import MlflowClient

    from training.inference import load_trainable

    uri = config.mlflow_tracking_uri
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = config.registered_model
    try:
        version = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    except Exception as err:
        if getattr(err, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None  # no such model or alias yet: this is the family's first model
        return {"version": None, "error": f"the registry did not answer who the champion of {name} is: {err}"}
    found: dict[str, Any] = {"version": str(version.version), "run_id": str(version.run_id or "")}
    if mlflow_run_id and version.run_id == mlflow_run_id:
        return {**found, "is_this_run": True}
    try:
        # The day it was evaluated on when it was trained: the gate does not let an older model replace it.
        found["eval_ds"] = client.get_run(str(version.run_id)).data.params.get("eval_ds") if version.run_id else None
        # A sharded champion stays sharded (its rows read as they are looked up): never built whole on rank 0.
        champion_family, model, _ = load_trainable(f"models:/{name}/{version.version}", uri)
        if champion_family.name != family.name:
            raise ValueError(f"it is a model of family {champion_family.name}, this run trains {family.name}")
        model = model.to(device)
        context = champion_family.prepare(config.input_root, list(config.train_days), config.eval_ds)
        metrics = champion_family.evaluate({"model": model}, config.input_root, config.eval_ds, context, device=device,
                                           batch_size=config.eval_batch_size, on_batch=on_batch)
    except Exception as err:  # noqa: BLE001 - reported to the gate, which refuses to decide and says why
        log.warning("could not evaluate the champion %s version %s on %s: %s", name, version.version,
                    config.eval_ds, err)
        return {**found, "error": f"{type(err).__name__}: {err}"}
    log.info("champion %s version %s on %s: mean AUC %s", name, version.version, config.eval_ds,
             metrics.get("mean_auc"))
    return {**found, "metrics": metrics}
