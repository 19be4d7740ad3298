"""The embedded-default demo: a synthetic world, then the whole DAG chain through Airflow.

    make demo                      # what this runs: python scripts/demo.py

Generates a seeded synthetic world under the storage root (skipped when the same world is there), runs
``pin_daily_features`` for every day, then for each model family (the ranker, the content model)
``pin_ranker_training`` on the days before the last (evaluated on the last) and ``pin_corpus_inference``
with the trained model over the whole corpus, each as a real Airflow DAG run
(``dag.test()`` on the SQLite metadata database of ``make install``). Each run is named for the day it built
(``demo__2026-11-01``; training and inference by the evaluation day) and starts when it started, so the UI shows
which day a run built and how long it took; running the demo again replaces those runs. Ends by printing one JSON summary,
also written to ``<storage root>/demo-summary.json``. Airflow's task logs go to ``<PINFLOW_HOME>/demo.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
try:  # installed (make install: an editable install); a second copy of the tree on sys.path would list pinflow's
    import core  # noqa: F401  # Airflow plugin entry points twice, and Airflow then drops the plugins after it
except ImportError:
    sys.path.insert(0, str(REPO))

from core import config  # noqa: E402

# The terminal: Airflow's own output goes to the demo log instead (see send_output_to).
CONSOLE = sys.stdout
STOPPING = threading.Event()  # a signal asked the demo to stop (StopOnSignal)


def say(message: str) -> None:
    try:
        print(f"[pinflow demo {time.strftime('%H:%M:%S')}] {message}", file=CONSOLE, flush=True)
    except OSError:  # the terminal is gone (SIGHUP): the demo goes on stopping; Airflow's side is in the demo log
        pass


def send_output_to(log_file: Path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at the log file, keeping the
    terminal for ``say``. At the descriptor level, because Airflow's loggers keep their own handles."""
    global CONSOLE
    CONSOLE = os.fdopen(os.dup(1), "w")
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def airflow_problem() -> str | None:
    """Why Airflow is not ready for the demo (run by hand, without the environment ``make demo`` sets), or None.
    Checked before Airflow is imported: without AIRFLOW_HOME it would make ``~/airflow`` and an empty database there."""
    if not os.environ.get("AIRFLOW_HOME"):
        return ("AIRFLOW_HOME is not set: run the demo with `make demo`, which points Airflow at its home under "
                "PINFLOW_HOME, these DAGs and plugins, and creates its SQLite database; to run this script by hand, "
                "`eval \"$(make -s print-env)\"` and `make install` first")
    import sqlalchemy as sa
    from airflow import settings

    engine = settings.engine
    assert engine is not None  # set up when airflow is imported
    if not sa.inspect(engine).has_table("dag_run"):
        return (f"Airflow's metadata database ({engine.url}) has no tables: `make install` (which `make demo` "
                "runs) creates it")
    return None


def load_dags() -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    return bag.dags


class DemoFailed(Exception):
    pass


