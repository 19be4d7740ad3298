"""OpenLineage: the datasets each stage of the chain really read and wrote (raw → features → model → corpus scores).

The operators' ``get_openlineage_facets_on_complete`` (the OpenLineage provider's hook, called by its listener when
a task ends) return what these functions compute from the task's own arguments and results. Nothing here runs
unless the provider is configured with a transport (``[openlineage] transport``; without one it is disabled).

Dataset names follow OpenLineage's naming spec (https://openlineage.io/docs/spec/naming), the same as Airflow's own
file and S3 assets: a partition on a local storage root is namespace ``file`` (``file://<host>`` for a URL with a
host), name its absolute path; on an ``s3://bucket/prefix`` root, namespace ``s3://bucket``, name the key
``prefix/<dataset>/ds=<day>``. A registered model is namespace the MLflow tracking URI (without credentials), name
``models/<name>/<version>``.

Light at import (operator modules import this inside methods): OpenLineage's classes are imported when called.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage
    from openlineage.client.event_v2 import Dataset

__all__ = [
    "feature_lineage",
    "inference_lineage",
    "location_names",
    "model_dataset",
    "partition_dataset",
    "training_lineage",
    "validation_lineage",
]


def location_names(location: str) -> tuple[str, str]:
    """(namespace, name) of a storage location (a local path, a ``file://`` or ``s3://`` URL) per the naming spec."""
    text = os.fspath(location)
    parts = urlsplit(text)
    if parts.scheme in ("", "file"):
        path = parts.path if parts.scheme else text
        if parts.scheme and parts.netloc and parts.netloc != "localhost":
            return f"file://{parts.netloc}", posixpath.normpath(path)
        return "file", os.path.abspath(path)
    if parts.scheme in ("s3", "s3a", "s3n"):
        return f"s3://{parts.netloc}", parts.path.strip("/")
    return f"{parts.scheme}://{parts.netloc}", parts.path.strip("/") or "/"


def _dataset(location: str) -> Dataset:
    from openlineage.client.event_v2 import Dataset

    namespace, name = location_names(location)
    return Dataset(namespace=namespace, name=name)


def partition_dataset(root: str, dataset: str, ds: str) -> Dataset:
    """The OpenLineage dataset of one day of a dataset under the storage root (``<root>/<dataset>/ds=<ds>``)."""
    from core import storage

    return _dataset(storage.partition(root, dataset, ds))


def _ref_dataset(root: str, ref: str) -> Dataset:
    """A partition named as the feature build's metadata names its inputs: ``features/user_daily/ds=2026-11-01``."""
    from core import storage

    return _dataset(storage.join(root, *ref.strip("/").split("/")))


def tracking_namespace(tracking_uri: str) -> str:
    """The MLflow tracking URI as a namespace: credentials and a trailing ``/`` removed."""
    parts = urlsplit(tracking_uri)
    if "@" in parts.netloc:  # rebuilt only then: urlunsplit would turn sqlite:////abs/path into sqlite://abs/path
        tracking_uri = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return tracking_uri.rstrip("/") or tracking_uri


def model_dataset(tracking_uri: str, name: str, version: str | int) -> Dataset:
    """A registered model version: namespace the tracking URI, name ``models/<name>/<version>`` (type MODEL)."""
    from openlineage.client.event_v2 import Dataset
    from openlineage.client.facet_v2 import dataset_type_dataset

    return Dataset(
        namespace=tracking_namespace(tracking_uri),
        name=f"models/{name}/{version}",
        facets={"datasetType": dataset_type_dataset.DatasetTypeDatasetFacet(datasetType="MODEL")},
    )


def _unique(datasets: Iterable[Dataset]) -> list[Dataset]:
    seen: set[tuple[str, str]] = set()
    out = []
    for d in datasets:
        if (d.namespace, d.name) not in seen:
            seen.add((d.namespace, d.name))
            out.append(d)
    return out


def _lineage(inputs: Iterable[Dataset], outputs: Iterable[Dataset]) -> OperatorLineage:
    from airflow.providers.openlineage.extractors import OperatorLineage

    return OperatorLineage(inputs=_unique(inputs), outputs=_unique(outputs))


def _raw(dataset: str) -> str:
    return dataset if dataset.startswith("raw/") else f"raw/{dataset}"


def validation_lineage(
    root: str, dataset: str, ds: str, checks: Iterable[tuple[str, bool]] = ()
) -> OperatorLineage:
    """Validating a raw partition: it is the input (with the checks' outcomes as data-quality assertions), its
    report folder (``reports/validation/<dataset>/ds=<ds>``) the output."""
    from openlineage.client.event_v2 import InputDataset
    from openlineage.client.facet_v2 import data_quality_assertions_dataset as dq
    from openlineage.client.generated.base import InputDatasetFacet

    from core import storage

    raw = _raw(dataset)
    namespace, name = location_names(storage.partition(root, raw, ds))
    assertions = [dq.Assertion(assertion=check, success=bool(ok)) for check, ok in checks]
    facets: dict[str, InputDatasetFacet] = (
        {"dataQualityAssertions": dq.DataQualityAssertionsDatasetFacet(assertions=assertions)} if assertions else {}
    )
    source = InputDataset(namespace=namespace, name=name, inputFacets=facets)
    report = partition_dataset(root, f"reports/validation/{raw.removeprefix('raw/')}", ds)
    return _lineage([source], [report])


def feature_lineage(root: str, ds: str, summary: Mapping[str, Any]) -> OperatorLineage:
    """One feature step of ``ds``: what the build says it read (each output's metadata ``inputs``: raw partitions,
    earlier features) in, each dataset it wrote (the summary's keys, ``features/...`` or ``examples``) out."""
    inputs: list[Dataset] = []
    outputs: list[Dataset] = []
    for dataset, meta in summary.items():
        meta = meta if isinstance(meta, Mapping) else {}
        outputs.append(partition_dataset(root, str(meta.get("dataset") or dataset), str(meta.get("ds") or ds)))
        inputs.extend(_ref_dataset(root, str(ref)) for ref in meta.get("inputs") or [])
    return _lineage(inputs, outputs)


def training_lineage(
    root: str, tracking_uri: str, plan: Mapping[str, Any], result: Mapping[str, Any] | None
) -> OperatorLineage:
    """A training run: the partitions of its train and evaluation days in (``plan['dataset']``, default
    ``examples``), the model version it registered out (none when it registered nothing)."""
    dataset = str(plan.get("dataset") or "examples")
    days = [*(plan.get("train_days") or []), *([plan["eval_ds"]] if plan.get("eval_ds") else [])]
    inputs = [partition_dataset(root, dataset, str(day)) for day in days]
    outputs = []
    if result and result.get("model_name") and result.get("model_version") not in (None, ""):
        outputs.append(model_dataset(tracking_uri, str(result["model_name"]), str(result["model_version"])))
    return _lineage(inputs, outputs)


def inference_lineage(
    plan: Mapping[str, Any], *, root: str | None = None, tracking_uri: str | None = None
) -> OperatorLineage:
    """Corpus scoring of a plan (the summary ``operators.inference.plan_inference`` returned): the registered model
    version and the ``raw/pins`` partitions that make the snapshot of ``plan['ds']`` in, the output partition
    (``inference/<model>/<version>/ds=<ds>``) out. Root and tracking URI default to the platform configuration."""
    from core import storage

    if root is None or tracking_uri is None:
        from core import config

        cfg = config.load()
        root = cfg.storage_root if root is None else root
        tracking_uri = cfg.mlflow.tracking_uri if tracking_uri is None else tracking_uri
    ds = str(plan["ds"])
    try:  # an incremental snapshot is the newest full partition and the increments after it
        days = storage.snapshot_days(root, "raw/pins", ds) or [ds]
    except Exception:
        days = [ds]
    inputs = [model_dataset(tracking_uri, str(plan["model_name"]), str(plan["model_version"]))]
    inputs += [partition_dataset(root, "raw/pins", day) for day in days]
    out_dir = plan.get("out_dir") or storage.partition(
        root, f"inference/{plan['model_name']}/{plan['model_version']}", ds
    )
    return _lineage(inputs, [_dataset(str(out_dir))])
