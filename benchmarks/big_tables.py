"""Proof at a size that does not fit one rank (issue 32 item 5): a pin table larger than a rank's memory budget.

    .venv/bin/python benchmarks/big_tables.py                                 # 25,200,000 x 64 (6.0 GiB), 4 GiB
    .venv/bin/python benchmarks/big_tables.py --pin-rows 2000003 --budget-gib 0.6  # a quick run (0.48 GiB table)

Two ranks (``training.launch``, strategy torchrec, row-wise) train the ranker on a tiny synthetic world
(``training.smoke_data``, 400 pins) with a pin table of ``--pin-rows`` x ``--dim`` float32: at least 1.5x one rank's
budget ``--budget-gib``, so no rank could hold it. The first job checkpoints (DCP, each rank its rows) and is killed
(SIGKILL of rank 1) after its first checkpoint; the retry resumes it, trains to the end, exports it sharded (each
rank its rows, ``training.sharded_export``), evaluates it in the training world and registers it (SQLite MLflow).
Then the corpus is scored by pin-table rows (``pin-rows-v1``) in 2 shards, each in its own fresh process.

Memory is measured, not limited (``RLIMIT_AS`` fails torch, which reserves far more address space than it uses):
every heartbeat of a rank carries its process's peak resident set so far (``peak_rss_bytes``, ``VmHWM``); the
benchmark follows both ranks' heartbeats, reads ``/proc/<pid>/status`` just before the kill, and credits each
rise of the peak to the phase it happened in (build, resume, train, checkpoint, export, evaluate); each scorer's
part records its own peak (``peak_rss_mib``). A process's own memory counts against the budget (python, torch,
TorchRec, MLflow: 0.38 GiB before the build; 0.6 to 0.7 GiB beside the rank's rows once built and training).

The last line printed is one JSON object: ``table_bytes``, ``rank_budget_bytes``, ``peak_rss_bytes_per_rank`` (max
over ranks and phases), ``peak_rss_bytes_by_phase`` (each the max over ranks of the process's peak at that phase's
end), ``trained``, ``resumed_exact``, ``exported_sharded``, ``pins_scored``, ``corpus_pins``, ``seconds`` and
``ok`` (every invariant held); the exit code is 1 when one did not. The work folder (several GiB of checkpoints
and export) is a temporary folder under ``--workdir``, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.served_sharded import EVAL_DS, TRAIN_DAYS, score  # noqa: E402

# A heartbeat's phase -> the phase of the proof it belongs to (anything else: "evaluate", the job's end).
PHASES = {"starting": "build", "loading data": "build", "building the model": "build",
          "resuming from the newest checkpoint": "resume", "training": "train", "checkpointing": "checkpoint",
          "exporting": "export"}
LAUNCH = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config"]


def proof_phase(heartbeat_phase: str) -> str:
    return next((v for k, v in PHASES.items() if heartbeat_phase.startswith(k)), "evaluate")


def vm_hwm(pid: int) -> int | None:
    """A live process's peak resident set (bytes), None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Follow:
    """Both ranks' heartbeats of one job: each rank's (phase, peak so far) in the order seen; a rise in the peak
    between two readings is credited to the phase of the earlier one (where the process was meanwhile)."""

    def __init__(self, job: Path) -> None:
        self.job = job
        self.since = time.time()
        self.seen: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
        self.trace: dict[int, list[tuple[str, int, int]]] = {0: [], 1: []}  # (phase, step, MiB) as they change
        self.beats: dict[int, dict[str, Any]] = {0: {}, 1: {}}

    def poll(self) -> None:
        for rank in (0, 1):
            try:
                beat = json.loads((self.job / f"heartbeat-rank{rank}.json").read_text())
            except (OSError, ValueError):
                continue
            if float(beat.get("unix_time", 0)) < self.since:
                continue  # an earlier try's last beat
            self.beats[rank] = beat
            self.add(rank, str(beat.get("phase", "")), int(beat.get("peak_rss_bytes", 0)), int(beat.get("step", 0)))

    def add(self, rank: int, phase: str, peak: int, step: int = 0) -> None:
        if not self.seen[rank] or self.seen[rank][-1] != (phase, peak):
            self.seen[rank].append((phase, peak))
        mib = peak >> 20
        if not self.trace[rank] or self.trace[rank][-1][0] != phase or self.trace[rank][-1][2] != mib:
            self.trace[rank].append((phase, step, mib))

    def by_phase(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per phase, the max over ranks of the peak reached by its end, and of the rise of the peak in it."""
        peak: dict[str, int] = {}
        rise: dict[str, int] = {}
        for seen in self.seen.values():
            for (phase, before), (_, later) in zip(seen, seen[1:], strict=False):
                key = proof_phase(phase)
                peak[key] = max(peak.get(key, 0), later)
                rise[key] = max(rise.get(key, 0), later - before)
        return peak, rise


def config(work: Path, rows: int, dim: int) -> Path:
    path = work / "RUN.json"
    path.write_text(json.dumps({
        "root": str(work / "storage"), "train_days": TRAIN_DAYS, "eval_ds": EVAL_DS,
        "output_dir": str(work / "job"), "checkpoint_dir": str(work / "checkpoints"),
        "mlflow_tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "mlflow_artifact_location": str(work / "artifacts"),
        "experiment": "big_tables", "model_name": "big_tables", "epochs": 1, "batch_size": 32, "min_steps": 0,
        "num_workers": 0, "strategy": "torchrec", "sharding": "row_wise", "sharded_export_above_mib": 0,
        "checkpoint_every": 1, "keep_checkpoints": 1, "heartbeat_every_s": 0.2, "evaluate_champion": False,
        "deterministic": True, "debug_step_sleep_s": 0.5,  # time for the kill to land after the first checkpoint
        "params": {"pin_buckets": rows, "sparse_dim": dim, "ablation": False},
    }))
    return path


def launch(run_json: Path, follow: Follow, kill_after_checkpoint: bool) -> tuple[int, int | None, str]:
    """Run the 2-rank job, following its heartbeats; with ``kill_after_checkpoint``, SIGKILL rank 1 once a step
    past the first complete checkpoint has started. Returns (exit code, the step killed at, stderr's tail)."""
    from training.checkpoint import complete_checkpoints

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = run_json.parent / f"launch-{int(kill_after_checkpoint)}.log"
    killed_at = None
    with open(log, "w") as stderr:
        job = subprocess.Popen([sys.executable, *LAUNCH, str(run_json)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=stderr)
        while job.poll() is None:
            follow.poll()
            beat = follow.beats[1]
            if kill_after_checkpoint and killed_at is None and beat.get("phase") == "training":
                saved = complete_checkpoints(run_json.parent / "checkpoints")
                if saved and int(beat.get("step", 0)) > saved[-1][0]:
                    for rank in (0, 1):  # the peaks so far, checkpoint included, before rank 1 goes
                        peak = vm_hwm(int(follow.beats[rank]["pid"]))
                        if peak is not None:
                            follow.add(rank, "killed", peak)
                    os.kill(int(beat["pid"]), signal.SIGKILL)
                    killed_at = int(beat["step"])
            time.sleep(0.05)
    follow.poll()  # the last beats ("done", with the process's final peak)
    return job.returncode, killed_at, log.read_text()[-4000:]


def check_resources(work: Path, table_bytes: int, budget: int) -> None:
    """Refuse before any compute if this machine cannot take it: two ranks' budgets and a margin of memory, and
    disk for two checkpoints (the new one is written before the old one goes) and the export."""
    available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    if available < 2 * budget + 2 * 2**30:
        raise SystemExit(f"big_tables: {available / 2**30:.1f} GiB of memory available, the two ranks need "
                         f"2 x {budget / 2**30:.1f} GiB and 2 GiB spare: free some memory or lower --budget-gib")
    free = shutil.disk_usage(work).free
    if free < 3.5 * table_bytes:
        raise SystemExit(f"big_tables: {free / 2**30:.1f} GiB free under {work}, checkpoints and the export need "
                         f"about {3.5 * table_bytes / 2**30:.1f} GiB: pass another --workdir")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pin-rows", type=int, default=25_200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--budget-gib", type=float, default=4.0, help="each rank's memory budget (peak RSS)")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temporary work folder goes")
    args = parser.parse_args(argv)

    from training.smoke_data import write_tiny_world

    table_bytes = args.pin_rows * args.dim * 4
    budget = int(args.budget_gib * 2**30)
    if table_bytes < 1.5 * budget:
        raise SystemExit(f"big_tables: the pin table ({table_bytes / 2**30:.2f} GiB) must be at least 1.5x the "
                         f"budget ({budget / 2**30:.2f} GiB): raise --pin-rows or lower --budget-gib")
    check_resources(Path(args.workdir), table_bytes, budget)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="big-tables-", dir=args.workdir))
    try:
        # Three steps (checkpoint_every 1 at this length), so the job writes its tables few times.
        write_tiny_world(work / "storage", [*TRAIN_DAYS, EVAL_DS], rows_per_day=96, pins=400, row_group_size=48,
                         max_sequence=20)
        run_json = config(work, args.pin_rows, args.dim)
        first = Follow(work / "job")
        code, killed_at, tail = launch(run_json, first, kill_after_checkpoint=True)
        if killed_at is None or code == 0:
            raise SystemExit(f"big_tables: the first job was not killed after a checkpoint (exit {code}):\n{tail}")
        second = Follow(work / "job")
        code, _, tail = launch(run_json, second, kill_after_checkpoint=False)
        if code != 0:
            raise SystemExit(f"big_tables: the resumed job failed (exit {code}):\n{tail}")
        result = json.loads((work / "job" / "result.json").read_text())
        parts = score(work, str(result["model_uri"]), 2, args.pin_rows, "scores")

        from core.storage import read_table

        corpus = read_table(work / "storage", "raw/pins", EVAL_DS, columns=["pin_id"]).num_rows
        phases: dict[str, int] = {}
        rises: dict[str, int] = {}
        for follow in (first, second):
            peaks, rise = follow.by_phase()
            for phase, peak in peaks.items():
                phases[phase] = max(phases.get(phase, 0), peak)
                rises[phase] = max(rises.get(phase, 0), rise[phase])
        phases["score"] = max(int(float(p["peak_rss_mib"]) * 2**20) for p in parts)
        resume = result.get("resume") or {}
        manifest = {}
        if result.get("sharded_export"):
            manifest = json.loads((Path(result["sharded_export"]) / "MANIFEST.json").read_text())
        pin_shards = manifest.get("tables", {}).get("pin_emb", {}).get("shards", [])
        out: dict[str, Any] = {
            "table_bytes": table_bytes,
            "table_shape": [args.pin_rows, args.dim],
            "rank_budget_bytes": budget,
            "peak_rss_bytes_per_rank": max(phases.values()),
            "peak_rss_bytes_by_phase": phases,
            "rss_rise_bytes_by_phase": rises,
            "trained": int(result["steps"]) > int(resume.get("step", 0)) > 0,
            "killed_at_step": killed_at,
            "resumed_from_step": resume.get("step"),
            "resumed_exact": resume.get("exact") is True,
            "exported_sharded": len(pin_shards) == 2 and result.get("evaluated_by_ranks") == 2,
            "pins_scored": sum(int(p["rows"]) for p in parts),
            "corpus_pins": corpus,
            "seconds": round(time.monotonic() - started, 1),
            "rss_trace_mib": {job: {rank: follow.trace[rank] for rank in (0, 1)}
                              for job, follow in (("killed", first), ("resumed", second))},
        }
        out["ok"] = bool(out["peak_rss_bytes_per_rank"] <= budget and table_bytes >= 1.5 * budget and out["trained"]
                         and out["resumed_exact"] and out["exported_sharded"] and out["pins_scored"] == corpus)
        gib = {k: round(v / 2**30, 2) for k, v in phases.items()}
        print(f"pin table {table_bytes / 2**30:.2f} GiB, budget {budget / 2**30:.2f} GiB per rank: peak RSS per "
              f"rank by phase (GiB) {gib}; killed at step {killed_at}, resumed at {resume.get('step')} "
              f"(exact {out['resumed_exact']}); {out['pins_scored']} of {corpus} pins scored")
        print(json.dumps(out), flush=True)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
