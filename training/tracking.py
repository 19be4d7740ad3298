"""MLflow on rank 0: one run per training job, resumed across retries; the model registered once per training (examples seen).

The run id (and, once registered, the model version) is kept in ``<checkpoint_dir>/mlflow_run.json``:
a retried job (same checkpoint_dir) continues the same MLflow run instead of starting a new one, and a job
that died after registering its model but before writing result.json reuses that version rather than
registering a duplicate.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import Any

import numpy as np
import torch

from core import storage
from core.failures import ConfigError
from training.config import RunConfig
from training.inference import SHARDED_METADATA, SHARDED_ROWS_TAG
from training.sdk import ModelFamily

log = logging.getLogger("training.tracking")

STATE_FILE = "mlflow_run.json"
MODEL_ARTIFACT = "model"
FEATURE_SPEC_ARTIFACT = "feature_spec.json"
INPUTS_ARTIFACT = "inputs.json"
# Tags of a resumed run: the value of each param it resumed with that differs from the first, logged one.
RESUMED_WITH_TAG = "pinflow.resumed_with"
# The examples a registered version's model was trained on: a run resumed with more epochs registers its model again.
EXAMPLES_TAG = "pinflow.examples_seen"
# The family whose versions a registered model holds (one per registered model).
FAMILY_TAG = "pinflow.family"


def torch_requirement() -> str:
    """``torch==X.Y.Z`` without a local build tag (``+cpu``), the pin a serving image installs."""
    return f"torch=={torch.__version__.split('+')[0]}"


def model_signature(family: ModelFamily, serving: torch.nn.Module, example: dict[str, np.ndarray]) -> Any:
    """The MLflow signature of a family's serving module: its inputs, and its outputs' shapes as it computes them."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    names = family.serving_inputs
    with torch.no_grad():
        out = serving(*(torch.from_numpy(example[name]) for name in names))
    inputs = Schema([TensorSpec(example[n].dtype, (-1, *example[n].shape[1:]), n) for n in names])
    outputs = Schema([
        TensorSpec(np.dtype(np.float32), (-1, *out[n].shape[1:]), n) for n in family.outputs
    ])
    return ModelSignature(inputs=inputs, outputs=outputs)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


