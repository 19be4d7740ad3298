"""Operators of the daily feature DAG that guard its inputs: validate raw partitions and the feature window.

The validation runs in the task's process on the embedded default; ``python -m features.validate`` is
the same check as a container job, with the same thresholds. The thresholds, quarantine and the window gap
policy come from the ``validation:`` section of the platform configuration (``core.config``), read once and
passed down. A partition that fails raises ``core.failures.DataError`` (no retry; its day is not built);
an invalid ``validation:`` setting is the platform configuration's ``ConfigError``, a ``UserError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, BaseOperatorLink, Context
from airflow.sdk.types import TaskInstanceKey

from core.failures import DataError
from operators.sensors import RawPartitionSensor, RawPartitionTrigger

__all__ = [
    "DataDocsLink",
    "gate_on_validations",
    "RawPartitionSensor",
    "RawPartitionTrigger",
    "ValidatePartitionOperator",
    "WindowGapCheckOperator",
]


def data_docs_url(root: str, dataset: str, ds: str) -> str:
    """The http(s) URL of a partition's validation page (its GX Data Docs when rendered, else the report's HTML),
    served by pinflow's plugin from the storage root (``operators.links``): the UI shows no ``file://`` link."""
    from operators import links

    return links.data_docs_url(dataset, ds)


class DataDocsLink(BaseOperatorLink):
    """The "Data Docs" button of a validation task: the GX Data Docs page of the partition it validated."""

    name = "Data Docs"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        # Airflow 3 calls this on the worker when the task ends (success or failure) and stores the URL in
        # XCom, which the API server reads (the link is an XComOperatorLink there: no ``operators`` list, or the
        # API server would call this on the serialized operator, which has none of these attributes); the
        # execute() of this try has set the URL of the page it wrote.
        from core import config

        url = getattr(operator, "data_docs_url", None)
        if url:
            return str(url)
        dataset, ds = getattr(operator, "dataset", None), getattr(operator, "ds", None)
        if not dataset or not ds:
            return ""
        return data_docs_url(config.load().storage_root, str(dataset), str(ds))