class Stopped(BaseException):
    """The demo was stopped by a signal. Not an Exception: dag.test() and Airflow's task runner take any Exception
    for one task's failure and go on with the run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopOnSignal:
    """Ctrl-C, SIGTERM (``kill``, ``make`` stopped) and SIGHUP (the terminal closed) stop the demo and the job it
    waits for, and nothing is retried.

    dag.test() runs every task in this process, and Airflow's task runner takes SIGTERM for the running task alone
    (its handler calls the operator's on_kill, then the run goes on to the task's retry) and Ctrl-C for the task's
    failure, while the task's job runs in process groups of its own, out of reach of the terminal's Ctrl-C. So within
    this block the three signals stay with the demo: between tasks a signal stops it at once; while a task runs, the
    task's job is cancelled (through the operator's on_kill, as Airflow's handler would; again every few seconds, for
    a job submitted meanwhile), and so is any job the job history still has active; the task ends on that, and no
    task or retry starts after it. A second signal stops at once (the cancelling still happens before the exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    AGAIN_S = 5.0

    def __init__(self) -> None:
        from services import job_history

        self.history = job_history
        self.since = job_history.now()  # the jobs of this demo (one demo per PINFLOW_HOME: its lock)
        self.signum: int | None = None
        self.stopped_at: Any = None
        self.task_name = ""  # the task running, or the last one
        self.in_task = self.shield = self.finishing = False
        self.kill_task: Any = None  # the SIGTERM handler Airflow's task runner set for the task: its on_kill
        self.canceller: threading.Thread | None = None

    def __enter__(self) -> StopOnSignal:
        from airflow.sdk.definitions import dag as sdk_dag

        self.install, self.run_task = signal.signal, sdk_dag._run_task
        self.previous = {sig: self.install(sig, self.on_signal) for sig in self.SIGNALS}
        self.patches: list[Any] = [mock.patch.object(signal, "signal", self.keep_ours),
                                   mock.patch.object(sdk_dag, "_run_task", self.task)]
        for patch in self.patches:
            patch.start()
        return self

    def __exit__(self, *_: object) -> None:
        for patch in reversed(self.patches):
            patch.stop()
        for sig, handler in self.previous.items():
            self.install(sig, handler)

    def keep_ours(self, signum: int, handler: Any) -> Any:
        """signal.signal within the block: the three signals keep the demo's handler; the one Airflow's task runner
        sets for SIGTERM is kept to cancel the task's job."""
        if signum not in self.SIGNALS:
            return self.install(signum, handler)
        if signum == signal.SIGTERM and callable(handler):
            self.kill_task = handler
        return self.on_signal

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.finishing:  # stopped(): its cancelling is bounded (the backends' grace) and must not be cut short
            return
        STOPPING.set()
        if self.shield:
            self.signum = self.signum or signum
            return
        if self.signum is not None or not self.in_task:
            self.signum = self.signum or signum
            raise Stopped(self.signum)
        self.signum, self.stopped_at = signum, self.history.now()
        say(f"{signal.Signals(signum).name}: stopping the demo; cancelling the job of {self.task_name} (send it again "
            "to stop at once)")
        self.canceller = threading.Thread(target=self.cancel_while_in_task, name="demo-stop", daemon=True)
        self.canceller.start()

    @contextmanager
    def shielded(self) -> Iterator[None]:
        """A signal within stops the demo at the block's end: loading the DAGs takes any exception for an import
        error of the DAG file it was raised in."""
        self.shield = True
        try:
            yield
        finally:
            self.shield = False
        if self.signum is not None:
            raise Stopped(self.signum)

    def task(self, **kwargs: Any) -> Any:
        """dag.test()'s ``_run_task``: no task starts once the demo is stopping, and none ends without stopping it."""
        if self.signum is not None:
            raise Stopped(self.signum)
        ti = kwargs["ti"]
        self.task_name, self.kill_task, self.in_task = f"{ti.dag_id}.{ti.task_id}", None, True
        try:
            result = self.run_task(**kwargs)
        finally:
            self.in_task = False
            if self.signum is None:  # its on_kill is for its job only: a finished task's job is not cancelled
                self.kill_task = None
        if self.signum is not None:
            raise Stopped(self.signum)
        return result

    def cancel_while_in_task(self) -> None:
        while True:
            self.cancel_jobs()
            deadline = time.monotonic() + self.AGAIN_S
            while self.in_task and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.in_task:
                return

    def cancel_jobs(self) -> None:
        """The task's job (its operator's on_kill; a job already ended is left as it is), and every job of the demo
        that the job history has active."""
        from operators.backends import get_backend

        try:
            if self.kill_task is not None:
                self.kill_task(signal.SIGTERM, None)
            for row in self.history.rows(states=self.history.ACTIVE, since=self.since):
                if row["job_id"]:
                    get_backend(row["backend"]).cancel(row["job_id"])
        except Exception as err:  # noqa: BLE001 - the stop goes on; the log says what could not be cancelled
            print(f"demo stop: cancelling failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            say(f"could not cancel every job ({type(err).__name__}: {err}): look for it in the job history")

    def stopped(self, stop: Stopped) -> int:
        """Cancel what may still run, record the cancelled jobs of the history as cancelled (their tasks recorded a
        killed job's failure), say what was stopped; the exit status of a process stopped by that signal."""
        self.finishing = True
        if self.canceller is not None:
            self.canceller.join()
        self.cancel_jobs()
        name = signal.Signals(stop.signum).name
        if self.stopped_at is not None:
            for row in self.history.rows(states=[self.history.FAILED], since=self.since):
                if row["ended_at"] and row["ended_at"] >= self.stopped_at:
                    self.history.note(self.history.mark_ended, row["backend"], row["job_id"], self.history.CANCELLED,
                                      reason=f"the demo was stopped ({name})", ended_at=row["ended_at"].timestamp())
        where = (f" in {self.task_name}, whose job was cancelled" if self.stopped_at is not None
                 else f" after {self.task_name}" if self.task_name else "")
        say(f"stopped ({name}){where}. What was published stays and nothing half-written is visible; `make demo` runs "
            "the chain again")
        return 128 + stop.signum


RUN_PREFIX = "demo__"


def run_id_for(ds: str, model: str | None = None) -> str:
    """The run id of the demo's run that built day ``ds`` (for a training or inference run: of ``model``)."""
    return f"{RUN_PREFIX}{ds}" + (f"__{model}" if model else "")


@contextmanager
def named_run(run_id: str) -> Iterator[None]:
    """Within this block, the run that ``dag.test()`` creates is called ``run_id`` and starts now.

    ``dag.test()`` names its run ``manual__<logical date>`` and gives it its logical date as start date, so the UI
    showed a run of two minutes as lasting weeks and no run id said which day it built. An earlier run of the same
    name (the demo run again) is replaced, as ``dag.test()`` replaces one of the same logical date.
    """
    from airflow.models import dagrun
    from airflow.sdk import timezone
    from sqlalchemy import select

    create = dagrun.get_or_create_dagrun

    def create_named(**kwargs: Any) -> Any:
        session = kwargs["session"]
        earlier = session.scalar(
            select(dagrun.DagRun).where(dagrun.DagRun.dag_id == kwargs["dag"].dag_id, dagrun.DagRun.run_id == run_id)
        )
        if earlier is not None:
            session.delete(earlier)
            session.commit()
        return create(**{**kwargs, "run_id": run_id, "start_date": timezone.utcnow()})

    with mock.patch.object(dagrun, "get_or_create_dagrun", create_named):
        yield


class FailedJobsSaid:
    """While a DAG run runs, says on the terminal each of its jobs that failed (a preflight that finds too little disk,
    a killed worker): Airflow retries most of them after a backoff, and the terminal would otherwise say nothing
    until the run ends. From the job history (``services.job_history``), every ``every_s`` seconds and at the end."""

    def __init__(self, dag_id: str, run_id: str, log_file: Path, every_s: float = 5.0) -> None:
        from services import job_history

        self.history, self.dag_id, self.run_id, self.log_file, self.every_s = job_history, dag_id, run_id, log_file, every_s
        self.since = job_history.now()  # an earlier demo's run of the same id had jobs of its own
        self.said: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="demo-failed-jobs", daemon=True)

    def __enter__(self) -> FailedJobsSaid:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()
        self.say_new()

    def _watch(self) -> None:
        while not self.stop.wait(self.every_s):
            self.say_new()

    def say_new(self) -> None:
        if STOPPING.is_set():  # the jobs the stop cancels end as killed ones: not a failure to be retried
            return
        history = self.history
        try:
            rows = history.rows(dag_id=self.dag_id, run_id=self.run_id, states=[history.FAILED, history.LOST],
                                since=self.since)
        except Exception:  # noqa: BLE001 - the history is only read for the terminal: the run goes on
            return
        for row in rows:
            if row["job_name"] in self.said:
                continue
            self.said.add(row["job_name"])
            reason = " ".join(str(row["reason"] or "no reason recorded").split())
            say(f"{self.dag_id} {row['task_id']}: try {row['try_number']} failed ({row['failure_class'] or row['state']}): "
                f"{reason[:400]}{'...' if len(reason) > 400 else ''}; Airflow retries it while the task has retries "
                f"left (details in {self.log_file})")


def run_dag(dag: Any, log_file: Path, run_id: str, **kwargs: Any) -> Any:
    """One DAG run through dag.test(), named ``run_id``; raises DemoFailed naming the failed tasks."""
    with named_run(run_id), FailedJobsSaid(dag.dag_id, run_id, log_file):
        dag_run = dag.test(**kwargs)
    if dag_run.state != "success":
        failed = [ti.task_id for ti in dag_run.get_task_instances() if ti.state == "failed"]
        raise DemoFailed(f"{dag.dag_id} run {dag_run.run_id} ended {dag_run.state}; failed tasks {failed}; "
                         f"the task logs are in {log_file}")
    return dag_run


def main(argv: list[str] | None = None) -> int:
    from core.failures import ConfigError

    try:
        cfg = config.load()
    except ConfigError as err:
        say(f"FAILED: {err}")
        return 1
    demo = cfg.demo
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=demo.days, help="days of synthetic logs")
    parser.add_argument("--users", type=int, default=demo.users)
    parser.add_argument("--pins", type=int, default=demo.pins)
    parser.add_argument("--impressions-per-user", type=int, default=demo.impressions_per_user,
                        help="mean impressions of an active user per day")
    parser.add_argument("--train-days", type=int, default=demo.train_days,
                        help="days trained on, the ones before the last (evaluation) day; at most days - 1")
    parser.add_argument("--seed", type=int, default=demo.seed)
    parser.add_argument("--start", default=demo.start, help="first day, YYYY-MM-DD")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: config)")
    parser.add_argument("--no-quality-check", action="store_true",
                        help="exit 0 even if the model does not beat the baseline (tiny worlds in tests)")
    args = parser.parse_args(argv)

    from core import claims, storage
    from features.synthetic import WorldConfig, generate_world

    # Checked before anything runs (the training DAG's params would refuse them only after every day's features).
    if args.days < 2:
        parser.error(f"--days {args.days}: at least 2 (the demo trains on the days before the last and evaluates on "
                     "the last)")
    if not 1 <= args.train_days <= 30:
        parser.error(f"--train-days {args.train_days}: 1 to 30 (the training DAG's train_days)")
    if args.epochs is not None and not 1 <= args.epochs <= 100:
        parser.error(f"--epochs {args.epochs}: 1 to 100 (the training DAG's epochs)")
    try:
        world = WorldConfig(start=args.start, days=args.days, users=args.users, pins=args.pins, seed=args.seed,
                            impressions_per_user=args.impressions_per_user)
    except ValueError as err:
        parser.error(f"{err} (--start YYYY-MM-DD; --users, --pins, --impressions-per-user at least 1)")

    started = time.monotonic()
    root = cfg.storage_root
    home = Path(cfg.home)
    log_file = home / "demo.log"
    try:  # one demo per PINFLOW_HOME: two would replace each other's runs and outputs mid-way; held till exit
        claim = claims.hold(str(home / "demo.lock"))  # noqa: F841
    except claims.Claimed as held:
        say(f"FAILED: another demo is running with PINFLOW_HOME={home} ({held.holder}): wait for it to end, or run "
            "this one with another PINFLOW_HOME")
        return 1
    if problem := airflow_problem():
        say(f"FAILED: {problem}")
        return 1

    with StopOnSignal() as stop:
        try:
            world_file = storage.join(root, "synthetic-world.json")
            recorded = storage.read_json(world_file) if storage.exists(world_file) else {}
            if recorded.get("config") == world.__dict__:
                world_summary = recorded["summary"]
                say(f"synthetic world already under {root}: {world_summary['events']} events")
            else:
                say(f"generating the synthetic world ({args.days} days, {args.users} users with "
                    f"{args.impressions_per_user} impressions a day, {args.pins} pins) under {root}")
                world_summary = generate_world(root, world)
                storage.write_json(world_file, {"config": world.__dict__, "summary": world_summary})
            days: list[str] = list(world_summary["days"])

            say(f"Airflow task logs: {log_file}")
            send_output_to(log_file)
            return run_chain(args, root, log_file, days, world_summary, started, stop)
        except Stopped as stopped:
            return stop.stopped(stopped)
        except DemoFailed as err:
            say(f"FAILED: {err}")
            return 1
        except Exception as err:  # its traceback goes to the log, which may be on the full disk: say it here too
            from core.failures import disk_full

            full = f" (the disk is full: free space under {home} and run the demo again)" if disk_full(err) else ""
            say(f"FAILED: {type(err).__name__}: {err}{full}; details in {log_file}")
            raise


