"""The embedded-default demo: a synthetic world, then the whole DAG chain through Airflow.

    make demo                      # what this runs: python scripts/demo.py

Generates a seeded synthetic world under the storage root (skipped when the same world is there), runs
``pin_daily_features`` for every day, ``pin_ranker_training`` on the days before the last (evaluated on
the last), and ``pin_corpus_inference`` with the promoted model, each as a real Airflow DAG run
(``dag.test()`` on the SQLite metadata database of ``make install``). Ends by printing one JSON summary,
also written to ``<storage root>/demo-summary.json``. Airflow's task logs go to ``<PINFLOW_HOME>/demo.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core import config  # noqa: E402

# The terminal: Airflow's own output goes to the demo log instead (see send_output_to).
CONSOLE = sys.stdout


def say(message: str) -> None:
    print(f"[pinflow demo {time.strftime('%H:%M:%S')}] {message}", file=CONSOLE, flush=True)


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


def load_dags() -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    if bag.import_errors:
        raise SystemExit(f"DAG import errors: {bag.import_errors}")
    return bag.dags


class DemoFailed(Exception):
    pass


def run_dag(dag: Any, log_file: Path, **kwargs: Any) -> Any:
    """One DAG run through dag.test(); raises DemoFailed naming the failed tasks."""
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

    from core import storage
    from features.synthetic import WorldConfig, generate_world

    started = time.monotonic()
    root = cfg.storage_root
    home = Path(cfg.home)
    log_file = home / "demo.log"
    home.mkdir(parents=True, exist_ok=True)

    world = WorldConfig(start=args.start, days=args.days, users=args.users, pins=args.pins, seed=args.seed,
                        impressions_per_user=args.impressions_per_user)
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
    try:
        return run_chain(args, root, log_file, days, world_summary, started)
    except DemoFailed as err:
        say(f"FAILED: {err}")
        return 1


# The quality bar of issue 5: every head reaches this share of the oracle's lift over chance,
# (auc - 0.5) / (oracle_auc - 0.5), and the model with the action sequence beats the ablation without it.
ORACLE_RATIO_BAR = 0.9


def quality_bar_met(metrics: dict[str, Any]) -> bool | None:
    """Whether the model meets the quality bar; None without the truth or the ablation to judge by."""
    ratios, ablation = metrics.get("oracle_ratio") or {}, metrics.get("ablation_auc") or {}
    if not ratios or not ablation:
        return None
    return all(ratios.get(k) is not None and ratios[k] >= ORACLE_RATIO_BAR
               and (ablation.get(k) is None or metrics["auc"][k] > ablation[k]) for k in metrics["auc"])


def run_chain(
    args: argparse.Namespace, root: str, log_file: Path, days: list[str], world_summary: dict[str, Any], started: float
) -> int:
    import pendulum

    from core import storage
    from core.contracts import EXAMPLES, RAW_PINS, VALIDATION_REPORTS

    dags = load_dags()
    for ds in days:
        t0 = time.monotonic()
        run_dag(dags["pin_daily_features"], log_file, logical_date=pendulum.parse(ds, tz="UTC"))
        rows = storage.read_metadata(root, EXAMPLES, ds).get("rows")
        say(f"pin_daily_features ds={ds}: validated, features built, {rows} examples ({time.monotonic() - t0:.0f}s)")

    t0 = time.monotonic()
    train_days = min(args.train_days, len(days) - 1)
    say(f"pin_ranker_training: torchrun, 2 processes (DDP, gloo), {train_days} training days, evaluated on {days[-1]}")
    train_run = run_dag(
        dags["pin_ranker_training"], log_file,
        run_conf={"end_ds": days[-1], "train_days": train_days,
                  **({"epochs": args.epochs} if args.epochs else {})},
    )
    result = train_run.get_task_instance("train").xcom_pull(task_ids="train")
    promotion = train_run.get_task_instance("promote").xcom_pull(task_ids="promote")
    say(f"trained {result['model_name']} v{result['model_version']} in {time.monotonic() - t0:.0f}s: "
        f"AUC {result['metrics']['auc']}, promoted: {bool(promotion)}")

    t0 = time.monotonic()
    infer_run = run_dag(
        dags["pin_corpus_inference"], log_file,
        run_conf={"model_version": str(result["model_version"]), "ds": days[-1]},
    )
    manifest = infer_run.get_task_instance("publish").xcom_pull(task_ids="publish")
    say(f"pin_corpus_inference: {manifest['rows']} pins scored ({time.monotonic() - t0:.0f}s)")

    examples = {ds: int(storage.read_metadata(root, EXAMPLES, ds).get("rows", 0))
                for ds in storage.complete_days(root, EXAMPLES)}
    validated = [ds for ds in days
                 if storage.exists(storage.join(storage.partition(root, f"{VALIDATION_REPORTS}/events", ds), "result.json"))]
    metrics = result["metrics"]
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
        "corpus_pins": storage.read_table(root, RAW_PINS, days[-1], columns=["pin_id"]).num_rows,
        "pins_scored": int(manifest["rows"]),
        "inference_manifest": manifest["manifest"],
        "seconds": round(time.monotonic() - started, 1),
    }
    storage.write_json(storage.join(root, "demo-summary.json"), summary)
    ratios = ", ".join(f"{k} {v:.3f}" for k, v in sorted(summary["oracle_ratio"].items()))
    say(f"share of the oracle's lift per head: {ratios} (bar {ORACLE_RATIO_BAR}); "
        f"quality bar met: {summary['quality_bar_met']}")
    print(json.dumps(summary, indent=2), file=CONSOLE, flush=True)
    beats = all(metrics["auc"][k] > metrics["baseline_auc"][k] for k in metrics["auc"])
    if summary["pins_scored"] != summary["corpus_pins"] or not (beats or args.no_quality_check):
        say("the demo's checks failed: every pin must be scored and the model must beat the baseline on each head")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
