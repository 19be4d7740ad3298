"""Operators of the daily feature DAG that build the features (DuckDB).

On the embedded default the work runs in the task's process; the same functions run as
``python -m features.build`` container jobs elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from operators import config
from operators.errors import DataFailure

FEATURE_STEPS = ("daily", "window", "sequences", "examples")


class FeatureBuildOperator(BaseOperator):
    """Build one feature step of a day (DuckDB), written atomically; rerunning replaces that day only.

    :param step: one of ``daily``, ``window``, ``sequences``, ``examples``.
    :param ds: the partition day (templated).
    :param overrides: feature settings that win over ``config/platform.yaml`` (templated), e.g. from params.
    """

    template_fields: Sequence[str] = ("ds", "overrides")

    def __init__(self, *, step: str, ds: str, overrides: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if step not in FEATURE_STEPS:
            raise ValueError(f"unknown feature step {step!r}: choose one of {FEATURE_STEPS}")
        self.step = step
        self.ds = ds
        self.overrides = overrides or {}

    def execute(self, context: Context) -> dict[str, Any]:
        from features import build

        settings = {**config.section("features"), **{k: v for k, v in self.overrides.items() if v is not None}}
        root = config.storage_root()
        engine = build.DuckDBSettings(
            threads=int(settings["duckdb_threads"]),
            memory_limit=str(settings["duckdb_memory_limit"]),
            temp_directory=str(settings.get("duckdb_temp_directory") or "") or None,
        )
        window_days = int(settings["window_days"])
        prior = float(settings["pin_prior_impressions"])
        try:
            if self.step == "daily":
                summary = build.build_daily(root, self.ds, engine=engine)
            elif self.step == "window":
                summary = build.build_window(
                    root, self.ds, window_days=window_days, prior_impressions=prior, engine=engine
                )
            elif self.step == "sequences":
                summary = build.build_sequences(
                    root, self.ds, sequence_length=int(settings["sequence_length"]),
                    window_days=window_days, engine=engine,
                )
            else:
                summary = build.build_examples(
                    root, self.ds, prior_impressions=prior,
                    negative_downsample=float(settings["negative_downsample"]),
                    seed=int(settings.get("negative_downsample_seed") or 0), engine=engine,
                )
        except (build.MissingInputError, build.InputDataError) as err:
            raise DataFailure(f"feature step {self.step} for ds={self.ds}: {err}") from err
        for dataset, meta in summary.items():
            # Days left out or computed on demand are named in the task log, not only in the metadata.
            if meta.get("missing_days") or meta.get("computed_from_raw"):
                self.log.warning(
                    "%s ds=%s: missing days %s, computed from raw %s",
                    dataset, self.ds, meta.get("missing_days"), meta.get("computed_from_raw", []),
                )
        self.log.info("%s ds=%s: %s", self.step, self.ds, summary)
        return summary
