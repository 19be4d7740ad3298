"""What pinflow's pages show, as plain dicts (the JSON API returns them; ``pinflow_ui.web`` renders them).

- :func:`platform` — each team's usage against its quota now, GPU-hours per team and per family per day, wait
  percentiles (quota and backend queue), job outcomes and failure classes per day, the jobs waiting or running,
  and the listener's task outcomes per day (``jobdata/task_runs.jsonl``);
- :func:`training_run` — the jobs of one DAG run (every try), live progress from the newest job's heartbeats,
  the loss curve, each rank's heartbeat age, the last checkpoint, the MLflow run, the promotion decision;
- :func:`data_quality` — validation pass / fail per dataset and day, and the quarantine with its reasons.

Everything is read from the job history, the storage root (local or ``s3://``) and files the jobs write; nothing
here writes.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from core import storage
from core.config import LOCAL_MACHINE, PlatformConfig
from core.failures import PinflowError
from operators import links
from services import job_history as history

FAILED_CLASSES = ("INFRA", "USER", "DATA", "OOM")


def _day(value: dt.datetime | None) -> str | None:
    return value.date().isoformat() if value else None


def _days(end: dt.date, count: int) -> list[str]:
    return [(end - dt.timedelta(days=count - 1 - i)).isoformat() for i in range(count)]


def outcome_label(row: dict[str, Any]) -> str:
    outcome = row.get("outcome") or row.get("state") or "?"
    if outcome == history.FAILED and row.get("failure_class"):
        return f"FAILED:{row['failure_class']}"
    return str(outcome)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def total_wait(row: dict[str, Any]) -> float | None:
    """Seconds from asking for room to running: the quota wait plus the backend queue (None: not started yet)."""
    if row.get("started_at") is None:
        return None
    return float(row.get("quota_wait_s") or 0.0) + float(row.get("queue_wait_s") or 0.0)


def gpu_hours_so_far(row: dict[str, Any], now: dt.datetime) -> float:
    if row.get("gpu_hours") is not None:
        return float(row["gpu_hours"])
    if row.get("state") == history.RUNNING and row.get("started_at"):
        return float(row.get("gpus") or 0) * (now - row["started_at"]).total_seconds() / 3600
    return 0.0


def progress(beats: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """A job's progress from its ranks' heartbeats: step of total, %, examples/s (all ranks), ETA, loss, phase,
    and each rank's heartbeat age."""
    now = time.time() if now is None else now
    if not beats:
        return {"reporting": 0, "ranks": []}
    lead = min(beats, key=lambda b: int(b.get("rank", 0)))
    step, total = int(lead.get("step") or 0), lead.get("total_steps")
    loss = lead.get("loss")
    return {
        "reporting": len(beats),
        "world_size": lead.get("world_size"),
        "phase": lead.get("phase"),
        "step": step,
        "total_steps": total,
        "percent": round(100.0 * min(step, int(total)) / int(total), 2) if total else None,
        "epoch": int(lead.get("epoch") or 0) + 1,
        "epochs": lead.get("epochs"),
        "examples_per_s": round(sum(float(b.get("examples_per_s") or 0.0) for b in beats), 1),
        "eta_s": lead.get("eta_s") if lead.get("phase") == "training" else None,
        "loss": loss if isinstance(loss, (int, float)) and step > 0 and loss == loss else None,
        # The rank that waits most for input holds every rank at the next collective.
        "input_wait_share": max((float(b["input_wait_share"]) for b in beats if b.get("input_wait_share") is not None),
                                default=None),
        "data_bound_share": lead.get("data_bound_share"),
        "line": _line(beats),
        "ranks": [
            {"rank": b.get("rank"), "host": b.get("host"), "pid": b.get("pid"), "phase": b.get("phase"),
             "step": b.get("step"), "examples_per_s": round(float(b.get("examples_per_s") or 0.0), 1),
             "age_s": round(now - float(b["unix_time"]), 1) if b.get("unix_time") else None}
            for b in sorted(beats, key=lambda b: int(b.get("rank", 0)))
        ],
    }


