"""A sharded export on S3 (a moto server over HTTP that records every request): the training world evaluates
through the trained, still-sharded model and fetches no table file; a corpus scorer of one pin-rows plan part
fetches only its own file of the pin table.

Two ranks of ``torchrun`` train the ranker with strategy torchrec row-wise and the export threshold at 0; the run
folder (checkpoints and export) is in the bucket, the examples stay local. The evaluation day gives the ranks
uneven numbers of evaluation batches (row groups of 60 rows, batches of 16), so the lockstep padding is exercised;
its metrics must equal the export's evaluated in this process (the promotion gate's path: over the table files).

The record is of this test's server only: the test process's own reads (the scorer's) reach it because
``s3_environment`` drops the s3fs filesystems cached for an earlier test's server. Without that, after another S3 test
in the same process, the scorer read the same bucket through the shared moto server (moto's buckets are the process's,
so it scored) and the record saw no fetch of its pin-table file.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import s3_bucket, s3_environment
from test_train_torchrun import EVAL_DS, TRAIN_DAYS, run, run_config

from training.smoke_data import write_tiny_world

pytestmark = pytest.mark.integration

BUCKET = "pinflow-sharded"
LAUNCH = ["-m", "training.launch", "--nproc-per-node", "2", "--", "-m", "training.train", "--config"]


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[tuple[Any, list[tuple[str, str]]]]:
    """A moto S3 server of this test on a free port, recording (method, path) of every request, and a bucket there
    (this process's environment, which the jobs inherit, points at it): the bucket's filesystem and the record."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class Quiet(MotoRequestHandler):
        def log_request(self, *args: Any, **kwargs: Any) -> None:  # the record is the log: keep failures readable
            pass

    record: list[tuple[str, str]] = []
    app = DomainDispatcherApplication(create_backend_app)

    def recording(environ: dict[str, Any], start_response: Any) -> Any:
        record.append((environ["REQUEST_METHOD"], urllib.parse.unquote(environ.get("PATH_INFO", ""))))
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, recording, threaded=True, request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with s3_bucket(f"http://127.0.0.1:{server.server_port}", tmp_path, BUCKET) as fs:
            yield fs, record
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_the_process_filesystem_follows_the_server_each_test_points_it_at(tmp_path: Path):
    """s3fs caches a filesystem per process by its arguments; each test's server must still get this process's
    requests (no request is made here: a client is made, not used)."""
    from core import storage

    endpoints = []
    for endpoint in ("http://first.invalid", "http://second.invalid"):
        with s3_environment(endpoint, tmp_path):
            fs, _ = storage.filesystem(f"s3://{BUCKET}/models")
            fs.connect()
            endpoints.append(fs.s3.meta.endpoint_url)
    assert endpoints == ["http://first.invalid", "http://second.invalid"]


def test_sharded_export_on_s3_evaluated_without_fetching_tables_and_scored_by_pin_rows(tmp_path: Path, s3):
    from mlflow import MlflowClient

    from core import storage
    from training import sharded_export
    from training.champion import CHAMPION_ALIAS, evaluate_champion
    from training.config import RunConfig
    from training.inference import Scorer, make_plan, score_plan_shard, write_plan

    fs, record = s3
    root = tmp_path / "storage"
    write_tiny_world(root, [*TRAIN_DAYS, EVAL_DS], rows_per_day=160, pins=90, row_group_size=60, max_sequence=20)
    run_folder = f"s3://{BUCKET}/models/pin_ranker/run-1"
    config = run_config(tmp_path, epochs=1, strategy="torchrec", sharding="row_wise", sharded_export_above_mib=0,
                        checkpoint_dir=f"{run_folder}/checkpoints", eval_batch_size=16, params={"ablation": False})
    proc = run([*LAUNCH, str(config)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    during_training = list(record)
    result = json.loads((tmp_path / "job" / "result.json").read_text())
    assert result["sharded_export"].startswith(f"{run_folder}/export/") and result["evaluated_by_ranks"] == 2
    assert result["metrics"]["examples"] == 160

    base, manifest = sharded_export.read_manifest(result["sharded_export"])
    files = {table: [urllib.parse.urlsplit(storage.join(base, s["file"])) for s in info["shards"]]
             for table, info in manifest["tables"].items()}
    paths = {table: [f"/{url.netloc}{url.path}" for url in urls] for table, urls in files.items()}
    every = {path for table in paths.values() for path in table}
    assert len(paths["pin_emb"]) == 2 and len(every) == 2 * len(paths)  # each table a file per rank
    written = {path for method, path in during_training if method in ("PUT", "POST")}
    assert every <= written  # the record sees the job's requests: every table file was written through it
    # (a) The evaluation looked its rows up through the sharded model's all-to-alls: no rank fetched a table file.
    assert not [path for method, path in during_training if method == "GET" and path in every]

    # (b) A scorer of one part of a pin-rows plan (2 parts: one per training rank's pin rows) fetches its own file of
    # the pin table and no other.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = make_plan(model_uri=result["model_uri"], tracking_uri=uri, root=str(root), ds=EVAL_DS,
                     out_dir=tmp_path / "inference", num_shards=2, table_rows=result["sharded_table_rows"])
    write_plan(plan)
    before = len(record)
    scorer = Scorer.load(plan.model_uri, uri)
    summary = score_plan_shard(plan, 1, scorer)
    assert summary["rows"] > 0
    fetched = [path for method, path in record[before:] if method == "GET" and path in every]
    assert [path for path in fetched if path in paths["pin_emb"]] == [paths["pin_emb"][1]]
    assert len(fetched) == len(set(fetched))  # each file fetched once

    # The metrics the ranks computed through the sharded model are those of the export itself, evaluated over its
    # table files from the bucket (the promotion gate's evaluation of a sharded champion).
    MlflowClient(tracking_uri=uri, registry_uri=uri).set_registered_model_alias("pin_ranker_test", CHAMPION_ALIAS, "1")
    champion = evaluate_champion(RunConfig.from_json(config), scorer.family, None, device="cpu")
    assert champion is not None and "error" not in champion, champion
    got, want = result["metrics"], champion["metrics"]
    assert got["examples"] == want["examples"]
    for key in ("auc", "hit3", "logloss", "calibration", "oracle_auc"):
        assert set(got[key]) == set(want[key]) != set(), key
        for label, value in want[key].items():
            assert got[key][label] == pytest.approx(value, abs=1e-6), (key, label)