class ValidatePartitionOperator(BaseOperator):
    """Validate one raw partition (Great Expectations suite and history checks); a failure stops the day.

    The report (every check, observed value, threshold, pass/fail) and the partition's profile are written
    under ``reports/validation/``, and a short summary is pushed to XCom (key ``validation``) before a
    failure is raised, so the UI shows why. A failed partition is moved to ``quarantine/`` with its report
    (``validation.quarantine``) and the task fails with a ``DataError``: no retry; the day is not built
    (:func:`gate_on_validations`).

    :param dataset: ``events``, ``pins`` or ``users``.
    :param ds: the partition day (templated).
    :param shards: the feature build's shard count of the run (templated; empty: ``features.shards``): above 1,
        a passed events partition is also written bucketed for the shards (``features.event_buckets`` files).
    """

    template_fields: Sequence[str] = ("ds", "shards")
    ui_color = "#fde8c8"
    operator_extra_links = (DataDocsLink(),)

    def __init__(self, *, dataset: str, ds: str, shards: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataset = dataset
        self.ds = ds
        self.shards = shards
        self.data_docs_url: str | None = None
        self._checks: list[tuple[str, bool]] = []

    def execute(self, context: Context) -> dict[str, Any]:
        from core import config
        from features.validate import validate_partition
        from operators.features import with_run_params

        cfg = config.load()
        section = cfg.validation
        shards = with_run_params(cfg.features, {}, self.shards).shards  # a bad form value: a USER error, before any check
        report = validate_partition(
            cfg.storage_root,
            self.dataset,
            self.ds,
            config=section,
            data_docs=section.data_docs,
            quarantine=section.quarantine,
            event_buckets=cfg.features.event_buckets if shards > 1 else 0,
        )
        self.data_docs_url = data_docs_url(cfg.storage_root, self.dataset, self.ds)
        self._checks = [(c.name, bool(c.success)) for c in report.checks if c.success is not None]
        summary = report.summary()
        context["ti"].xcom_push(key="validation", value=summary)
        for warning in report.warnings:
            self.log.warning("%s", warning)
        self.log.info("validation report: %s; Data Docs: %s", report.report_path, self.data_docs_url)
        if not report.success:
            raise DataError(report.failure_message())
        return summary

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage (the provider's listener): the raw partition in, with the checks' outcomes as data-quality
        assertions; its validation report out (``operators.lineage``)."""
        from core import config
        from operators.lineage import validation_lineage

        return validation_lineage(config.load().storage_root, self.dataset, self.ds, self._checks)



def gate_on_validations(context: Context, ds: str, task_ids: Sequence[str]) -> None:
    """The day's first build step, after the day's validations however they ended (its trigger rule is all_done):
    returns when every one passed (the step builds).

    When one failed and the day's raw events were quarantined, raises AirflowSkipException: the step and the build's
    next steps are skipped rather than left ``upstream_failed``, for the next day's build waits for this day's
    (``depends_on_past`` accepts success or skipped) and would wait for ever; skipped, the next
    days build over it as a day without events (``validation.on_window_gap``: proceed records it in ``missing_days``,
    fail fails the next day's validate_window naming it). The failed validation still fails the run (the
    ``validations_passed`` leaf). Any other failure (another partition quarantined, whose day the next days' features
    still read; a validation that could not run) raises DataError: the next days wait for this day's rerun.
    """
    from airflow.sdk.exceptions import AirflowSkipException

    from core import config, storage
    from core.contracts import RAW_EVENTS
    from features.validation.report import quarantine_records

    run, ti = context["dag_run"], context["ti"]
    upstream = sorted(task_ids)
    states = ti.get_task_states(dag_id=run.dag_id, task_ids=upstream, run_ids=[run.run_id]).get(run.run_id) or {}
    failed = [f"{task} ({states.get(task)})" for task in upstream if states.get(task) != "success"]
    if not failed:
        return
    root = config.load().storage_root
    if not storage.is_complete(root, RAW_EVENTS, ds) and quarantine_records(root, "events", ds):
        raise AirflowSkipException(
            f"ds={ds}: {', '.join(failed)}; its raw events were quarantined: the day's build is skipped, so that the "
            "next days build over it as a day without events (validation.on_window_gap). To build this day: land "
            "fixed events, then clear this run (the days after it keep what they built without it until they are "
            "rebuilt too)"
        )
    raise DataError(
        f"ds={ds}: {', '.join(failed)}: nothing is built, and the next days' builds wait for this day (they read its "
        "features). Fix what the failed task's log says (a quarantined partition: land it "
        "again), then clear this run"
    )


class WindowGapCheckOperator(BaseOperator):
    """Check the feature window of ``ds`` for gaps: days whose raw events are missing or quarantined.

    ``validation.on_window_gap``: ``fail`` fails the day with a ``DataError`` (nothing downstream runs);
    ``proceed`` logs a warning, pushes the gap to XCom (key ``window_gaps``) and lets the build run: the
    window features record the same days in ``missing_days`` of their ``_metadata.json``.

    :param ds: the partition day (templated).
    """

    template_fields: Sequence[str] = ("ds",)
    ui_color = "#fde8c8"

    def __init__(self, *, ds: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ds = ds

    def execute(self, context: Context) -> dict[str, Any]:
        from core import config, storage
        from features.validation.window import window_gaps

        cfg = config.load()
        policy = cfg.validation.on_window_gap
        window_days = cfg.features.window_days
        gaps = window_gaps(cfg.storage_root, self.ds, window_days)
        gaps["policy"] = policy
        context["ti"].xcom_push(key="window_gaps", value=gaps)
        if not gaps["gaps"]:
            start, first = gaps["window_start"], gaps["history_start"]
            # A world's first days: the window reaches before the raw events start, which is not a gap.
            before = storage.day_range(start, storage.shift_ds(first, -1)) if first is not None and first > start else []
            self.log.info("the %d-day window of ds=%s has no gap%s", window_days, self.ds, (
                f" (the raw events start at {first}: {storage.day_spans(before)} before them are not gaps, and the "
                "window features record them as missing_days)") if before else "")
            return gaps
        message = (
            f"the {window_days}-day window of ds={self.ds} has {len(gaps['gaps'])} day(s) without validated raw "
            f"events: {storage.day_spans(gaps['gaps'])}"
            + (f" (quarantined: {storage.day_spans(gaps['quarantined'])})" if gaps["quarantined"] else "")
        )
        if policy == "fail":
            raise DataError(
                f"{message}.\nFix: land those days again and clear their pin_daily_features runs, or set "
                "validation.on_window_gap=proceed (PINFLOW_VALIDATION__ON_WINDOW_GAP=proceed) to build with the "
                "gap recorded in the window features' missing_days."
            )
        self.log.warning("%s; proceeding (validation.on_window_gap=proceed): missing_days records them", message)
        return gaps
