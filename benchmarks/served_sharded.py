"""Benchmark of the served sharded model (issue 32 item 3): a corpus scorer's peak memory, sharded against whole.

    .venv/bin/python benchmarks/served_sharded.py                  # pin table 1,000,003 x 32 (122 MiB), 2 ranks
    .venv/bin/python benchmarks/served_sharded.py --pin-rows 200003  # a quick run

The ranker is trained on a tiny synthetic world (``training.smoke_data``) by a real 2-rank job (``training.launch``,
strategy torchrec, row-wise) whose pin table is ``--pin-rows`` x ``--dim``: large against the rest of the model.
The job exports it sharded (``sharded_export_above_mib: 0``) and registers it in a SQLite MLflow store; a second
job resumes the same final checkpoint (nothing left to train), gathers it and registers the whole model
(``torch.export`` program) as version 2. Then the corpus is scored twice in ``--shards`` shards, each shard in its
own fresh process (``python -m training.inference --plan ... --shard i``): version 1 with a plan by pin-table rows
(``pin-rows-v1``), version 2 with the plan by snapshot rows. Each part's footer records its process's peak resident
set (``ru_maxrss``, ``peak_rss_mib``) and, sharded, how many shard files it opened; the scores of both must agree.

The last line printed is one JSON object: ``table_mib``, per version the scorers' ``peak_rss_mib``, the sharded
scorers' ``model_files_opened``, ``max_abs_score_diff`` and ``ratio`` (whole / sharded peak, the mean over shards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRAIN_DAYS = ["2026-01-01", "2026-01-02"]
EVAL_DS = "2026-01-03"


def run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def train(work: Path, name: str, **overrides: object) -> dict[str, object]:
    folder = work / name
    folder.mkdir(exist_ok=True)
    config = {
        "root": str(work / "storage"), "train_days": TRAIN_DAYS, "eval_ds": EVAL_DS,
        "output_dir": str(folder / "job"), "checkpoint_dir": str(folder / "checkpoints"),
        "mlflow_tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "mlflow_artifact_location": str(work / "artifacts"),
        "experiment": "served_sharded", "model_name": "served_sharded", "epochs": 1, "batch_size": 32,
        "checkpoint_every": 0, "min_steps": 0, "num_workers": 0, "strategy": "torchrec", "sharding": "row_wise",
        "evaluate_champion": False, **overrides,
    }
    (folder / "RUN.json").write_text(json.dumps(config))
    run(["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config",
         str(folder / "RUN.json")])
    return json.loads((folder / "job" / "result.json").read_text())  # type: ignore[no-any-return]


def score(work: Path, model_uri: str, shards: int, table_rows: int, name: str) -> list[dict[str, object]]:
    from training.inference import make_plan, part_record, publish_plan, published_part, write_plan

    plan = make_plan(model_uri=model_uri, tracking_uri=f"sqlite:///{work / 'mlflow.db'}", root=str(work / "storage"),
                     ds=EVAL_DS, out_dir=work / name, num_shards=shards, table_rows=table_rows)
    location = write_plan(plan)
    for shard in range(shards):  # a fresh process per shard: its peak is its own
        run(["-m", "training.inference", "--plan", location, "--shard", str(shard), "--threads", "1"])
    publish_plan(plan)
    return [part_record(published_part(plan, shard)) or {} for shard in range(shards)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pin-rows", type=int, default=1_000_003)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()

    import pyarrow.parquet as pq

    from training.smoke_data import write_tiny_world

    work = Path(tempfile.mkdtemp(prefix="served-sharded-"))
    try:
        write_tiny_world(work / "storage", [*TRAIN_DAYS, EVAL_DS], rows_per_day=160, pins=400, row_group_size=100,
                         max_sequence=20)
        params = {"pin_buckets": args.pin_rows, "sparse_dim": args.dim, "ablation": False}
        sharded = train(work, "sharded", sharded_export_above_mib=0, params=params)
        shutil.copytree(work / "sharded" / "checkpoints", work / "whole" / "checkpoints",
                        ignore=shutil.ignore_patterns("mlflow_run.json"))
        whole = train(work, "whole", params=params)
        runs = {
            "sharded": score(work, str(sharded["model_uri"]), args.shards, args.pin_rows, "scores-sharded"),
            "whole": score(work, str(whole["model_uri"]), args.shards, 0, "scores-whole"),
        }
        a = pq.read_table(work / "scores-sharded").to_pandas().set_index("pin_id").sort_index()
        b = pq.read_table(work / "scores-whole").to_pandas().set_index("pin_id").sort_index()
        if list(a.index) != list(b.index):
            raise SystemExit("the two runs scored different pins")
        diff = float((a - b).abs().to_numpy().max())
        peaks = {name: [float(r["peak_rss_mib"]) for r in records] for name, records in runs.items()}  # type: ignore[arg-type]
        mean = {name: sum(v) / len(v) for name, v in peaks.items()}
        out = {
            "table_mib": round(args.pin_rows * args.dim * 4 / 2**20, 1),
            "pins": len(a),
            "shards": args.shards,
            "peak_rss_mib": peaks,
            "model_files_opened": [r.get("model_files_opened") for r in runs["sharded"]],
            "max_abs_score_diff": diff,
            "ratio": round(mean["whole"] / mean["sharded"], 2),
        }
        print(f"scorer peak RSS (MiB), pin table {out['table_mib']} MiB: whole {peaks['whole']}, sharded "
              f"{peaks['sharded']} ({out['ratio']}x less); max |score difference| {diff:.2e}")
        print(json.dumps(out), flush=True)
        if diff > 1e-6:
            raise SystemExit(f"the sharded model's scores differ from the whole model's by {diff}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
