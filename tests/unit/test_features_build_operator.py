"""FeatureBuildOperator: each step is a job on a compute backend (a local process here), config and param overrides
reach ``features.build`` in its typed spec (BUILD.json, ``features.spec.BuildSpec``), a sharded step is an array job whose shards are merged, a retry
builds only the missing shards, and the job's failure class reaches the task."""

from __future__ import annotations

import logging
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core import config, contracts, storage
from core.config import FeaturesConfig, PlatformConfig
from core.failures import ConfigError, DataError, FailureClass
from features.spec import BuildSpec
from features.synthetic import WorldConfig, generate_world
from operators.features import FeatureBuildOperator, build_job_spec, build_spec, memory_gb

DAY = "2026-11-01"
SETTINGS = {
    "window_days": 14,
    "sequence_length": 50,
    "pin_prior_impressions": 10.0,
    "negative_downsample": 1.0,
    "negative_downsample_seed": 5,
    "duckdb_threads": 1,
    "duckdb_memory_limit": "1GB",
    "poll_seconds": 0.2,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("world")
    generate_world(root, WorldConfig(start=DAY, days=1, users=40, pins=50, seed=2, active_rate=0.9))
    return root


@pytest.fixture
def platform(world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PlatformConfig:
    """A storage root holding one raw day, and a home for the local backend's job folders."""
    root = tmp_path / "storage"
    shutil.copytree(world / "raw", root / "raw")
    cfg = PlatformConfig(storage_root=str(root), home=str(tmp_path / "home"), features=FeaturesConfig(**SETTINGS))
    monkeypatch.setattr(config, "load", lambda: cfg)
    return cfg


def context(try_number: int = 1) -> Any:
    ti = SimpleNamespace(dag_id="pin_daily_features", run_id="manual__1", task_id="daily_aggregates", map_index=-1,
                         try_number=try_number)
    return {"ti": ti}


@pytest.mark.unit
def test_the_spec_carries_every_setting_and_the_overrides_and_the_flags_build_the_same(tmp_path: Path) -> None:
    from features import build

    features = FeaturesConfig(**SETTINGS).model_copy(update={"negative_downsample": 0.25, "duckdb_temp_directory": "/spill"})
    spec = build_spec("/data", DAY, "examples", features, skip_validation=True)
    assert spec.model_dump() == {
        "root": "/data", "ds": DAY, "step": "examples", "window_days": 14, "sequence_length": 50,
        "pin_prior_impressions": 10.0, "negative_downsample": 0.25, "negative_downsample_seed": 5, "duckdb_threads": 1,
        "duckdb_memory_limit": "1GB", "duckdb_temp_directory": "/spill", "recompute": False, "skip_validation": True,
        "shards": 1, "staging": "", "merge": False,
    }
    path = str(tmp_path / "BUILD.json")
    spec.write(path)
    flags = ["--root", "/data", "--ds", DAY, "--step", "examples", "--window-days", "14", "--sequence-length", "50",
             "--prior-impressions", "10", "--negative-downsample", "0.25", "--seed", "5", "--threads", "1",
             "--memory-limit", "1GB", "--temp-directory", "/spill", "--skip-validation"]
    parser = build._parser(features)
    assert build.spec_of(parser.parse_args(["--spec", path]), features) == spec == build.spec_of(
        parser.parse_args(flags), features)
    with pytest.raises(ConfigError, match="give the spec or the flags, not both"):
        build.spec_of(parser.parse_args(["--spec", path, "--ds", DAY]), features)
    (tmp_path / "BUILD.json").write_text('{"root": "/data", "ds": "2026-11-31", "windowdays": 3}')
    with pytest.raises(ConfigError, match=r"BUILD.json is invalid: unknown key 'windowdays'"):
        BuildSpec.read(path)
    with pytest.raises(ConfigError, match=r"x is invalid: negative_downsample = 0.0: Input should be greater than 0"):
        BuildSpec.checked("x", root="/data", ds=DAY, negative_downsample=0)
    with pytest.raises(ConfigError, match="a sharded build needs one step"):
        BuildSpec.checked("x", root="/data", ds=DAY, shards=2)
    assert memory_gb("4GB") == 4.0 and memory_gb("512MiB") == pytest.approx(0.537, abs=1e-3)
    with pytest.raises(ConfigError, match="features.duckdb_memory_limit: 'lots' is not a memory size"):
        memory_gb("lots")


def run_shards(plan: Any, shards: str, folder: Path) -> int:
    """The build job of a plan's shards, run here: its BUILD.json written as the operator writes it."""
    from features import build

    path = folder / f"BUILD-{shards}.json"
    plan.spec.write(str(path))
    return build.main(["--spec", str(path), "--run-shards", shards])


@pytest.mark.unit
def test_a_sharded_step_is_an_array_job_of_the_missing_shards() -> None:
    from operators.backends.batch import BatchBackend
    from operators.backends.resources import Catalog

    cfg = PlatformConfig(storage_root="s3://bucket/pinflow", features=FeaturesConfig(**SETTINGS))
    command = ["-m", "features.build", "--spec", "s3://bucket/pinflow/runs/features-x/BUILD.json"]
    spec = build_job_spec(command, name="features-x", shards=[0, 2, 3, 7], cfg=cfg, features=cfg.features, backend="batch")
    assert (spec.array_size, spec.command[-2:]) == (4, ["--run-shards", "0,2-3,7"])
    assert (spec.cpus_per_node, spec.memory_gb_per_node, spec.instance_type) == (1, 1.5, "m5.2xlarge")
    submit = BatchBackend(cfg.batch, cfg.teams, Catalog.from_config(cfg)).dry_run(spec)["submit"]
    assert submit["arrayProperties"] == {"size": 4}
    assert submit["containerOverrides"]["command"] == ["python", *spec.command]
    unsharded = build_job_spec(command, name="features-x", shards=[], cfg=cfg, features=cfg.features, backend="batch")
    assert unsharded.array_size == 0 and "--run-shards" not in unsharded.command
    # A shard of the DAG's first job runs three steps side by side on its one DuckDB limit: each its Arrow batches.
    group = build_job_spec(command, name="features-x", shards=[0], cfg=cfg, features=cfg.features, backend="batch",
                           side_by_side=3)
    assert group.memory_gb_per_node == 2.5


@pytest.mark.unit
def test_a_step_runs_as_a_local_job_unsharded_and_sharded(platform: PlatformConfig, caplog: pytest.LogCaptureFixture) -> None:
    root = platform.storage_root
    op = FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, skip_validation=True, deferrable=False)
    summary = op.execute(context())
    assert summary[contracts.USER_DAILY]["rows"] == storage.read_table(root, contracts.USER_DAILY, DAY).num_rows > 0
    whole = {d: storage.read_table(root, d, DAY) for d in (contracts.USER_DAILY, contracts.PIN_DAILY)}
    jobs = sorted(p.name for p in (Path(platform.home) / "jobs").iterdir())
    assert len(jobs) == 1 and jobs[0].startswith("features-daily-aggregates-pin-daily-features")

    sharded = FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, skip_validation=True,
                                   shards=3, deferrable=False)
    with caplog.at_level(logging.INFO, logger="operators.jobs"):
        summary = sharded.execute(context(try_number=2))
    # While the array job runs, the task log counts its shards built (each count once), the last at its end.
    counts = [int(m[1]) for m in re.finditer(r"job \S+: (\d) of 3 shard\(s\) built", caplog.text)]
    assert counts == sorted(set(counts)) and counts[-1] == 3, caplog.text
    for dataset, key in ((contracts.USER_DAILY, "user_id"), (contracts.PIN_DAILY, "pin_id")):
        assert summary[dataset]["shards"] == 3
        assert len(storage.data_files(root, dataset, DAY)) == 3
        assert storage.read_table(root, dataset, DAY).sort_by(key).equals(whole[dataset].sort_by(key))
    assert not any(Path(root, "_staging").rglob("*.parquet"))
    assert not Path(root, "_staging", "features", "daily").exists()  # no empty folders left for the day
    # Each child's log says which shard it built (what the job page shows of a job that succeeded).
    from operators.backends import get_backend

    logs = get_backend("local", platform).logs(sharded.job_name(context(), 2))
    assert all(f"building daily of ds={DAY}, shard {i} of 3" in logs for i in range(3)), logs
    # The same try again (its worker lost after the merge published, or `airflow tasks test` of the run): it finds its
    # job ended and its shards merged already, and returns what was published without a job or a failure.
    assert sharded.execute(context(try_number=2)) == summary
    assert len(list((Path(platform.home) / "jobs").iterdir())) == 2