# The quality bar of issue 5: every head reaches this share of the oracle's lift over chance,
# (auc - 0.5) / (oracle_auc - 0.5), and the model with the action sequence beats the ablation without it.
ORACLE_RATIO_BAR = 0.9


def content_quality_bar_met(metrics: dict[str, Any]) -> bool | None:
    """The content model reaches the bar's share of the oracle's lift on safety and on topic (macro AUC)."""
    ratios = metrics.get("oracle_ratio") or {}
    if not ratios:
        return None
    return all(ratios.get(head) is not None and ratios[head] >= ORACLE_RATIO_BAR for head in ("safety", "topic"))


def quality_bar_met(metrics: dict[str, Any]) -> bool | None:
    """Whether the model meets the quality bar; None without the truth or the ablation to judge by."""
    ratios, ablation = metrics.get("oracle_ratio") or {}, metrics.get("ablation_auc") or {}
    if not ratios or not ablation:
        return None
    return all(ratios.get(k) is not None and ratios[k] >= ORACLE_RATIO_BAR
               and (ablation.get(k) is None or metrics["auc"][k] > ablation[k]) for k in metrics["auc"])


def run_chain(
    args: argparse.Namespace, root: str, log_file: Path, days: list[str], world_summary: dict[str, Any], started: float,
    stop: StopOnSignal,
) -> int:
    import pendulum

    from core import storage
    from core.contracts import EXAMPLES, RAW_PINS, VALIDATION_REPORTS

    with stop.shielded():
        dags = load_dags()
    features_started = time.monotonic()
    for ds in days:
        t0 = time.monotonic()
        run_dag(dags["pin_daily_features"], log_file, run_id_for(ds), logical_date=pendulum.parse(ds, tz="UTC"))
        rows = storage.read_metadata(root, EXAMPLES, ds).get("rows")
        say(f"pin_daily_features ds={ds}: validated, features built, {rows} examples ({time.monotonic() - t0:.0f}s)")

    stages: dict[str, float] = {"features": round(time.monotonic() - features_started, 1)}
    train_days = min(args.train_days, len(days) - 1)
    strategy = config.load().training.strategy
    trained: dict[str, Any] = {}
    for family in ("pin_ranker", "pin_content"):
        t0 = time.monotonic()
        say(f"pin_ranker_training model={family}: torchrun, 2 processes ({strategy}, gloo), {train_days} training days, "
            f"evaluated on {days[-1]}")
        train_run = run_dag(
            dags["pin_ranker_training"], log_file, run_id_for(days[-1], family),
            # Every param the runs differ in, each time: dag.test() keeps a run's conf in the DAG's params, so a
            # key left out would take the previous run's value (the ranker's --epochs for the content model).
            run_conf={"model": family, "end_ds": days[-1], "train_days": train_days,
                      "epochs": args.epochs if family == "pin_ranker" else None},
        )
        result = train_run.get_task_instance("train").xcom_pull(task_ids="train")
        promotion = train_run.get_task_instance("promote").xcom_pull(task_ids="promote")
        stages[f"{family}_training"] = round(time.monotonic() - t0, 1)
        say(f"trained {result['model_name']} v{result['model_version']} in {stages[f'{family}_training']:.0f}s: "
            f"AUC {result['metrics']['auc']}, promoted: {bool(promotion)}")

        t0 = time.monotonic()
        infer_run = run_dag(
            dags["pin_corpus_inference"], log_file, run_id_for(days[-1], family),
            run_conf={"model": family, "model_version": str(result["model_version"]), "ds": days[-1]},
        )
        manifest = infer_run.get_task_instance("publish").xcom_pull(task_ids="publish")
        stages[f"{family}_inference"] = round(time.monotonic() - t0, 1)
        say(f"pin_corpus_inference model={family}: {manifest['rows']} pins scored ({stages[f'{family}_inference']:.0f}s)")
        trained[family] = {"result": result, "promotion": promotion, "manifest": manifest}

    examples = {ds: int(storage.read_metadata(root, EXAMPLES, ds).get("rows", 0))
                for ds in storage.complete_days(root, EXAMPLES)}
    validated = [ds for ds in days
                 if storage.exists(storage.join(storage.partition(root, f"{VALIDATION_REPORTS}/events", ds), "result.json"))]
    result, promotion, manifest = (trained["pin_ranker"][k] for k in ("result", "promotion", "manifest"))
    metrics = result["metrics"]
    corpus_pins = storage.read_table(root, RAW_PINS, days[-1], columns=["pin_id"]).num_rows
    content = trained["pin_content"]
    content_metrics = content["result"]["metrics"]
    summary = {
        "days": len(days),
        "first_day": days[0],
        "last_day": days[-1],
        "days_validated": len(validated),
        "events": int(world_summary["events"]),
        "examples_train": sum(examples[d] for d in days[:-1] if d in examples),
        "examples_eval": examples.get(days[-1], 0),
        "auc": metrics["auc"],
        "baseline_auc": metrics["baseline_auc"],
        "oracle_auc": metrics.get("oracle_auc", {}),
        "oracle_ratio": metrics.get("oracle_ratio", {}),
        "ablation_auc": metrics.get("ablation_auc", {}),
        "quality_bar_met": quality_bar_met(metrics),
        "model_name": result["model_name"],
        "model_version": result["model_version"],
        "promoted": bool(promotion),
        "corpus_pins": corpus_pins,
        "pins_scored": int(manifest["rows"]),
        "inference_manifest": manifest["manifest"],
        "content": {
            "auc": content_metrics["auc"],
            "oracle_auc": content_metrics.get("oracle_auc", {}),
            "oracle_ratio": content_metrics.get("oracle_ratio", {}),
            "pr_auc": content_metrics.get("pr_auc", {}),
            "topic_accuracy": content_metrics.get("topic_accuracy"),
            "topic_macro_f1": content_metrics.get("topic_macro_f1"),
            "quality_bar_met": content_quality_bar_met(content_metrics),
            "model_name": content["result"]["model_name"],
            "model_version": content["result"]["model_version"],
            "promoted": bool(content["promotion"]),
            "corpus_pins": corpus_pins,
            "pins_scored": int(content["manifest"]["rows"]),
            "inference_manifest": content["manifest"]["manifest"],
        },
        "stage_seconds": stages,
        "seconds": round(time.monotonic() - started, 1),
    }
    storage.write_json(storage.join(root, "demo-summary.json"), summary)
    ratios = ", ".join(f"{k} {v:.3f}" for k, v in sorted(summary["oracle_ratio"].items()))
    say(f"share of the oracle's lift per head: {ratios} (bar {ORACLE_RATIO_BAR}); "
        f"quality bar met: {summary['quality_bar_met']}")
    content_ratios = ", ".join(f"{k} {v:.3f}" for k, v in sorted(summary["content"]["oracle_ratio"].items()))
    say(f"content model, share of the oracle's lift: {content_ratios}; quality bar met: "
        f"{summary['content']['quality_bar_met']}")
    print(json.dumps(summary, indent=2), file=CONSOLE, flush=True)
    beats = all(metrics["auc"][k] > metrics["baseline_auc"][k] for k in metrics["auc"])
    every_pin = summary["pins_scored"] == summary["content"]["pins_scored"] == corpus_pins
    if not every_pin or not (beats or args.no_quality_check):
        say("the demo's checks failed: every pin must be scored by both families and the ranker must beat the "
            "baseline on each head")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
