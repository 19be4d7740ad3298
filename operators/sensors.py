"""Wait for raw partitions: a deferrable sensor and the trigger it defers to.

The sensor checks once on the worker; if a partition is still missing it hands the waiting to the
triggerer (``RawPartitionTrigger``, which serializes only its arguments) and frees the worker slot. When
the partitions do not all land before the sensor's timeout, the task fails as a ``DATA`` failure
(``core.failures.DataError``) naming each missing partition and what is missing (the folder, or its
``_SUCCESS`` marker). The storage root may be a local folder or an object store (``s3://...``): the check
goes through ``core.storage``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.sdk import BaseSensorOperator, Context
from airflow.triggers.base import BaseTrigger, TriggerEvent

from core.failures import DataError
from operators.triggers import not_before


def missing_partitions(root: str, datasets: Sequence[str], ds: str) -> dict[str, str]:
    """Dataset -> what is missing, for every partition of ``ds`` without its completion marker."""
    from core import storage

    missing: dict[str, str] = {}
    for dataset in datasets:
        if storage.is_complete(root, dataset, ds):
            continue
        path = storage.partition(root, dataset, ds)
        if not storage.is_dir(path):
            missing[dataset] = f"{path} does not exist"
        else:
            files = storage.glob(storage.resolve(path), "*.parquet")
            missing[dataset] = f"no {storage.MARKER} marker in {path} ({len(files)} Parquet file(s) so far)"
    return missing


class RawPartitionTrigger(BaseTrigger):
    """Fire when every raw partition of ``ds`` has its marker, or at ``timeout_at`` with what is missing.

    :param root: the storage root.
    :param datasets: e.g. ``["raw/events", "raw/pins"]``.
    :param ds: the partition day, YYYY-MM-DD.
    :param poke_interval: seconds between checks.
    :param timeout_at: ISO UTC time at which to give up (None: wait for ever; the task's defer timeout applies).
    """

    def __init__(
        self,
        root: str,
        datasets: Sequence[str],
        ds: str,
        poke_interval: float = 30.0,
        timeout_at: str | None = None,
    ) -> None:
        super().__init__()
        self.root = root
        self.datasets = list(datasets)
        self.ds = ds
        self.poke_interval = float(poke_interval)
        self.timeout_at = timeout_at

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "root": self.root,
                "datasets": list(self.datasets),
                "ds": self.ds,
                "poke_interval": self.poke_interval,
                "timeout_at": self.timeout_at,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        started = time.monotonic()
        deadline = dt.datetime.fromisoformat(self.timeout_at) if self.timeout_at else None
        while True:
            # Stat calls (local) and HEAD / LIST requests (object store) block: in a thread they never block
            # the triggerer's event loop.
            missing = await asyncio.to_thread(missing_partitions, self.root, self.datasets, self.ds)
            if not missing:
                await not_before(self, started)
                yield TriggerEvent({"status": "success", "ds": self.ds, "missing": {}})
                return
            if deadline is not None and dt.datetime.now(dt.UTC) >= deadline:
                await not_before(self, started)
                yield TriggerEvent({"status": "timeout", "ds": self.ds, "missing": missing})
                return
            self.log.info("ds=%s still waiting for %s", self.ds, sorted(missing))
            await asyncio.sleep(self.poke_interval)


class RawPartitionSensor(BaseSensorOperator):
    """Wait until every raw partition of the day has its completion marker.

    With ``deferrable=True`` the waiting runs in the triggerer (``RawPartitionTrigger``); otherwise the
    sensor pokes in its own mode. A partition that has not landed after ``timeout`` seconds fails the task
    with a ``DataError`` naming it. ``poke_interval`` and ``timeout`` default to
    ``validation.sensor_poke_seconds`` and ``validation.sensor_timeout_seconds`` of the platform configuration.

    :param datasets: raw datasets to wait for, e.g. ``["raw/events", "raw/pins"]``.
    :param ds: the partition day, YYYY-MM-DD (templated).
    :param deferrable: defer to the triggerer while waiting.
    """

    template_fields: Sequence[str] = ("ds",)

    def __init__(self, *, datasets: Sequence[str], ds: str, deferrable: bool = False, **kwargs: Any) -> None:
        if "poke_interval" not in kwargs or "timeout" not in kwargs:
            from core import config

            section = config.load().validation
            kwargs.setdefault("poke_interval", section.sensor_poke_seconds)
            kwargs.setdefault("timeout", section.sensor_timeout_seconds)
        super().__init__(**kwargs)
        self.datasets = list(datasets)
        self.ds = ds
        self.deferrable = deferrable

    def log_what_a_rebuild_waits_for(self, context: Context) -> None:
        """A manual run of another day than its logical date (the form's ``ds``; the logical date is when it was
        triggered unless the form sets it) has build steps with ``depends_on_past``: they wait for the run before that logical date,
        e.g. the daily run that unpausing started, still waiting for its day's data. Say so first, and how to
        rebuild the day at once."""
        dag_run, logical = context.get("dag_run"), context.get("logical_date")
        run_type = getattr(dag_run, "run_type", "")
        if logical is None or str(getattr(run_type, "value", run_type)) != "manual":
            return
        named = logical.date().isoformat()
        if named != self.ds:
            self.log.warning(
                "This run builds ds=%s but is dated %s (its logical date: when it was triggered). Its build steps "
                "(daily_sequences_examples, window_features) wait until the DAG's run before %s has finished "
                "them (depends_on_past: each day extends the day before), for example the daily run that unpausing "
                "the DAG started, which waits up to %.0f h for its day's raw data. To rebuild %s at once, trigger "
                "again with the form's Logical date set to %sT00:00:00Z and ds empty: the run is then dated that "
                "day and waits only for the day before it; or mark that waiting run's tasks skipped.",
                self.ds, named, named, float(self.timeout) / 3600, self.ds, self.ds)

    def poke(self, context: Context) -> bool:
        from core import config

        missing = missing_partitions(config.load().storage_root, self.datasets, self.ds)
        for dataset, what in missing.items():
            self.log.info("waiting for %s ds=%s: %s", dataset, self.ds, what)
        return not missing

    def execute(self, context: Context) -> Any:
        from core import config
        from operators.run_conf import check_run_conf

        check_run_conf(context)  # a typo in the trigger's conf fails here, not after hours of waiting for a default
        self.log_what_a_rebuild_waits_for(context)
        if not self.deferrable:
            return super().execute(context)
        if self.poke(context):
            return None
        timeout_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=float(self.timeout))
        self.defer(
            trigger=RawPartitionTrigger(
                root=config.load().storage_root,
                datasets=self.datasets,
                ds=self.ds,
                poke_interval=float(self.poke_interval),
                timeout_at=timeout_at.isoformat(),
            ),
            method_name="execute_complete",
            # A margin over the trigger's own deadline: the trigger's event carries the clearer message.
            timeout=dt.timedelta(seconds=float(self.timeout) + 2 * float(self.poke_interval) + 60),
        )

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> None:
        event = event or {}
        if event.get("status") == "success":
            self.log.info("raw partitions of ds=%s landed: %s", self.ds, self.datasets)
            return
        missing = event.get("missing") or {}
        lines = "\n".join(f"  - {dataset}: {what}" for dataset, what in sorted(missing.items()))
        raise DataError(
            f"raw partitions of ds={self.ds} did not land within {self.timeout:.0f} s "
            f"(validation.sensor_timeout_seconds):\n{lines}\n"
            "Fix: land each partition (data files, then its _SUCCESS marker) and clear this task."
        )