class Tracker:
    """The MLflow side of a training job. Create it on rank 0 only (it imports mlflow)."""

    def __init__(self, config: RunConfig) -> None:
        import mlflow
        from mlflow import MlflowClient

        self.config = config
        self.mlflow = mlflow
        mlflow.set_tracking_uri(config.mlflow_tracking_uri)
        mlflow.set_registry_uri(config.mlflow_tracking_uri)
        self.client = MlflowClient(tracking_uri=config.mlflow_tracking_uri, registry_uri=config.mlflow_tracking_uri)
        self.state_path = storage.join(config.checkpoint_dir, STATE_FILE)
        self.state: dict[str, Any] = (
            json.loads(storage.read_text(self.state_path)) if storage.exists(self.state_path) else {}
        )
        self._check_family()
        self.experiment_id = self._experiment()
        self.continued_status: str | None = None  # the status of the run this job continues (None: a new run)
        self.run_id = self._run()
        self._pending: list[Any] = []

    def _check_family(self) -> None:
        """A registered model holds the versions of one family (its FAMILY_TAG, set at its first registration): a run
        of another family given its name (``model_name``) is refused before it trains, as a USER error."""
        if not self.config.register:
            return
        from core.model_versions import is_not_found

        name = self.config.registered_model
        try:
            family = self.client.get_registered_model(name).tags.get(FAMILY_TAG)
            if not family:  # registered before the tag was set: the family its newest version's run trained
                newest = max(self.client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version),
                             default=None)
                if newest is not None and newest.run_id:
                    family = self.client.get_run(newest.run_id).data.tags.get(FAMILY_TAG)
        except Exception as err:
            if is_not_found(err):
                return  # registered by this run
            raise
        if family and family != self.config.family:
            raise ConfigError(
                f"model_name {name!r} holds versions of family {family!r}, and this run trains family "
                f"{self.config.family!r}: give this run a model_name of its own (the default is the family's name)"
            )

    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.config.experiment_name
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(self.client.create_experiment(name, artifact_location=self.config.mlflow_artifact_location))
        except MlflowException:  # created by a concurrent job in the meantime
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def _run(self) -> str:
        from mlflow.exceptions import MlflowException

        run_id = self.state.get("run_id")
        if run_id:
            try:
                run = self.client.get_run(run_id)
                if run.info.experiment_id == self.experiment_id:
                    self.continued_status = str(run.info.status)
                    self.mlflow.start_run(run_id=run_id)
                    log.info("continuing MLflow run %s (from %s)", run_id, self.state_path)
                    return str(run_id)
            except MlflowException as e:
                log.warning("MLflow run %s from %s is gone (%s): starting a new run", run_id, self.state_path, e)
            self.state = {}
        tags = {FAMILY_TAG: self.config.family, **{f"pinflow.{k}": str(v) for k, v in self.config.tags.items()}}
        run = self.mlflow.start_run(experiment_id=self.experiment_id, run_name=self.config.run_name, tags=tags)
        self.state = {"run_id": run.info.run_id, "experiment_id": self.experiment_id}
        storage.write_json(self.state_path, self.state)
        log.info("MLflow run %s in experiment %s", run.info.run_id, self.config.experiment_name)
        return str(run.info.run_id)

    # ----------------------------------------------------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        """Log params; on a resumed run, keys already logged keep their first value (MLflow forbids changes) and the
        values it resumed with are the tags ``pinflow.resumed_with.<key>`` (a run extended to more epochs shows it)."""
        from mlflow.entities import Param, RunTag

        existing = self.client.get_run(self.run_id).data.params
        new = [Param(k, _param_value(v)) for k, v in params.items() if k not in existing]
        changed = {k: _param_value(v) for k, v in params.items() if k in existing and existing[k] != _param_value(v)}
        if changed:
            log.warning("resumed MLflow run keeps its first value of params %s (the values it resumed with are its "
                        "tags pinflow.resumed_with.*)", ", ".join(f"{k} {existing[k]} (now {v})" for k, v in changed.items()))
        tags = [RunTag(f"{RESUMED_WITH_TAG}.{k}", v) for k, v in changed.items()]
        for i in range(0, max(len(new), len(tags)), 100):
            self.client.log_batch(self.run_id, params=new[i : i + 100], tags=tags[i : i + 100])

    def log_inputs(self, inputs: dict[str, dict[str, dict[str, Any]]]) -> None:
        """The run's pinned input partitions (RUN.json ``inputs``): a param ``input.<dataset>.<day>`` with each
        version, and the whole manifest (locations, files) as the artifact ``inputs.json``."""
        if not inputs:
            return
        self.log_params({f"input.{dataset}.{ds}": entry["version"]
                         for dataset, days in sorted(inputs.items()) for ds, entry in sorted(days.items())})
        self.mlflow.log_dict(inputs, INPUTS_ARTIFACT)

    def log_metrics(self, metrics: dict[str, float], step: int, flush: bool = False) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        if flush:
            self.flush()

    def flush(self) -> None:
        while self._pending:
            chunk, self._pending = self._pending[:1000], self._pending[1000:]
            self.client.log_batch(self.run_id, metrics=chunk)

    # ----------------------------------------------------------------------------------------------
    def log_model(
        self, family: ModelFamily, model: torch.nn.Module | None, feature_spec: dict[str, Any],
        sharded: str | None = None, *, examples_seen: int,
    ) -> tuple[str, str | None]:
        """Log the family's exported serving model (torch.export 'pt2') and register it; return (model_uri, version).

        ``sharded``: the folder of the model's sharded export (``training.sharded_export``) instead: the MLflow
        model is a pointer to it (the manifest's location and SHA-256 in its metadata, the manifest a copy among
        its artifacts), so ``models:/name/version`` stays what the registry and a rollback move, and no process
        ever holds the whole model to log it.

        Idempotent per MLflow run and ``examples_seen`` (the examples the model was trained on, over every try, as its
        checkpoints count them: the same after a resume on another world size): a model this run registered after as
        many examples (an earlier try) is returned. The registry itself is asked (this run's version tagged with that
        count), not only the state file beside the checkpoints: a try that registered and then failed to write that
        file (a full disk) must not register twice. A run resumed with more epochs trained on: a new version.
        """
        if self.state.get("model_uri"):
            # No model_examples: a state written before they were recorded, taken as the same model.
            if int(self.state.get("model_examples", examples_seen)) == examples_seen:
                log.info("model already logged by this run: %s (version %s)", self.state["model_uri"],
                         self.state.get("model_version"))
                self._tag_corpus_rows(family, self.state.get("model_version"), sharded)
                return str(self.state["model_uri"]), self.state.get("model_version")
            log.info("this run registered version %s after %s examples and trained on to %s: registering the model again",
                     self.state.get("model_version"), self.state.get("model_examples"), examples_seen)
            for key in ("model_uri", "model_version", "logged_model_uri", "model_examples"):
                self.state.pop(key, None)
        registered = self.registered_version(examples_seen)
        if registered is not None:
            model_uri = f"models:/{self.config.registered_model}/{registered.version}"
            log.info("this run registered its model already (an earlier try): %s", model_uri)
            self._tag_corpus_rows(family, str(registered.version), sharded)
            # That try may have ended before it tagged the model with its family.
            self.client.set_registered_model_tag(self.config.registered_model, FAMILY_TAG, self.config.family)
            self.state.update(model_uri=model_uri, model_version=str(registered.version),
                              logged_model_uri=str(registered.source), model_examples=examples_seen)
            storage.write_json(self.state_path, self.state)
            return model_uri, str(registered.version)
        self.mlflow.log_dict(feature_spec, FEATURE_SPEC_ARTIFACT)
        registered_name = self.config.registered_model if self.config.register else None
        tags = {EXAMPLES_TAG: str(examples_seen)}  # on the logged model and, set with its creation, on the version
        if sharded is not None:
            info = self._log_sharded(sharded, feature_spec, registered_name, tags)
        else:
            assert model is not None, "a model exported whole needs its module"
            serving = family.serving(copy.deepcopy(model).cpu().float()).eval()
            example = family.example_inputs()
            info = self.mlflow.pytorch.log_model(
                serving,
                name=MODEL_ARTIFACT,
                serialization_format="pt2",
                input_example=tuple(example[name] for name in family.serving_inputs),
                signature=model_signature(family, serving, example),
                pip_requirements=[torch_requirement()],  # explicit: inferring requirements is slow
                registered_model_name=registered_name,
                metadata={"feature_spec": feature_spec},
                tags=tags,
            )
        version = info.registered_model_version
        version = str(version) if version is not None else None
        if version is not None:
            self.client.set_registered_model_tag(self.config.registered_model, FAMILY_TAG, self.config.family)
        self._tag_corpus_rows(family, version, sharded)
        model_uri = f"models:/{self.config.registered_model}/{version}" if version else info.model_uri
        self.state.update(model_uri=model_uri, model_version=version, logged_model_uri=info.model_uri,
                          model_examples=examples_seen)
        storage.write_json(self.state_path, self.state)
        return model_uri, version

    def _tag_corpus_rows(self, family: ModelFamily, version: str | None, sharded: str | None) -> None:
        """Tag a sharded version with its corpus table's rows (what the corpus plan groups pins by, read with the
        version: no model download). Also on a retry's way out: a try may have registered and died before tagging."""
        if sharded is None or version is None or not family.corpus_table:
            return
        from training import sharded_export

        rows = sharded_export.read_manifest(sharded)[1]["tables"].get(family.corpus_table, {}).get("rows")
        if rows:
            self.client.set_model_version_tag(self.config.registered_model, version, SHARDED_ROWS_TAG, str(rows))

    def _log_sharded(
        self, folder: str, feature_spec: dict[str, Any], registered_name: str | None, tags: dict[str, str]
    ) -> Any:
        """A pyfunc model pointing to the sharded export in ``folder`` (``training.inference.load_model`` reads it)."""
        import tempfile

        import mlflow.pyfunc

        from training import sharded_export

        class ShardedPointer(mlflow.pyfunc.PythonModel):  # type: ignore[misc,name-defined]
            """A pinflow sharded model: load it with training.inference.load_model (its rows stay in their files)."""

            def predict(self, context: Any, model_input: Any, params: Any = None) -> Any:
                raise NotImplementedError("a pinflow sharded model is loaded with training.inference.load_model")

        base, manifest = sharded_export.read_manifest(folder)
        pointer = {"location": folder, "sha256": sharded_export.manifest_sha256(folder),
                   "tables": {t: {"rows": v["rows"], "dim": v["dim"], "shards": len(v["shards"])}
                              for t, v in manifest["tables"].items()}}
        with tempfile.TemporaryDirectory() as tmp:
            copy_path = f"{tmp}/{sharded_export.MANIFEST_FILE}"
            storage.write_bytes(copy_path, storage.read_bytes(storage.join(base, sharded_export.MANIFEST_FILE)))
            return mlflow.pyfunc.log_model(
                name=MODEL_ARTIFACT, python_model=ShardedPointer(), artifacts={"manifest": copy_path},
                pip_requirements=[torch_requirement()], registered_model_name=registered_name,
                metadata={"feature_spec": feature_spec, SHARDED_METADATA: pointer}, tags=tags,
            )

    def registered_version(self, examples_seen: int) -> Any | None:
        """The version of ``registered_model`` that this MLflow run registered after ``examples_seen`` examples, if any
        (the oldest; a version without EXAMPLES_TAG, registered before it was set, counts as any count's)."""
        if not self.config.register:
            return None
        versions = [v for v in self.client.search_model_versions(
            f"name='{self.config.registered_model}' and run_id='{self.run_id}'")
            if v.tags.get(EXAMPLES_TAG, str(examples_seen)) == str(examples_seen)]
        return min(versions, key=lambda v: int(v.version)) if versions else None

    def end(self, status: str = "FINISHED") -> None:
        try:
            self.flush()
        finally:
            self.mlflow.end_run(status=status)
