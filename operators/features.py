"""Operators of the daily feature DAG that build the features (DuckDB).

On the embedded default the work runs in the task's process; the same functions run as
``python -m features.build`` container jobs elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from core import config

FEATURE_STEPS = ("daily", "window", "sequences", "examples")
# The datasets each step writes (``core.contracts``; spelled out here so that parsing a DAG imports no pyarrow).
STEP_OUTPUTS = {
    "daily": ("features/user_daily", "features/pin_daily"),
    "window": ("features/user_window", "features/pin_window"),
    "sequences": ("features/user_sequence",),
    "examples": ("examples",),
}


class FeatureBuildOperator(BaseOperator):
    """Build one feature step of a day (DuckDB), written atomically; rerunning replaces that day only.

    :param step: one of ``daily``, ``window``, ``sequences``, ``examples``.
    :param ds: the partition day (templated).
    :param overrides: ``features:`` settings that win over the platform configuration for this run (templated),
        e.g. from params; validated by the same typed model (a bad value fails the task as USER).
    :param skip_validation: build even from raw partitions without a passed validation report for their current
        contents (for experts; recorded as ``skip_validation`` in the outputs' metadata). By default such a
        partition fails the task as DATA, naming the command that validates it.

    A missing or unusable input partition raises the build's ``DataError`` (no retry, nothing downstream).
    """

    template_fields: Sequence[str] = ("ds", "overrides")

    def __init__(
        self,
        *,
        step: str,
        ds: str,
        overrides: dict[str, Any] | None = None,
        skip_validation: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if step not in FEATURE_STEPS:
            raise ValueError(f"unknown feature step {step!r}: choose one of {FEATURE_STEPS}")
        self.step = step
        self.ds = ds
        self.overrides = overrides or {}
        self.skip_validation = skip_validation
        self._built: dict[str, Any] | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        from features import build

        cfg = config.load()
        features = config.with_overrides(cfg.features, self.overrides, "the run's params")
        root, ds, engine = cfg.storage_root, self.ds, build.DuckDBSettings.from_config(features)
        require = not self.skip_validation
        if self.skip_validation:
            self.log.warning("skip_validation: building %s ds=%s without checking validation reports", self.step, ds)
        if self.step == "daily":
            summary = build.build_daily(root, ds, require_validation=require, engine=engine)
        elif self.step == "window":
            summary = build.build_window(
                root, ds, window_days=features.window_days, prior_impressions=features.pin_prior_impressions,
                require_validation=require, engine=engine,
            )
        elif self.step == "sequences":
            summary = build.build_sequences(
                root, ds, sequence_length=features.sequence_length, window_days=features.window_days,
                require_validation=require, engine=engine,
            )
        else:
            summary = build.build_examples(
                root, ds, prior_impressions=features.pin_prior_impressions,
                negative_downsample=features.negative_downsample, seed=features.negative_downsample_seed,
                require_validation=require, engine=engine,
            )
        for dataset, meta in summary.items():
            # Days left out or computed on demand are named in the task log, not only in the metadata.
            if meta.get("missing_days") or meta.get("computed_from_raw"):
                self.log.warning(
                    "%s ds=%s: missing days %s, computed from raw %s",
                    dataset, self.ds, meta.get("missing_days"), meta.get("computed_from_raw", []),
                )
        self.log.info("%s ds=%s: %s", self.step, self.ds, summary)
        self._built = summary
        return summary

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage (the provider's listener): the partitions this step read (its metadata's ``inputs``) and
        wrote (``operators.lineage``); read back from the outputs' ``_metadata.json`` if this instance did not
        build them."""
        from core import storage
        from operators.lineage import feature_lineage

        root = config.load().storage_root
        summary = self._built
        if summary is None:
            summary = {}
            for dataset in STEP_OUTPUTS[self.step]:
                try:
                    summary[dataset] = storage.read_metadata(root, dataset, self.ds)
                except (OSError, ValueError):
                    summary[dataset] = {}
        return feature_lineage(root, self.ds, summary)
