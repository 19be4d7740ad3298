"""Operators of the daily feature DAG that guard its inputs: wait for raw partitions, validate them.

The validation runs in the task's process on the embedded default; ``python -m features.validate`` is
the same check as a container job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, BaseSensorOperator, Context

from operators import config
from operators.errors import DataFailure


class RawPartitionSensor(BaseSensorOperator):
    """Wait until every raw partition of the day has its completion marker.

    :param datasets: raw datasets to wait for, e.g. ``["raw/events", "raw/pins"]``.
    :param ds: the partition day, YYYY-MM-DD (templated).
    """

    template_fields: Sequence[str] = ("ds",)

    def __init__(self, *, datasets: Sequence[str], ds: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.datasets = list(datasets)
        self.ds = ds

    def poke(self, context: Context) -> bool:
        from features.storage import is_complete, partition_path

        root = config.storage_root()
        missing = [d for d in self.datasets if not is_complete(root, d, self.ds)]
        for dataset in missing:
            self.log.info("waiting for %s (no _SUCCESS marker yet)", partition_path(root, dataset, self.ds))
        return not missing


class ValidatePartitionOperator(BaseOperator):
    """Validate one raw partition with its Great Expectations suite; a failure stops the day.

    The report (every check, observed value, pass/fail) is written under ``reports/validation/`` and a
    short summary is pushed to XCom before a failure is raised, so the UI shows why.

    :param dataset: ``events``, ``pins`` or ``users``.
    :param ds: the partition day (templated).
    """

    template_fields: Sequence[str] = ("ds",)
    ui_color = "#fde8c8"

    def __init__(self, *, dataset: str, ds: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataset = dataset
        self.ds = ds

    def execute(self, context: Context) -> dict[str, Any]:
        from features.validate import validate_partition

        report = validate_partition(config.storage_root(), self.dataset, self.ds)
        summary = report.summary()
        context["ti"].xcom_push(key="validation", value=summary)
        self.log.info("validation report: %s", report.report_path)
        if not report.success:
            raise DataFailure(report.failure_message())
        return summary
