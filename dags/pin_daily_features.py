"""Daily feature DAG: wait for raw partitions → validate → aggregates, sequences and examples (one job) → 30-day window."""

from __future__ import annotations

from datetime import timedelta

# The Airflow modules the operators below import, named so that the DAG processor imports them once, before
# it forks the parses (parsing_pre_import_modules), instead of in every parse (docs/architecture.md).
import airflow.sdk.bases.operatorlink  # noqa: F401
import airflow.sdk.bases.sensor  # noqa: F401
import airflow.sdk.definitions.retry_policy  # noqa: F401
import airflow.sdk.types  # noqa: F401
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import Param
from airflow.timetables.interval import CronDataIntervalTimetable

from core import config_view
from operators import deadlines
from operators.assets import EXAMPLES_ASSET
from operators.errors import default_args
from operators.features import AnnounceExamplesOperator, FeatureBuildOperator
from operators.sensors import RawPartitionSensor
from operators.validation import ValidatePartitionOperator, WindowGapCheckOperator

# The day a run builds: its data interval's, or the `ds` param of a run triggered from the form. A backfill
# builds each run's own day: the Backfill dialog offers the DAG's params too, and a `ds` given there would
# otherwise make every backfilled run rebuild that one day.
DS = "{{ ds if dag_run.run_type == 'backfill' else (params.ds or ds) }}"
_cfg = config_view.load()

with deadlines.DAG(  # Airflow's DAG; its test() runs without the deadline alerts (operators/deadlines.py)
    dag_id="pin_daily_features",
    doc_md="""
### Daily features

For the day `ds` (the run's data interval, or the `ds` param of a triggered run; a backfill ignores that param
and builds each run's own day): waits for the raw events, pins, users and
pin review labels partitions (deferrable), validates each with its Great Expectations suite and history checks (a failing
partition is moved to `quarantine/` and stops the day, and the run fails (quarantined events: the day's build is
skipped, so that the next days build over the gap; another partition: the next days wait for this day); each validation task
links to its Data Docs page), checks the 30-day window for quarantined or missing days
(`validation.on_window_gap`: fail or proceed), then builds with DuckDB in two jobs on the compute backend
(`features.backend`, else `training.backend`: a local process on the embedded default), each output written
atomically; with `shards` (form) or `features.shards` > 1 each job is an array job of that many shards (users and
pins by id hash), published together once all are built (a retry builds only the missing ones):

1. `daily_sequences_examples`, one job: `features/user_daily`, `features/pin_daily` (per-day aggregates),
   `features/user_sequence` (each user's last N engagements as of the end of `ds`) and `examples` (impressions of
   `ds` with labels, joined with features as of the end of `ds-1`);
2. `window_features`: `features/user_window`, `features/pin_window` — 30-day window as of the end of `ds` (a
   sharded day whose window is incremental has it built by the first job's shards already: this task then runs no
   job).

Rerunning a day replaces exactly that day. Backfill: `airflow backfill create --dag-id pin_daily_features
--from-date 2026-11-01 --to-date 2026-11-07 --reprocess-behavior completed`, or the UI's Backfill dialog. Airflow
runs a backfill only while the DAG is unpaused (the dialog's *unpause* box); unpausing also starts the daily
schedule, whose newest run (no catch-up) waits up to `validation.sensor_timeout_seconds` (6 h) for its day's raw
data. A last task, `announce_examples`, emits the `pinflow_examples` asset that training is scheduled on, for a
scheduled run or a manual run of the newest complete day only: a backfill, or a rebuild of an older day, does not
start training (trigger `pin_ranker_training` from its form to train on older days).
""",
    schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    max_active_runs=4,
    deadline=deadlines.alerts(_cfg, "pin_daily_features"),
    tags=["pinflow", "features"],
    default_args=default_args("data-eng", retry_delay=timedelta(minutes=2)),
    params={
        "ds": Param(None, type=["null", "string"], format="date", description="Build this day instead of the run's data interval (YYYY-MM-DD). Ignored by backfills: each backfilled run builds its own day. To rebuild a past day at once, leave this empty and set the Logical date to that day instead (00:00 UTC): the run is then dated that day and its build steps wait only for the day before it, not for a run dated later."),
        "negative_downsample": Param(None, type=["null", "number"], exclusiveMinimum=0, maximum=1.0, description=f"Keep this fraction of impressions without a label (empty: features.negative_downsample = {_cfg.features.negative_downsample})."),
        "sequence_length": Param(None, type=["null", "integer"], minimum=1, maximum=1000, description=f"Engagements kept per user sequence (empty: features.sequence_length = {_cfg.features.sequence_length})."),
        "shards": Param(None, type=["null", "integer"], minimum=1, maximum=10000, description=f"Split each of the day's two build jobs into this many shards by user / pin id hash (empty: features.shards = {_cfg.features.shards})."),
    },
    render_template_as_native_obj=True,
) as dag:
    wait = RawPartitionSensor(
        task_id="wait_for_raw",
        datasets=["raw/events", "raw/pins", "raw/users", "raw/pin_labels"],
        ds=DS,
        deferrable=True,
        poke_interval=_cfg.validation.sensor_poke_seconds,
        timeout=_cfg.validation.sensor_timeout_seconds,
    )
    shards = "{{ params.shards }}"
    validations = [
        # The events' validation also writes them bucketed when the run's build is sharded (its shards read those).
        ValidatePartitionOperator(task_id=f"validate_{name}", dataset=name, ds=DS, retries=0, shards=shards)
        for name in ("events", "pins", "users")
    ] + [WindowGapCheckOperator(task_id="validate_window", ds=DS, retries=0)]
    # The review labels feed the content model, not these features: a bad day of labels is quarantined
    # (so the content model never trains on it) without holding back the ranker's features.
    validate_labels = ValidatePartitionOperator(task_id="validate_pin_labels", dataset="pin_labels", ds=DS, retries=0)
    overrides = {
        "negative_downsample": "{{ params.negative_downsample }}",
        "sequence_length": "{{ params.sequence_length }}",
    }
    # Daily aggregates, sequences and examples of ds in one job (each shard starts once): none reads another's output
    # of ds (sequences extend ds-1's, examples join the features of ds-1). Runs however the validations ended: a day
    # whose events were quarantined is skipped with the window after it (not left upstream_failed), so that the next
    # days build over the gap; any other failure fails it. The failed validation still fails the run (the
    # validations_passed leaf). wait_for_downstream: in a backfill, wait for the day before's build and its window
    # (these examples read them; the sequences of ds-1 make the day's incremental, 30 times faster than a recompute).
    build = FeatureBuildOperator(
        task_id="daily_sequences_examples", step="daily_sequences_examples", ds=DS, overrides=overrides, shards=shards,
        gated=True, wait_for_downstream=True,
    )
    # The window of ds is that of ds-1 plus ds minus the day that leaves (a full sum when ds-1's is missing, or when
    # a day it summed is not there yet and has to be computed from raw): it reads the day's merged aggregates.
    window = FeatureBuildOperator(task_id="window_features", step="window", ds=DS, shards=shards, depends_on_past=True)

    wait >> validations >> build >> window >> AnnounceExamplesOperator(
        task_id="announce_examples", ds=DS, outlets=[EXAMPLES_ASSET])
    validations >> EmptyOperator(task_id="validations_passed")
    wait >> validate_labels