@pytest.mark.unit
def test_a_retry_builds_only_the_missing_shards(platform: PlatformConfig, tmp_path: Path) -> None:
    from features import sharding

    root = platform.storage_root
    op = FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, skip_validation=True, shards=3,
                              deferrable=False)
    plan = op._plan(context())
    # The first try built shard 1 and then was lost.
    assert run_shards(plan, "1", tmp_path) == 0
    built = Path(sharding.shard_folder(plan.staging, contracts.USER_DAILY, 1), sharding.shard_file(1))
    before = built.stat().st_mtime_ns
    op.execute(context(try_number=2))
    requests = [storage.read_json(str(p)) for p in (Path(platform.home) / "jobs").glob("*/request.json")]
    assert [r["nodes"][0]["argv"][-1] for r in requests] == ["0,2"]  # the retry's array job: shards 0 and 2 only
    assert storage.read_metadata(root, contracts.USER_DAILY, DAY)["shards"] == 3
    assert before == Path(root, contracts.USER_DAILY, f"ds={DAY}", sharding.shard_file(1)).stat().st_mtime_ns


@pytest.mark.unit
def test_a_merge_removes_sharded_builds_abandoned_long_ago_and_keeps_recent_ones(platform: PlatformConfig,
                                                                                 tmp_path: Path) -> None:
    import os
    import time


    def staged_by(run_id: str, written_s_ago: float) -> Path:
        """Shard 0 of the same step and day built by another run (which then failed), last written that long ago."""
        ctx = context()
        ctx["ti"].run_id = run_id
        plan = FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, skip_validation=True, shards=2,
                                    deferrable=False)._plan(ctx)
        assert plan.staging is not None
        assert run_shards(plan, "0", tmp_path) == 0
        stamp = time.time() - written_s_ago
        for path in [Path(plan.staging), *Path(plan.staging).rglob("*")]:
            os.utime(path, (stamp, stamp))
        return Path(plan.staging)

    timeout = platform.features.timeout_seconds
    abandoned, recent = staged_by("failed_run", 2.5 * timeout), staged_by("running_run", 0.5 * timeout)
    FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, skip_validation=True, shards=3,
                         deferrable=False).execute(context())
    assert storage.read_metadata(platform.storage_root, contracts.USER_DAILY, DAY)["shards"] == 3
    assert not abandoned.exists() and recent.exists()  # and this run's own staging folder is gone:
    assert sorted(p.name for p in recent.parent.iterdir()) == [recent.name]