def _line(beats: list[dict[str, Any]]) -> str:
    from training.runtime import progress_line

    return progress_line(beats)


def _heartbeats(output_dir: str | None) -> list[dict[str, Any]]:
    if not output_dir:
        return []
    from operators.jobs import read_heartbeats

    try:
        return read_heartbeats(output_dir)
    except (OSError, ValueError):
        return []


# --- Platform ----------------------------------------------------------------------------------------------


def platform(cfg: PlatformConfig, days: int = 14, now: dt.datetime | None = None) -> dict[str, Any]:
    from operators import quotas

    now = now or history.now()
    day_list = _days(now.date(), days)
    since = dt.datetime.combine(dt.date.fromisoformat(day_list[0]), dt.time(), dt.UTC)
    rows = history.rows(since=since)
    # Reconciling asks the backends about every active job: the operators and triggers do that, not a page view.
    usage = quotas.usage_by_team(cfg, reconcile_first=False)

    gpu_team: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    gpu_family: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    cost_team: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    cost_totals: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    unpriced: set[str] = set()
    outcomes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    waits_by_day: dict[str, list[float]] = defaultdict(list)
    waits_by_team: dict[str, list[float]] = defaultdict(list)
    quota_waits: list[float] = []
    queue_waits: list[float] = []
    for row in rows:
        day = _day(row.get("ended_at") or row.get("started_at") or row.get("submitted_at") or row.get("requested_at"))
        hours = gpu_hours_so_far(row, now)
        if day in day_list and hours:
            gpu_team[row["team"]][day] += hours
            gpu_family[row.get("family") or "?"][day] += hours
        if row.get("cost") is not None and _day(row.get("ended_at")) in day_list:
            cost_team[row["team"]][_day(row["ended_at"]) or ""] += float(row["cost"])
            totals = cost_totals[(row["team"], row.get("family") or "?")]
            totals["cost"] += float(row["cost"])
            totals["gpu_hours"] += float(row.get("gpu_hours") or 0.0)
            totals["jobs"] += 1
        elif (row.get("ended_at") and row.get("cost") is None and row.get("instance_type")
              and row["instance_type"] not in cfg.costs.prices and row["instance_type"] != LOCAL_MACHINE):
            unpriced.add(str(row["instance_type"]))  # not a row that ended before costs were recorded
        if row.get("outcome") and _day(row.get("ended_at")) in day_list:
            outcomes[outcome_label(row)][_day(row["ended_at"]) or ""] += 1
        wait = total_wait(row)
        start_day = _day(row.get("started_at"))
        if wait is not None and start_day in day_list:
            waits_by_day[start_day or ""].append(wait)
            waits_by_team[row["team"]].append(wait)
            quota_waits.append(float(row.get("quota_wait_s") or 0.0))
            queue_waits.append(float(row.get("queue_wait_s") or 0.0))

    def series(table: dict[str, dict[str, float]]) -> dict[str, list[float]]:
        return {name: [round(values.get(d, 0.0), 4) for d in day_list] for name, values in sorted(table.items())}

    order = ["SUCCEEDED", *(f"FAILED:{c}" for c in FAILED_CLASSES)]
    outcome_series = series(outcomes)
    outcome_series = {k: outcome_series[k] for k in sorted(outcome_series, key=lambda k: (k not in order,
                                                                                         order.index(k) if k in order else 0, k))}
    wait_pct = {
        f"p{q}": [(i, p) for i, d in enumerate(day_list) if (p := percentile(waits_by_day.get(d, []), q)) is not None]
        for q in (50, 90, 99)
    }
    active = history.rows(states=(history.WAITING, *history.ACTIVE), newest_first=True, limit=50)
    running = []
    for row in active:
        prog = progress(_heartbeats(row.get("output_dir"))) if row["state"] == history.RUNNING else {}
        running.append({**_job_view(row, now), "progress": prog})
    return {
        "generated_at": now.isoformat(),
        "days": day_list,
        "usage": [{k: v for k, v in team.items() if k != "holders"} for team in usage],
        "gpu_hours_by_team": series(gpu_team),
        "gpu_hours_by_family": series(gpu_family),
        "currency": cfg.costs.currency,
        "cost_by_team": series(cost_team),
        "cost_by_team_and_family": [{"team": team, "family": family, "jobs": int(v["jobs"]), "cost": round(v["cost"], 2),
                                     "gpu_hours": round(v["gpu_hours"], 2)}
                                    for (team, family), v in sorted(cost_totals.items())],
        "unpriced_instance_types": sorted(unpriced),
        "wait_percentiles_by_day": wait_pct,
        "wait_percentiles": {
            "total": {f"p{q}": percentile(sum(waits_by_team.values(), []), q) for q in (50, 90, 99)},
            "quota": {f"p{q}": percentile(quota_waits, q) for q in (50, 90, 99)},
            "queue": {f"p{q}": percentile(queue_waits, q) for q in (50, 90, 99)},
            "by_team": {team: {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {"jobs": len(values)}
                        for team, values in sorted(waits_by_team.items())},
        },
        "outcomes_by_day": outcome_series,
        "jobs": len(rows),
        "active": running,
        "recent": [_job_view(r, now) for r in history.rows(newest_first=True, limit=15)],
        "tasks_by_day": task_outcomes(cfg, day_list),
        "deadline_misses": deadline_misses(since, now),
    }


def deadline_misses(since: dt.datetime, now: dt.datetime) -> list[dict[str, Any]]:
    """Missed deadlines of the chain (operators.deadlines) since ``since``: how late each run was when it ended, or
    is now while it still runs (``late_s``; a run that failed before its deadline is late by 0, ``failed``)."""
    misses = []
    for row in history.deadline_misses_since(since):
        ended = row.get("run_ended_at")
        late = max(0.0, ((ended or now) - row["deadline_at"]).total_seconds())
        misses.append({**{k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in row.items()},
                       "late_s": round(late, 1), "still_running": ended is None,
                       "airflow_run": f"{links.base_url()}/dags/{row['dag_id']}/runs/{row['run_id']}"})
    return misses


def _job_view(row: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    """A job row for the pages: its times as ISO strings, how long it has been in its state, its links."""
    since = row.get("started_at") or row.get("submitted_at") or row.get("requested_at")
    view = {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in row.items()}
    view["for_s"] = round((now - since).total_seconds(), 1) if since and not row.get("ended_at") else None
    view["links"] = {
        "run_page": links.run_page_url(row["dag_id"], row["run_id"]) if row.get("dag_id") else None,
        "airflow_run": f"{links.base_url()}/dags/{row['dag_id']}/runs/{row['run_id']}" if row.get("dag_id") else None,
        "console": row.get("console_url") or (links.job_page_url(row["backend"], row["job_id"])
                                              if row.get("job_id") and row.get("backend") == "local" else None),
    }
    return view


def task_outcomes(cfg: PlatformConfig, day_list: list[str]) -> dict[str, list[float]]:
    """Per day, the pinflow tasks that succeeded or failed (by failure class), from the listener's file."""
    path = Path(cfg.home) / "jobdata" / "task_runs.jsonl"
    counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    if path.exists():
        with path.open() as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                day = str(row.get("time", ""))[:10]
                if day not in day_list:
                    continue
                # A failure without an exception (marked failed, its worker lost) has no class to show.
                label = "success" if row.get("state") == "success" else f"failed:{row.get('failure_class') or 'no exception'}"
                counts[label][day] += 1
    return {name: [values.get(d, 0.0) for d in day_list] for name, values in sorted(counts.items())}


# --- Training run -----------------------------------------------------------------------------------------


def head_table(result: dict[str, Any] | None) -> dict[str, dict[str, float | None]]:
    """AUC per head of the run's model, the popularity baseline's and the champion's on the same day (the numbers
    the promotion gate compares: ``services.promotion``)."""
    from services.promotion import head_aucs

    if not result or not result.get("metrics"):
        return {}
    metrics = result["metrics"]
    baselines = metrics.get("baseline_auc") or {}
    champion = result.get("champion") or {}
    champion_aucs = head_aucs(champion["metrics"]) if champion.get("metrics") else {}
    return {head: {"new": value, "baseline": baselines.get(head), "champion": champion_aucs.get(head)}
            for head, value in head_aucs(metrics).items()}


STUDY_DAGS = ("pinflow_hpo",)  # DAGs whose runs are Optuna studies: shown as a study of trials


def study_view(cfg: PlatformConfig, dag_id: str, run_id: str, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An HPO DAG run as its study: every trial (state, value, params, the baseline) with its training job (state,
    tries), the trial counts by state and the best so far; None before the study exists."""
    from operators import hpo
    from operators.jobs import job_name

    url = hpo.storage_url(cfg)
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None  # no study yet (a page never creates the storage)
    try:
        study, spec = hpo.load(hpo.study_name(dag_id, run_id), hpo.open_storage(cfg))
    except PinflowError:
        return None
    by_name = {row["job_name"]: row for row in rows}
    trials: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    best = hpo._best(study)
    for trial in hpo._trials(study):
        tries = [(k, by_name[n]) for k in range(1, 20)
                 if (n := job_name("train", dag_id, run_id, f"trial{trial.number}", f"try{k}")) in by_name]
        job = tries[-1][1] if tries else None
        state = trial.state.name.lower()
        counts[state] += 1
        trials.append({
            "number": trial.number, "state": state, "value": trial.value, "params": trial.params,
            "baseline": bool(trial.user_attrs.get(hpo.BASELINE_ATTR)), "best": best is not None and trial.number == best.number,
            "round": trial.user_attrs.get(hpo.ROUND_ATTR), "tries": len(tries),
            "job_state": job["state"] if job else None, "run_s": job.get("run_s") if job else None,
        })
    return {"study": study.study_name, "family": spec.family, "metric": spec.metric, "direction": spec.direction,
            "requested": spec.n_trials, "counts": dict(counts), "trials": trials,
            "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params}}


def training_run(cfg: PlatformConfig, dag_id: str, run_id: str, now: dt.datetime | None = None,
                 dag_run_state: str | None = None) -> dict[str, Any]:
    """Everything the Training progress tab shows of a DAG run; ``dag_run_state`` (Airflow's, from the API server)
    keeps the tab refreshing until the run's last task has ended."""
    now = now or history.now()
    rows = history.rows(dag_id=dag_id, run_id=run_id)
    latest = rows[-1] if rows else None
    beats = _heartbeats(latest.get("output_dir")) if latest else []
    curve: list[tuple[float, float]] = []
    for row in rows:  # every try's rank 0 kept its part of the curve (a retry resumes from a checkpoint)
        for beat in _heartbeats(row.get("output_dir")) if row is not latest else beats:
            if int(beat.get("rank", -1)) == 0:
                curve += [(float(s), float(v)) for s, v in beat.get("loss_history") or []]
    by_step = dict(sorted(curve))
    checkpoint_dir = latest.get("checkpoint_dir") if latest else None
    result = _read_json(storage.join(latest["output_dir"], "result.json")) if latest and latest.get("output_dir") else None
    promoted = next((r for r in reversed(rows) if r.get("promoted") is not None), None)
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "generated_at": now.isoformat(),
        "jobs": [_job_view(r, now) for r in rows],
        "state": latest["state"] if latest else None,
        "dag_run_state": dag_run_state,
        "progress": progress(beats),
        "loss_curve": [[s, v] for s, v in by_step.items()],
        "checkpoint": last_checkpoint(checkpoint_dir),
        "mlflow": mlflow_links(cfg, checkpoint_dir, result),
        "result": {k: result.get(k) for k in ("model_name", "model_version", "eval_ds", "steps", "examples_seen",
                                              "seconds", "metrics", "input")} if result else None,
        "heads": head_table(result),
        "study": study_view(cfg, dag_id, run_id, rows) if dag_id in STUDY_DAGS else None,
        "cost": round(sum(float(r["cost"]) for r in rows if r.get("cost") is not None), 2)
        if any(r.get("cost") is not None for r in rows) else None,
        "currency": cfg.costs.currency,
        "champion_version": ((result or {}).get("champion") or {}).get("version"),
        "promotion": {"promoted": bool(promoted["promoted"]), "reason": promoted.get("promotion_reason"),
                      "model_version": promoted.get("model_version")} if promoted else None,
        "links": {"airflow_run": f"{links.base_url()}/dags/{dag_id}/runs/{run_id}"},
    }


def models(cfg: PlatformConfig, versions_per_model: int = 20) -> list[dict[str, Any]]:
    """Per model family: its registered model's champion now, every recorded move of the alias (promotions and
    rollbacks: when, from, to, by whom, why) and its newest versions with their evaluation and the periods each was
    champion. A registry that does not answer is said on the page (``error``), not a 500."""
    from services import model_registry as registry

    client = registry.client(cfg.mlflow)
    out = []
    for family, family_cfg in sorted(cfg.families.items()):
        name = family_cfg.model_name or family
        moves = [{**m, "moved_at": m["moved_at"].isoformat() if m.get("moved_at") else None}
                 for m in history.alias_moves(name)]
        periods: dict[str, list[list[str | None]]] = defaultdict(list)
        for i, m in enumerate(moves):
            until = moves[i + 1]["moved_at"] if i + 1 < len(moves) else None
            periods[str(m["to_version"])].append([m["moved_at"], until])
        entry: dict[str, Any] = {"family": family, "model_name": name, "moves": moves, "versions": [],
                                 "champion": None, "error": None}
        try:
            champion = registry.champion(client, name)
            entry["champion"] = None if champion is None else str(champion.version)
            found = client.search_model_versions(f"name='{name}'") if champion is not None or moves else []
            for version in sorted(found, key=lambda v: int(v.version), reverse=True)[:versions_per_model]:
                try:
                    metrics = client.get_run(version.run_id).data.metrics if version.run_id else {}
                except Exception:  # noqa: BLE001 - a version whose run was deleted still has its row
                    metrics = {}
                entry["versions"].append({
                    "version": str(version.version), "created": dt.datetime.fromtimestamp(
                        version.creation_timestamp / 1000, dt.UTC).isoformat() if version.creation_timestamp else None,
                    "mean_auc": metrics.get("eval_mean_auc"), "run_id": version.run_id,
                    "promotion": (version.tags or {}).get("promotion"), "champion_periods": periods.get(str(version.version), []),
                })
        except Exception as err:  # noqa: BLE001 - the page says what it could not read
            entry["error"] = f"the MLflow registry at {cfg.mlflow.tracking_uri} did not answer: {err}"[:500]
        out.append(entry)
    return out


def _read_json(location: str) -> dict[str, Any] | None:
    try:
        data = storage.read_json(location)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def last_checkpoint(checkpoint_dir: str | None) -> dict[str, Any] | None:
    """The newest complete checkpoint's marker (``step-*/COMPLETE.json``: step, epoch, time ...) and path."""
    if not checkpoint_dir:
        return None
    try:
        markers = sorted(storage.glob(checkpoint_dir, "step-*/COMPLETE.json"))
    except (OSError, ValueError):
        return None
    for marker in reversed(markers):
        data = _read_json(marker)
        if data is not None:
            keep: dict[str, Any] = {k: data.get(k) for k in ("step", "epoch", "examples_seen", "time", "world_size")
                                    if k in data}
            return {**keep, "path": marker.rsplit("/", 1)[0]}
    return None


def mlflow_links(cfg: PlatformConfig, checkpoint_dir: str | None, result: dict[str, Any] | None) -> dict[str, Any] | None:
    """The job's MLflow run (from ``mlflow_run.json``, written as soon as the job starts its run) and, once
    registered, its model version: their pages in the MLflow UI."""
    state = _read_json(storage.join(checkpoint_dir, "mlflow_run.json")) if checkpoint_dir else None
    run_id = (state or {}).get("run_id") or (result or {}).get("mlflow_run_id")
    if not run_id:
        return None
    base = cfg.mlflow.ui_url.rstrip("/")
    experiment = (state or {}).get("experiment_id")
    out: dict[str, Any] = {
        "run_id": run_id,
        "run_url": f"{base}/#/experiments/{experiment}/runs/{run_id}" if experiment else f"{base}/#/runs/{run_id}",
    }
    version = (state or {}).get("model_version") or (result or {}).get("model_version")
    name = (result or {}).get("model_name") or ((state or {}).get("model_uri") or "").removeprefix("models:/").split("/")[0]
    if version and name:
        out.update(model_name=name, model_version=str(version), model_url=f"{base}/#/models/{name}/versions/{version}")
    return out


# --- Data quality -----------------------------------------------------------------------------------------


def validation_report(cfg: PlatformConfig, dataset: str, ds: str) -> dict[str, Any] | None:
    """A partition's validation report (``result.json``: every check with what it observed and expected) and
    whether it is quarantined; None where it was not validated."""
    from core.contracts import QUARANTINE, VALIDATION_REPORTS

    report = _read_json(storage.join(cfg.storage_root, VALIDATION_REPORTS, dataset, f"ds={ds}", "result.json"))
    if report is None:
        return None
    markers = _glob(storage.join(cfg.storage_root, QUARANTINE, dataset, f"ds={ds}"), "*/QUARANTINE.json")
    quarantined = (_read_json(markers[-1]) or {}) if markers else None  # the newest record of the partition
    return {**report, "quarantined": quarantined, "gx_data_docs": links.page_url("data-quality", "docs", dataset, ds)}


def data_quality(cfg: PlatformConfig, days: int = 14) -> dict[str, Any]:
    from core.contracts import QUARANTINE, VALIDATION_REPORTS

    root = cfg.storage_root
    reports_root = storage.join(root, VALIDATION_REPORTS)
    cells: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for result_path in _glob(reports_root, "*/ds=*/result.json"):
        parts = result_path.split("/")
        dataset, ds = parts[-3], parts[-2].removeprefix("ds=")
        data = _read_json(result_path) or {}
        cells[dataset][ds] = {
            "success": bool(data.get("success")), "rows": data.get("rows"),
            "failed_checks": data.get("failed_checks") or [], "validated_at": data.get("validated_at"),
            "warnings": len(data.get("warnings") or []),
            "docs": links.data_docs_url(dataset, ds),
        }
    all_days = sorted({d for per in cells.values() for d in per})[-days:]
    quarantine = []
    for marker in _glob(storage.join(root, QUARANTINE), "*/ds=*/*/QUARANTINE.json"):
        data = _read_json(marker) or {}
        parts = marker.split("/")
        dataset, ds, when = parts[-4], parts[-3].removeprefix("ds="), parts[-2]
        message = str(data.get("message") or "")
        quarantine.append({
            "dataset": dataset, "ds": ds, "record": when, "quarantined_at": data.get("quarantined_at"),
            "failed_checks": data.get("failed_checks") or [],
            "reason": message.splitlines()[0] if message else "",
            "details": [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")][:5],
            "restore": data.get("restore"),
            "report": links.page_url("files", "quarantine", dataset, f"ds={ds}", when, "report", "index.html"),
        })
    quarantine.sort(key=lambda q: (q["ds"], q["record"]), reverse=True)
    passed = sum(1 for per in cells.values() for d, c in per.items() if d in all_days and c["success"])
    failed = sum(1 for per in cells.values() for d, c in per.items() if d in all_days and not c["success"])
    return {"days": all_days, "datasets": sorted(cells), "cells": {k: dict(v) for k, v in cells.items()},
            "passed": passed, "failed": failed, "quarantine": quarantine}


def _glob(base: str, pattern: str) -> list[str]:
    try:
        return sorted(storage.glob(base, pattern)) if storage.exists(base) else []
    except (OSError, ValueError):
        return []
