"""pinflow's FastAPI app, mounted by the plugin under ``/pinflow`` on Airflow's API server.

Pages (HTML with server-rendered SVG; shown in the Airflow UI through the plugin's ``external_views``) and the
JSON API they are made from::

    /pinflow/platform                    /pinflow/api/platform
    /pinflow/runs                        /pinflow/api/runs
    /pinflow/runs/<dag_id>/<run_id>      /pinflow/api/runs/<dag_id>/<run_id>
    /pinflow/runs/<dag_id>/<run_id>/mlflow   -> the run's MLflow run (307), once the job has created it
    /pinflow/data-quality                /pinflow/api/data-quality
    /pinflow/data-quality/docs/<dataset>/<ds>  -> the partition's Data Docs (or report), served below
    /pinflow/files/reports/validation/...      validation reports and Data Docs from the storage root
    /pinflow/files/quarantine/<dataset>/ds=<ds>/<time>/report/...   a quarantined partition's report
    /pinflow/jobs/<backend>/<job_id>     a job: its history row; a local job's node logs and request

Every route needs an authenticated Airflow user, exactly as Airflow's own API: a JWT as ``Authorization: Bearer``
or the UI's session cookie (Airflow's ``get_user`` dependency), and the auth manager's permission to see plugins
(``AccessView.PLUGINS``); a DAG run's routes also need read access to that DAG's runs. Without a token: 401.
"""

from __future__ import annotations

import datetime as dt
import json
import mimetypes
from html import escape
from typing import Annotated, Any
from urllib.parse import quote

from airflow.api_fastapi.common.db.common import SessionDep
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from pinflow_ui import pages, svg

CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, sans-serif; margin: 16px 24px; color: #1a202c; font-size: 14px; }
nav a { margin-right: 14px; text-decoration: none; color: #2b6cb0; font-weight: 600; }
nav { border-bottom: 1px solid #e2e8f0; padding-bottom: 8px; margin-bottom: 12px; }
h1 { font-size: 20px; margin: 8px 0; } h2 { font-size: 16px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 4px 0 10px; } td, th { border: 1px solid #e2e8f0; padding: 3px 8px;
  text-align: left; vertical-align: top; } th { background: #f7fafc; }
.grid { display: flex; flex-wrap: wrap; gap: 18px; } .card { border: 1px solid #e2e8f0; border-radius: 6px;
  padding: 8px 12px; }
.pass { background: #c6f6d5; } .fail { background: #fed7d7; } .warn { background: #fefcbf; } .none { color: #a0aec0; }
.muted { color: #718096; } .big { font-size: 18px; font-weight: 600; } code { font-size: 12px; }
.state-RUNNING { color: #2b6cb0; font-weight: 600; } .state-WAITING { color: #b7791f; font-weight: 600; }
.state-SUCCEEDED { color: #2f855a; } .state-FAILED { color: #c53030; font-weight: 600; }
"""


def _prefix(request: Request) -> str:
    """Where this app is mounted (``/pinflow``, behind any proxy prefix): links stay right wherever it is served."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _airflow(request: Request) -> str:
    """The Airflow UI's root, for links out of the iframe (``target=_top``)."""
    return _prefix(request).removesuffix("/pinflow")


def _layout(request: Request, title: str, body: str, refresh: int | None = None) -> str:
    p = _prefix(request)
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}<title>{escape(title)} · pinflow</title>'
        f"<style>{CSS}</style></head><body>"
        f'<nav><a href="{p}/platform">Platform</a><a href="{p}/runs">Training runs</a>'
        f'<a href="{p}/data-quality">Data quality</a><a href="{p}/models">Models</a></nav><h1>{escape(title)}</h1>{body}'
        f'<p class="muted">Updated {dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")}'
        f'{f" · refreshes every {refresh}s" if refresh else ""}</p></body></html>'
    )


def _a(href: str | None, text: str, top: bool = False) -> str:
    if not href:
        return escape(text)
    target = ' target="_top"' if top else (' target="_blank" rel="noopener"' if href.startswith("http") else "")
    return f'<a href="{escape(href)}"{target}>{escape(text)}</a>'


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = float(seconds)
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    if 0 < seconds < 9.95:  # a wait of a third of a second is not "0 s"
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s"


def _time(value: str | None) -> str:
    return escape(value[:19].replace("T", " ")) if value else "—"


def _table(headers: list[str], rows: list[list[str]], empty: str = "none") -> str:
    if not rows:
        return f'<p class="muted">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _run_href(request: Request, dag_id: str, run_id: str) -> str:
    return f"{_prefix(request)}/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


def _run_link(request: Request, job: dict[str, Any]) -> str:
    if not job.get("dag_id"):
        return "—"
    return _a(_run_href(request, job["dag_id"], job["run_id"]), f"{job['dag_id']} / {job['run_id']}")


# --- Platform ----------------------------------------------------------------------------------------------


def render_platform(request: Request, data: dict[str, Any]) -> str:
    days = data["days"]
    usage_rows, usage_charts = [], []
    for team in data["usage"]:
        held, quota = team["held"], team["quota"]
        usage_rows.append([
            f"<b>{escape(team['team'])}</b>", escape(team["pool"]), escape(team["instance_type"]),
            *(f"{held[k]} / {quota[k] if quota[k] is not None else '∞'}" for k in ("jobs", "nodes", "gpus")),
            str(team["waiting"]),
        ])
        usage_charts.append(svg.usage_bars(
            [(f"{team['team']} {k}", float(held[k]), None if quota[k] is None else float(quota[k]))
             for k in ("jobs", "nodes", "gpus")], title=f"team {team['team']}: usage vs quota now"))
    waits = data["wait_percentiles"]
    wait_rows = [[escape(team), str(v["jobs"]), *(_duration(v[f"p{q}"]) for q in (50, 90, 99))]
                 for team, v in waits["by_team"].items()]
    wait_rows += [[f"<i>{name}</i>", "", *(_duration(waits[name][f"p{q}"]) for q in (50, 90, 99))]
                  for name in ("quota", "queue", "total")]
    active = []
    for job in data["active"]:
        prog = job.get("progress") or {}
        done = f"{prog['percent']:.1f}% (step {prog['step']}/{prog['total_steps']})" if prog.get("percent") is not None else "—"
        active.append([
            escape(job["team"]), escape(job.get("family") or ""), _run_link(request, job),
            f'<span class="state-{escape(job["state"])}">{escape(job["state"])}</span>',
            escape(f"{job.get('instance_type')} × {job.get('nodes')}"), _duration(job.get("for_s")), done,
            _duration(prog.get("eta_s")) if prog.get("eta_s") is not None else "—",
            " ".join(filter(None, [_a(job["links"]["console"], "job"), _a(job["links"]["airflow_run"], "Airflow", top=True)])),
        ])
    recent = [[
        escape(job["team"]), escape(job.get("family") or ""), _run_link(request, job),
        f'<span class="state-{escape(job["state"])}">{escape(job["state"])}</span>',
        escape(job.get("failure_class") or ""), str(job.get("try_number") or ""),
        _duration(job.get("quota_wait_s")), _duration(job.get("queue_wait_s")), _duration(job.get("run_s")),
        f"{job['gpu_hours']:.2f}" if job.get("gpu_hours") is not None else "—", _money(job.get("cost")),
        _time(job.get("ended_at")),
    ] for job in data["recent"]]
    misses = [[
        escape(m["deadline"]), _a(m["airflow_run"], f"{m['dag_id']} / {m['run_id']}", top=True), _time(m["deadline_at"]),
        (f"{_duration(m['late_s'])} so far (still running)" if m["still_running"] else
         f"{_duration(m['late_s'])} ({escape(m.get('run_state') or '')})"),
        escape(m.get("notified") or "logged"),
    ] for m in data["deadline_misses"]]
    currency = escape(data["currency"])
    cost_rows = [[escape(c["team"]), escape(c["family"]), str(c["jobs"]), f"{c['gpu_hours']:.2f}",
                  f"{c['cost']:,.2f} {currency}"] for c in data["cost_by_team_and_family"]]
    unpriced = (f'<p class="warn">No price for {escape(", ".join(data["unpriced_instance_types"]))}: their jobs have no cost '
                "(add them under costs.prices in config/platform.yaml).</p>" if data["unpriced_instance_types"] else "")
    body = f"""
<h2>Teams: usage against quota now</h2>
{_table(["team", "Airflow pool", "instance type", "jobs", "nodes", "GPUs", "waiting for room"], usage_rows)}
<div class="grid">{''.join(usage_charts)}</div>
<h2>Missed deadlines</h2>
{_table(["deadline", "DAG run", "was due", "how late", "notified"], misses,
        "no deadline missed in these days (deadlines: in config/platform.yaml)")}
<h2>Jobs waiting or running</h2>
{_table(["team", "family", "DAG run", "state", "nodes", "for", "progress", "ETA", "links"], active,
        "no job is waiting or running")}
<div class="grid">
<div class="card"><h2>GPU-hours per team and day</h2>{svg.stacked_bars(days, data["gpu_hours_by_team"], title="GPU-hours per team", unit="GPU-hours")}</div>
<div class="card"><h2>GPU-hours per model family and day</h2>{svg.stacked_bars(days, data["gpu_hours_by_family"], title="GPU-hours per family", unit="GPU-hours")}</div>
<div class="card"><h2>Cost per team and day ({currency})</h2>{svg.stacked_bars(days, data["cost_by_team"], title="cost per team", unit=data["currency"])}
{_table(["team", "family", "jobs", "GPU-h", "cost"], cost_rows, "no priced job has ended in these days")}{unpriced}</div>
<div class="card"><h2>Wait before running (quota + queue) per day</h2>{svg.lines(data["wait_percentiles_by_day"], title="wait percentiles per day", unit="seconds", x_ticks=days, x_range=(0, len(days) - 1))}
{_table(["team", "jobs", "p50", "p90", "p99"], wait_rows, "no job has started yet")}</div>
<div class="card"><h2>Job outcomes and failure classes per day</h2>{svg.stacked_bars(days, data["outcomes_by_day"], title="job outcomes per day", unit="jobs")}</div>
<div class="card"><h2>Task outcomes per day (every pinflow task, from the listener)</h2>{svg.stacked_bars(days, data["tasks_by_day"], title="task outcomes per day", unit="tasks")}</div>
</div>
<h2>Recent jobs</h2>
{_table(["team", "family", "DAG run", "state", "class", "try", "quota wait", "queue wait", "run time", "GPU-h",
         f"cost ({currency})", "ended"], recent,
        "no job yet")}
<p class="muted">{data["jobs"]} job(s) in the last {len(days)} days. Export for capacity planning:
<code>python -m services.job_history export --out jobs.parquet</code></p>"""
    return _layout(request, "Platform", body, refresh=30)


# --- Training run ------------------------------------------------------------------------------------------


def render_runs(request: Request, runs: list[dict[str, Any]]) -> str:
    rows = [[
        _run_link(request, r), escape(r["team"]), escape(r.get("family") or ""),
        f'<span class="state-{escape(r["state"])}">{escape(r["state"])}</span>',
        f'study: {r["trials"]} trial(s)' if r.get("trials") else str(r["tries"]),
        _time(r.get("requested_at")), _time(r.get("ended_at")), escape(str(r.get("model_version") or "")),
        "" if r.get("promoted") is None else ("promoted" if r["promoted"] else "not promoted"),
    ] for r in runs]
    return _layout(request, "Training runs", _table(
        ["DAG run", "team", "family", "state", "tries", "requested", "ended", "model version", "promotion"], rows,
        "no training job yet"), refresh=30)


def dag_run_state(session: Any, dag_id: str, run_id: str) -> str | None:
    """Airflow's state of a DAG run (queued, running, success, failed); None for a run it does not know."""
    from airflow.models.dagrun import DagRun
    from sqlalchemy import select

    state = session.scalar(select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    return None if state is None else str(getattr(state, "value", state))


# DAGs whose runs train nothing (the Training progress tab is on every DAG run's page): what they do instead.
NO_TRAINING = {
    "pin_daily_features": "validates a day's raw data and builds its features",
    "pin_corpus_inference": "scores the pin corpus with the champion model",
}


def _money(value: Any) -> str:
    return "—" if value is None else f"{float(value):,.2f}"


def _auc(value: Any) -> str:
    return "—" if value is None else f"{float(value):.4f}"


def render_run(request: Request, data: dict[str, Any]) -> str:
    prog, jobs = data["progress"], data["jobs"]
    latest = jobs[-1] if jobs else {}
    # Refreshed until the DAG run's last task has ended (the promotion decision comes after the job), or while
    # the job runs where Airflow's state is not known.
    running = data.get("dag_run_state") in ("queued", "running") or data["state"] in (
        "WAITING", "ADMITTED", "SUBMITTED", "RUNNING")
    parts = []
    if not jobs and data["dag_id"] in NO_TRAINING:
        # Nothing of a training job to show (no loss, checkpoint or MLflow run): the empty sections read as a stuck job.
        parts.append(f'<p class="big">{escape(data["dag_id"])} {NO_TRAINING[data["dag_id"]]}: it runs no training '
                     "job, and this tab shows training jobs only. Its jobs, their shards and what they built are in "
                     f'the run\'s task logs in Airflow; {_a(f"{_prefix(request)}/data-quality", "Data quality")} shows '
                     "the days' validation.</p>")
        parts.append(f'<p>{_a(data["links"]["airflow_run"], "This DAG run in Airflow", top=True)}</p>')
        return _layout(request, f"Run {data['dag_id']} / {data['run_id']}", "".join(parts))
    if not jobs:
        parts.append('<p class="muted">No training job recorded for this DAG run yet: its train task has not '
                     "started (it waits for its upstream tasks).</p>")
    else:
        state = data["state"]
        parts.append(f'<p class="big">Job <code>{escape(latest.get("job_id") or latest["job_name"])}</code>: '
                     f'<span class="state-{escape(state)}">{escape(state)}</span> · team {escape(latest["team"])} · '
                     f'{escape(latest.get("family") or "")} · {escape(str(latest.get("instance_type")))} × '
                     f'{latest.get("nodes")} node(s), {latest.get("procs_per_node")} process(es) each · try '
                     f'{latest.get("try_number")}</p>')
        if state == "WAITING":
            parts.append(f'<p class="warn">Waiting for room in team {escape(latest["team"])}\'s quota since '
                         f'{_time(latest.get("requested_at"))} (see Platform for who holds it).</p>')
        elif state == "SUBMITTED":
            parts.append(f'<p class="warn">Queued on {escape(latest.get("backend") or "")} since '
                         f'{_time(latest.get("submitted_at"))}: waiting for capacity, nodes booting or images pulling.</p>')
    if prog.get("reporting"):
        eta = _duration(prog.get("eta_s")) if prog.get("eta_s") is not None else "—"
        percent = f" ({prog['percent']:.1f}%)" if prog.get("percent") is not None else ""
        loss = f"{prog['loss']:.4f}" if prog.get("loss") is not None else "—"
        share, threshold = prog.get("input_wait_share"), prog.get("data_bound_share")
        waiting = "" if share is None else f" · input wait {share:.0%}" + (
            " <b>(data-bound)</b>" if threshold is not None and share >= threshold else "")
        parts.append(
            f'<h2>Progress</h2>{svg.progress_bar(prog.get("percent") or 0.0, title="training progress")}'
            f'<p class="big">step {prog["step"]} of {prog.get("total_steps") or "?"}{percent} · '
            f'epoch {prog.get("epoch")}/{prog.get("epochs") or "?"} · {prog["examples_per_s"]:,.0f} examples/s · '
            f'ETA {eta} · loss {loss} · phase {escape(str(prog.get("phase")))}{waiting}</p>'
        )
        parts.append("<h2>Ranks</h2>" + _table(
            ["rank", "host", "pid", "phase", "step", "examples/s", "heartbeat age"],
            [[str(r["rank"]), escape(str(r["host"])), str(r["pid"]), escape(str(r["phase"])), str(r["step"]),
              f"{r['examples_per_s']:,.0f}", _duration(r["age_s"])] for r in prog["ranks"]]))
    elif jobs and data["state"] == "RUNNING":
        parts.append('<p class="muted">No heartbeat yet: the job runs, and its ranks are starting (the container or '
                     "processes start, torch is imported); each rank reports as soon as it starts, then at every phase "
                     "(joining the other ranks, loading data, building the model, resuming).</p>")
    elif jobs:
        parts.append('<p class="muted">No heartbeat yet: the job has not started its ranks.</p>')
    parts.append("<h2>Loss</h2>" + svg.lines({"train loss": [tuple(p) for p in data["loss_curve"]]},  # type: ignore[misc]
                                            title="train loss by step", unit="loss", x_label="step",
                                            empty="no step trained yet"))
    ckpt = data["checkpoint"]
    parts.append("<h2>Last checkpoint</h2>" + (
        f"<p>step {ckpt.get('step')} (epoch {ckpt.get('epoch')}), {escape(str(ckpt.get('time') or ''))} — "
        f"<code>{escape(ckpt['path'])}</code></p>" if ckpt else '<p class="muted">none yet</p>'))
    ml = data["mlflow"]
    mlflow_parts = [_a(ml["run_url"], f"MLflow run {ml['run_id']}")] if ml else []
    if ml and ml.get("model_url"):
        mlflow_parts.append(_a(ml["model_url"], f"model {ml['model_name']} version {ml['model_version']}"))
    parts.append("<h2>MLflow</h2><p>" + (" · ".join(mlflow_parts) or
                                          '<span class="muted">no MLflow run yet (the job creates it when it starts)'
                                          "</span>") + "</p>")
    promo = data["promotion"]
    if promo:
        verdict = "promoted to champion" if promo["promoted"] else "not promoted"
        parts.append(f'<h2>Promotion</h2><p class="{"pass" if promo["promoted"] else "warn"}">Version '
                     f'{escape(str(promo.get("model_version")))} {verdict}: {escape(promo.get("reason") or "")}</p>')
    study = data.get("study")
    if study:
        counts = ", ".join(f"{n} {state}" for state, n in sorted(study["counts"].items()))
        best = study["best"]
        parts.append(
            f'<h2>Study</h2><p class="big">{escape(study["direction"])} {escape(study["metric"])} of '
            f'{escape(study["family"])}: {len(study["trials"])} of {escape(str(study["requested"]))} trial(s) ({escape(counts)})'
            + (f' · best so far: trial {escape(str(best["number"]))}, {_auc(best["value"])}' if best else "") + "</p>")
        css = {"complete": "pass", "pruned": "warn", "fail": "fail", "running": ""}
        parts.append(_table(["trial", "state", study["metric"], "params", "round", "job", "tries", "run time"], [[
            f'<b>{escape(str(t["number"]))}</b>' + (" (best)" if t["best"] else "") + (" (baseline)" if t["baseline"] else ""),
            f'<span class="{css.get(t["state"], "")}">{escape(t["state"])}</span>', _auc(t["value"]),
            escape(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())),
            escape(str(t["round"])), escape(str(t["job_state"] or "—")), str(t["tries"]), _duration(t["run_s"]),
        ] for t in study["trials"]], "no trial asked yet"))
        parts.append('<p class="muted">Progress below is the newest trial\'s job. The DAG\'s grid shows every '
                     "round the study may take (hpo.max_rounds); rounds it did not need are skipped.</p>")
    heads = data.get("heads") or {}
    if heads:
        champion = data.get("champion_version")
        header = ["head", "this model", "popularity baseline", f"champion v{champion}" if champion else "champion"]
        parts.append("<h2>AUC by head</h2>" + _table(header, [
            [escape(head), *(_auc(v.get(k)) for k in ("new", "baseline", "champion"))] for head, v in heads.items()]))
    result = data["result"]
    if result and result.get("metrics"):
        metrics = result["metrics"]
        flat = [[escape(k), escape(f"{v:.4f}" if isinstance(v, float) else str(v))] for k, v in metrics.items()
                if isinstance(v, (int, float, str)) or v is None]
        parts.append("<h2>Evaluation</h2>" + _table(["metric", "value"], flat))
    verdict_of_input = (result or {}).get("input") or {}
    if verdict_of_input.get("wait_share") is not None:
        bound = bool(verdict_of_input.get("data_bound"))
        parts.append(f'<h2>Input</h2><p class="{"warn" if bound else "pass"}">'
                     f'{verdict_of_input["wait_share"]:.0%} of step time waiting for input '
                     f'(worst rank {verdict_of_input.get("worst_rank_wait_share") or 0:.0%}; '
                     f'{escape(str(verdict_of_input.get("engine")))} engine, {verdict_of_input.get("num_workers")} worker(s)): '
                     + escape(verdict_of_input.get("advice") or "not data-bound") + "</p>")
    cost = "" if data.get("cost") is None else f': cost {data["cost"]:,.2f} {escape(str(data.get("currency") or ""))}'
    parts.append(f"<h2>Jobs of this run (every try){cost}</h2>" + _table(
        ["try", "job", "state", "class", "submitted", "started", "ended", "quota wait", "queue wait", "run time",
         "GPU-h", "cost", "reason"],
        [[str(j.get("try_number")), _a(j["links"]["console"], j.get("job_id") or j["job_name"]),
          f'<span class="state-{escape(j["state"])}">{escape(j["state"])}</span>', escape(j.get("failure_class") or ""),
          _time(j.get("submitted_at")), _time(j.get("started_at")), _time(j.get("ended_at")),
          _duration(j.get("quota_wait_s")), _duration(j.get("queue_wait_s")), _duration(j.get("run_s")),
          f"{j['gpu_hours']:.2f}" if j.get("gpu_hours") is not None else "—",
          "—" if j.get("cost") is None else f"{j['cost']:,.2f} {escape(str(j.get('currency') or ''))}",
          escape((j.get("reason") or "")[:300])] for j in jobs]))
    parts.append(f'<p>{_a(data["links"]["airflow_run"], "This DAG run in Airflow", top=True)}</p>')
    return _layout(request, f"Training run {data['dag_id']} / {data['run_id']}", "".join(parts),
                   refresh=10 if running else None)


# --- Data quality -------------------------------------------------------------------------------------------


def render_data_quality(request: Request, data: dict[str, Any]) -> str:
    header = ["dataset", *(d[5:] for d in data["days"])]
    rows = []
    for dataset in data["datasets"]:
        cells = [f"<b>{escape(dataset)}</b>"]
        for day in data["days"]:
            cell = data["cells"][dataset].get(day)
            if cell is None:
                cells.append('<span class="none">·</span>')
                continue
            label = "pass" if cell["success"] else "FAIL"
            tip = ", ".join(cell["failed_checks"]) or f"{cell.get('rows')} rows"
            cells.append(f'<a class="{"pass" if cell["success"] else "fail"}" title="{escape(tip)}" '
                         f'href="{escape(cell["docs"])}" target="_blank" rel="noopener">{label}</a>')
        rows.append(cells)
    grid = ('<table class="dq"><tr>' + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows) + "</table>"
            if rows else '<p class="muted">no partition validated yet</p>')
    series = {"passed": [float(sum(1 for ds in data["datasets"] if (c := data["cells"][ds].get(d)) and c["success"]))
                         for d in data["days"]],
              "failed": [float(sum(1 for ds in data["datasets"] if (c := data["cells"][ds].get(d)) and not c["success"]))
                         for d in data["days"]]}
    chart = svg.stacked_bars(data["days"], {"success": series["passed"], "failed": series["failed"]},
                             title="validated partitions per day", unit="partitions")
    quarantine = _table(
        ["dataset", "day", "quarantined", "failed checks", "reason", "report"],
        [[escape(q["dataset"]), escape(q["ds"]), _time(q.get("quarantined_at")),
          escape(", ".join(q["failed_checks"])),
          escape(q["reason"]) + ("<br><small>" + "<br>".join(escape(d) for d in q["details"]) + "</small>"
                                 if q["details"] else ""),
          _a(q["report"], "report")] for q in data["quarantine"]],
        "nothing is quarantined")
    body = (f'<p class="big">{data["passed"]} partition(s) passed, {data["failed"]} failed over the last '
            f'{len(data["days"])} day(s) validated.</p><h2>Validation per dataset and day</h2>'
            f'<p class="muted">Each cell opens the partition\'s validation report.</p>{grid}{chart}'
            f"<h2>Quarantine</h2>{quarantine}")
    return _layout(request, "Data quality", body, refresh=60)


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return escape(text if len(text) <= 400 else text[:400] + " …")


def render_report(request: Request, dataset: str, ds: str, report: dict[str, Any] | None) -> str:
    """A partition's validation report: served whole by the plugin (no script, style or font from elsewhere)."""
    title = f"Validation of {dataset} ds={ds}"
    if report is None:
        return _layout(request, title, f'<p class="muted">{escape(dataset)} ds={escape(ds)} has not been validated '
                                       "yet (its validation task writes this report).</p>")
    ok = bool(report.get("success"))
    checks = [{**c, "status": "warned" if c.get("status") == "failed" and c.get("severity") in ("warn", "off")
               else c.get("status")} for c in report.get("checks") or []]  # a warning does not fail the partition
    failed = [c for c in checks if c.get("status") == "failed"]
    parts = [f'<p class="big {"pass" if ok else "fail"}">{"Passed" if ok else "FAILED"}: {len(checks)} checks, '
             f'{len(failed)} failed, on {escape(str(report.get("rows")))} rows · validated {_time(report.get("validated_at"))} in '
             f'{_duration(report.get("duration_s"))}</p>']
    quarantined = report.get("quarantined")
    if quarantined is not None:
        message = str(quarantined.get("message") or "").splitlines()
        parts.append(f'<p class="warn">Quarantined {_time(quarantined.get("quarantined_at"))}: '
                     f'{escape(message[0] if message else "")}. Restore: <code>{escape(str(quarantined.get("restore") or ""))}'
                     "</code></p>")
    order = {"failed": 0, "warned": 1, "passed": 2}
    rows = [[f'<span class="{"fail" if c.get("status") == "failed" else "pass" if c.get("status") == "passed" else "warn"}">'
             f'{escape(str(c.get("status")))}</span>', escape(str(c.get("name"))), _value(c.get("observed")),
             _value(c.get("expected")), escape(str(c.get("details") or "")), escape(str(c.get("severity") or ""))]
            for c in sorted(checks, key=lambda c: order.get(str(c.get("status")), 3))]
    parts.append("<h2>Checks</h2>" + _table(["status", "check", "observed", "expected", "details", "severity"], rows,
                                            "no check recorded"))
    parts.append(f'<p class="muted">Partition <code>{escape(str(report.get("partition") or ""))}</code>. '
                 f'{_a(report.get("gx_data_docs"), "Great Expectations Data Docs")} (its page loads styles and '
                 "scripts from public CDNs: blank on a closed network; this page has the same results).</p>")
    return _layout(request, title, "".join(parts))


def render_models(request: Request, families: list[dict[str, Any]]) -> str:
    """Each family's champion, the history of its alias (every promotion and rollback) and its versions."""
    parts = ['<p class="muted">Every move of a champion alias is recorded (when, from which version, by whom or which '
             "run, why). To move one back: trigger <code>pinflow_rollback</code> (model, to_version, reason); the "
             "corpus is re-scored with the restored version.</p>"]
    for fam in families:
        now = f"champion: version {escape(fam['champion'])}" if fam["champion"] else "no champion yet"
        parts.append(f'<h2>{escape(fam["family"])} <span class="muted">(model {escape(fam["model_name"])}; {now})</span></h2>')
        if fam["error"]:
            parts.append(f'<p class="warn">{escape(fam["error"])}</p>')
        parts.append(_table(["when", "from", "to", "kind", "by", "why"], [[
            _time(m.get("moved_at")), escape(str(m.get("from_version") or "—")), f'<b>{escape(str(m["to_version"]))}</b>',
            escape(str(m.get("kind") or "")), escape(str(m.get("moved_by") or "")), escape(str(m.get("reason") or "")[:300]),
        ] for m in reversed(fam["moves"])], "the alias has not moved yet"))
        if fam["versions"]:
            parts.append(_table(["version", "registered", "mean AUC", "champion", "promotion gate"], [[
                f'<b>{escape(v["version"])}</b>' + (" (champion)" if v["version"] == fam["champion"] else ""),
                _time(v.get("created")), _auc(v.get("mean_auc")),
                "<br>".join(f"{_time(a)} – {_time(b) if b else 'now'}" for a, b in v["champion_periods"]) or "—",
                escape(str(v.get("promotion") or "")[:200]),
            ] for v in fam["versions"]]))
    return _layout(request, "Models", "".join(parts), refresh=60)


def render_job(request: Request, job: dict[str, Any] | None, logs: str, backend: str, job_id: str) -> str:
    if job is None:
        body = (f'<p class="muted">Job {escape(job_id)} on {escape(backend)} is not in the job history, which records '
                "training jobs (their quota, time and cost): a feature build or scoring job is described by its "
                "task's log.</p>")
    else:
        body = _table(["field", "value"], [[escape(k), escape(str(v))] for k, v in job.items() if k != "links"])
        body += f"<p>{_run_link(request, job)}</p>"
    if logs:
        body += f"<h2>Node logs (last lines)</h2><pre>{escape(logs)}</pre>"
    return _layout(request, f"{backend} job {job_id}", body, refresh=15 if job and job.get("state") == "RUNNING" else None)


# --- the app ----------------------------------------------------------------------------------------------


def training_runs(limit: int = 100) -> list[dict[str, Any]]:
    """The DAG runs with a training job, newest first: one entry per run (its newest try)."""
    from services import job_history as history

    runs: dict[tuple[str, str], dict[str, Any]] = {}
    trial_jobs: dict[tuple[str, str], set[str]] = {}
    for row in history.rows(newest_first=True, limit=limit * 4):
        key = (row.get("dag_id") or "", row.get("run_id") or "")
        if key[0] in pages.STUDY_DAGS:  # a study: its jobs are trials (one per trial, whatever its tries)
            trial_jobs.setdefault(key, set()).add(str(row.get("checkpoint_dir") or row["job_name"]))
        if key in runs:
            runs[key]["tries"] = max(runs[key]["tries"], int(row.get("try_number") or 1))
            if runs[key].get("promoted") is None and row.get("promoted") is not None:
                runs[key]["promoted"] = row["promoted"]
            continue
        view = {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in row.items()}
        runs[key] = {**view, "tries": int(row.get("try_number") or 1)}
    for key, jobs in trial_jobs.items():
        runs[key]["trials"] = len(jobs)
    return list(runs.values())[:limit]


# The days a page shows: a year at most (a page of more would take minutes to draw); fewer than one is none.
Days = Annotated[int, Query(ge=1, le=366, description="days shown, ending today (1 to 366)")]


def _allowed_file(parts: list[str]) -> bool:
    """Only validation reports / Data Docs and quarantined partitions' reports are served (no data files)."""
    if not parts or any(p in ("", ".", "..") or "\\" in p for p in parts):
        return False
    if parts[:2] == ["reports", "validation"] and len(parts) >= 5:
        return True
    return parts[0] == "quarantine" and len(parts) >= 6 and parts[4] == "report"


def create_app() -> FastAPI:
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView, DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag, requires_access_view

    from core import config, storage
    from services import job_history as history

    app = FastAPI(
        title="pinflow pages",
        description="Platform, training runs and data quality of pinflow (auth as Airflow's API)",
        dependencies=[Depends(requires_access_view(AccessView.PLUGINS))],
    )
    dag_runs = [Depends(requires_access_dag("GET", DagAccessEntity.RUN))]

    def cfg() -> Any:
        return config.load()

    @app.get("/", include_in_schema=False)
    def index(request: Request) -> RedirectResponse:
        return RedirectResponse(f"{_prefix(request)}/platform")

    @app.get("/api/platform")
    def api_platform(days: Days = 14) -> JSONResponse:
        return JSONResponse(jsonable_encoder(pages.platform(cfg(), days)))

    @app.get("/platform", response_class=HTMLResponse)
    def platform_page(request: Request, days: Days = 14) -> HTMLResponse:
        return HTMLResponse(render_platform(request, pages.platform(cfg(), days)))

    @app.get("/api/runs")
    def api_runs() -> JSONResponse:
        return JSONResponse(jsonable_encoder(training_runs()))

    @app.get("/runs", response_class=HTMLResponse)
    def runs_page(request: Request) -> HTMLResponse:
        return HTMLResponse(render_runs(request, training_runs()))

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=dag_runs)
    def api_run(dag_id: str, run_id: str, session: SessionDep) -> JSONResponse:
        state = dag_run_state(session, dag_id, run_id)
        return JSONResponse(jsonable_encoder(pages.training_run(cfg(), dag_id, run_id, dag_run_state=state)))

    @app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse, dependencies=dag_runs)
    def run_page(request: Request, dag_id: str, run_id: str, session: SessionDep) -> HTMLResponse:
        state = dag_run_state(session, dag_id, run_id)
        return HTMLResponse(render_run(request, pages.training_run(cfg(), dag_id, run_id, dag_run_state=state)))

    @app.get("/runs/{dag_id}/{run_id}/mlflow", dependencies=dag_runs, response_model=None)
    def run_mlflow(request: Request, dag_id: str, run_id: str) -> Response:
        rows = history.rows(dag_id=dag_id, run_id=run_id)
        latest = rows[-1] if rows else None
        result = None
        if latest and latest.get("output_dir"):
            result = pages._read_json(storage.join(latest["output_dir"], "result.json"))
        ml = pages.mlflow_links(cfg(), latest.get("checkpoint_dir") if latest else None, result)
        if ml:
            return RedirectResponse(ml["run_url"], status_code=307)
        state = latest["state"] if latest else "not submitted"
        body = (f"<p>The training job of this run ({escape(state)}) has not created its MLflow run yet: it does so "
                f"as soon as its ranks start. This link opens it from then on.</p>"
                f"<p>{_a(_run_href(request, dag_id, run_id), 'Progress of this run')}</p>")
        return HTMLResponse(_layout(request, "MLflow run not created yet", body, refresh=10))

    @app.get("/api/data-quality")
    def api_data_quality(days: Days = 14) -> JSONResponse:
        return JSONResponse(jsonable_encoder(pages.data_quality(cfg(), days)))

    @app.get("/data-quality", response_class=HTMLResponse)
    def data_quality_page(request: Request, days: Days = 14) -> HTMLResponse:
        return HTMLResponse(render_data_quality(request, pages.data_quality(cfg(), days)))

    @app.get("/api/models")
    def api_models() -> JSONResponse:
        return JSONResponse(jsonable_encoder(pages.models(cfg())))

    @app.get("/models", response_class=HTMLResponse)
    def models_page(request: Request) -> HTMLResponse:
        return HTMLResponse(render_models(request, pages.models(cfg())))

    @app.get("/data-quality/report/{dataset}/{ds}", response_class=HTMLResponse)
    def report_page(request: Request, dataset: str, ds: str) -> HTMLResponse:
        if not _allowed_file(["reports", "validation", dataset, f"ds={ds}", "result.json"]):
            raise HTTPException(404, "no such partition")
        report = pages.validation_report(cfg(), dataset, ds)
        return HTMLResponse(render_report(request, dataset, ds, report), status_code=200 if report else 404)

    @app.get("/data-quality/docs/{dataset}/{ds}", response_model=None)
    def data_docs(request: Request, dataset: str, ds: str) -> Response:
        from core.contracts import VALIDATION_REPORTS

        folder = storage.join(cfg().storage_root, VALIDATION_REPORTS, dataset, f"ds={ds}")
        for rel in ("data_docs/index.html", "index.html"):
            if _allowed_file(["reports", "validation", dataset, f"ds={ds}", *rel.split("/")]) and \
                    storage.exists(storage.join(folder, *rel.split("/"))):
                target = "/".join(quote(p, safe="=") for p in ("reports", "validation", dataset, f"ds={ds}", rel))
                return RedirectResponse(f"{_prefix(request)}/files/{target}", status_code=307)
        raise HTTPException(404, f"no validation report for {dataset} ds={ds} under {folder} (not validated yet)")

    @app.get("/files/{path:path}", response_model=None)
    def files(path: str) -> Response:
        parts = path.split("/")
        if not _allowed_file(parts):
            raise HTTPException(404, "only validation reports, Data Docs and quarantine reports are served")
        location = storage.join(cfg().storage_root, *parts)
        try:
            content = storage.read_bytes(location)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise HTTPException(404, f"{path} not found") from None
        media = mimetypes.guess_type(parts[-1])[0] or "application/octet-stream"
        return Response(content, media_type=media)

    @app.get("/api/jobs/{backend}/{job_id}")
    def api_job(backend: str, job_id: str) -> JSONResponse:
        rows = history.rows(backend=backend, job_id=job_id, newest_first=True, limit=1)
        return JSONResponse(jsonable_encoder(rows[0] if rows else None))

    @app.get("/jobs/{backend}/{job_id}", response_class=HTMLResponse)
    def job_page(request: Request, backend: str, job_id: str) -> HTMLResponse:
        rows = history.rows(backend=backend, job_id=job_id, newest_first=True, limit=1)
        logs = ""
        if backend == "local":
            from operators.backends.local import LocalBackend

            try:
                logs = LocalBackend(cfg().home).logs(job_id, tail=80)
            except (LookupError, OSError) as err:
                logs = f"(no logs: {err})"
        job = pages._job_view(rows[0], history.now()) if rows else None
        return HTMLResponse(render_job(request, job, logs, backend, job_id))

    return app