@pytest.mark.unit
def test_a_retry_waits_for_the_job_an_earlier_try_left_running(platform: PlatformConfig, tmp_path: Path) -> None:

    from operators.backends import get_backend

    op = FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, skip_validation=True, deferrable=False)
    path = str(tmp_path / "BUILD.json")
    op._plan(context()).spec.write(path)
    # Try 1 submitted its job (slowed down, so that it still runs when try 2 starts) and then its worker was lost.
    slow = ["-c", "import runpy, sys, time; time.sleep(2); sys.argv = ['features.build', *sys.argv[1:]]; "
            "runpy.run_module('features.build', run_name='__main__')", "--spec", path]
    spec = build_job_spec(slow, name=op.job_name(context(), 1),
                          shards=[], cfg=platform, features=platform.features, backend="local")
    get_backend("local", platform).submit(spec)
    summary = op.execute(context(try_number=2))
    assert summary[contracts.USER_DAILY]["rows"] > 0
    assert [p.name for p in (Path(platform.home) / "jobs").iterdir()] == [spec.name]  # no second job


@pytest.mark.unit
def test_an_unvalidated_input_fails_the_task_as_data_naming_the_command(platform: PlatformConfig) -> None:
    op = FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, deferrable=False)
    with pytest.raises(DataError, match=r"raw/events/ds=2026-11-01 .*python -m features.validate events") as err:
        op.execute(context())
    assert err.value.failure_class is FailureClass.DATA
    assert not storage.is_complete(platform.storage_root, contracts.USER_DAILY, DAY)


@pytest.mark.unit
def test_a_bad_param_fails_as_user_error_before_any_job(platform: PlatformConfig) -> None:
    op = FeatureBuildOperator(task_id="examples", step="examples", ds=DAY, overrides={"negative_downsample": 5},
                              deferrable=False)
    with pytest.raises(ConfigError, match="the run's params: features.negative_downsample = 5: .*less than or equal to 1") as err:
        op.execute(context())
    assert err.value.failure_class is FailureClass.USER
    assert not (Path(platform.home) / "jobs").exists()
    with pytest.raises(ConfigError, match="features.shards = 0"):
        FeatureBuildOperator(task_id="daily", step="daily", ds=DAY, shards=0, deferrable=False).execute(context())


@pytest.mark.unit
def test_the_job_runs_with_this_interpreter() -> None:
    from operators.backends.local import LocalBackend

    cfg = PlatformConfig(storage_root="/data", features=FeaturesConfig(**SETTINGS))
    spec = build_job_spec(["-m", "features.build", "--spec", "/data/runs/features-y/BUILD.json"], name="features-y",
                          shards=[], cfg=cfg, features=cfg.features, backend="local")
    request = LocalBackend("/tmp/unused").dry_run(spec)
    assert request["nodes"][0]["argv"][:3] == [sys.executable, "-m", "features.build"]


def test_only_a_run_of_the_newest_day_announces_examples_to_training(platform: PlatformConfig, monkeypatch) -> None:
    """Training is scheduled on the examples asset: a backfill, or a rebuild of an older day, must not start it."""
    from airflow.sdk.exceptions import AirflowSkipException

    from operators.features import announce_examples

    days = ["2026-11-01", "2026-11-02"]
    root = platform.storage_root
    for ds in days:
        with storage.publish(storage.partition(root, contracts.EXAMPLES, ds)) as folder:
            storage.write_json(storage.join(folder, "part-00000.json"), {"ds": ds})
    assert storage.complete_days(root, contracts.EXAMPLES) == days
    assert announce_examples("2026-11-02", "scheduled") == {"ds": "2026-11-02"}
    assert announce_examples("2026-11-02", "manual") == {"ds": "2026-11-02"}
    with pytest.raises(AirflowSkipException, match="a backfill does not trigger training"):
        announce_examples("2026-11-02", "backfill")
    with pytest.raises(AirflowSkipException, match="newest complete examples day is 2026-11-02"):
        announce_examples("2026-11-01", "manual")


@pytest.mark.unit
def test_a_run_created_again_under_the_same_id_builds_anew_instead_of_adopting_the_earlier_runs_job(
        platform: PlatformConfig) -> None:
    """The demo deletes and creates its runs again under the same ids: the ended job of the earlier run holds the
    try's name, and was built with that run's settings; it is never adopted."""
    import datetime as dt

    from operators.backends import get_backend

    def run_context(started: dt.datetime) -> Any:
        return {**context(), "dag_run": SimpleNamespace(start_date=started)}

    op = FeatureBuildOperator(task_id="daily_aggregates", step="daily", ds=DAY, skip_validation=True, deferrable=False)
    op.execute(run_context(dt.datetime.now(dt.UTC)))
    marker = Path(storage.partition(platform.storage_root, contracts.USER_DAILY, DAY), storage.MARKER)
    first = marker.stat().st_mtime_ns
    jobs = Path(platform.home) / "jobs"
    before = {p.name for p in jobs.iterdir()}
    # The same run, restarted (its try re-run): the job it submitted is adopted, nothing is built again.
    op.execute(run_context(dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)))
    assert {p.name for p in jobs.iterdir()} == before and marker.stat().st_mtime_ns == first
    # The run created again: a job of its own, which builds the day again.
    op.execute(run_context(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)))
    new = {p.name for p in jobs.iterdir()} - before
    assert list(new) == [op.job_name(context(), 1, again=1)]
    assert get_backend("local", platform).status(op.job_name(context(), 1, again=1)).state.value == "SUCCEEDED"
    assert marker.stat().st_mtime_ns != first  # published again


def test_the_window_task_checks_the_gaps_again_before_it_builds(tmp_path: Path, monkeypatch) -> None:
    """validation.on_window_gap: fail. In a backfill the next day's validate_window can look before the day before is
    quarantined; its build tasks (which wait for that day's) look again, and refuse to build over the gap."""
    import pyarrow as pa

    root = tmp_path / "root"
    for day in ("2026-11-01", "2026-11-03"):  # landed (the gap check looks at the markers only)
        storage.write_table(root, contracts.RAW_EVENTS, day, pa.Table.from_pylist([], schema=contracts.EVENTS_SCHEMA))
    (root / "quarantine" / "events" / "ds=2026-11-02" / "20261103T000000Z").mkdir(parents=True)
    cfg = PlatformConfig(storage_root=str(root), validation={"on_window_gap": "fail"})
    monkeypatch.setattr(config, "load", lambda: cfg)
    task = FeatureBuildOperator(task_id="window_features", step="window", ds="2026-11-03")
    with pytest.raises(DataError, match=r"1 day\(s\) without validated raw events: 2026-11-02 .*found when window "
                       "was about to be built"):
        task._check_window_gaps()
    # The DAG's first job too: its examples join the features of the day before.
    first = FeatureBuildOperator(task_id="daily_sequences_examples", step="daily_sequences_examples", ds="2026-11-03")
    with pytest.raises(DataError, match=r"2026-11-02 .*found when daily_sequences_examples was about to be built"):
        first.before_submit({}, None, None)  # type: ignore[arg-type]
    monkeypatch.setattr(config, "load", lambda: cfg.model_copy(update={"validation": cfg.validation.model_copy(
        update={"on_window_gap": "proceed"})}))
    task._check_window_gaps()  # proceed: built over it, recorded in missing_days



@pytest.mark.unit
def test_the_window_task_runs_no_job_when_the_first_jobs_shards_built_the_window(
    platform: PlatformConfig, tmp_path: Path
) -> None:
    """A sharded day whose events were bucketed with their counts (validation, for sharded builds) and whose window
    can be incremental: daily_sequences_examples's shards build the window too, and the window task only reads it."""
    from features import build
    from features.bucketed_events import write_event_buckets
    from features.synthetic import generate_world

    root = platform.storage_root
    day = storage.shift_ds(DAY, 1)
    generate_world(tmp_path / "next", WorldConfig(start=DAY, days=2, users=40, pins=50, seed=2, active_rate=0.9))
    for dataset in (contracts.RAW_EVENTS, contracts.RAW_PINS):
        shutil.copytree(Path(storage.partition(tmp_path / "next", dataset, day)), Path(storage.partition(root, dataset, day)))
    build.build_day(root, DAY, window_days=14, require_validation=False)
    write_event_buckets(root, day, 4)
    jobs = Path(platform.home) / "jobs"

    def run(task_id: str, step: str, try_number: int = 1) -> dict[str, Any]:
        ti = SimpleNamespace(dag_id="pin_daily_features", run_id="manual__1", task_id=task_id, map_index=-1,
                             try_number=try_number)
        op = FeatureBuildOperator(task_id=task_id, step=step, ds=day, skip_validation=True, shards=2, deferrable=False)
        return op.execute({"ti": ti})

    built = run("daily_sequences_examples", "daily_sequences_examples")
    assert built[contracts.PIN_WINDOW]["staged_day"] and built[contracts.PIN_WINDOW]["mode"] == "incremental"
    before = sorted(p.name for p in jobs.iterdir())
    summary = run("window_features", "window")
    assert sorted(p.name for p in jobs.iterdir()) == before  # no job
    assert summary[contracts.USER_WINDOW] == storage.read_metadata(root, contracts.USER_WINDOW, day)
    # The day's aggregates rebuilt: the window task builds the window again (a job), from them.
    run("daily_aggregates", "daily")
    rebuilt = run("window_features", "window", try_number=2)
    assert len(list(jobs.iterdir())) == len(before) + 2 and not rebuilt[contracts.USER_WINDOW].get("staged_day")
