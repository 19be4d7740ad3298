"""MLflow on rank 0 (``training.tracking``): a model is registered once per run, whatever failed after it was."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from training.config import RunConfig

pytestmark = pytest.mark.unit

FAMILIES = Path(__file__).resolve().parents[1] / "families"


@pytest.fixture
def tiny_click(tmp_path: Path, monkeypatch) -> Iterator[tuple[RunConfig, Any, str]]:
    """A run of the test family tiny_click tracked in a SQLite MLflow under ``tmp_path``: its config, family, URI."""
    monkeypatch.syspath_prepend(str(FAMILIES))
    from training.sdk import load_family

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = RunConfig.from_dict({
        "root": str(tmp_path), "train_days": ["2026-01-01"], "eval_ds": "2026-01-02", "output_dir": str(tmp_path / "job"),
        "checkpoint_dir": str(tmp_path / "checkpoints"), "mlflow_tracking_uri": uri,
        "mlflow_artifact_location": str(tmp_path / "artifacts"), "family": "tiny_click", "family_module": "tiny_click",
    })
    yield config, load_family("tiny_click", "tiny_click", {}), uri
    sys.modules.pop("tiny_click", None)


def test_a_retry_whose_state_file_was_lost_finds_the_version_in_the_registry(tmp_path: Path, tiny_click):
    """Registration, then writing the state file beside the checkpoints failed (a full disk, say): the retry continues
    the same MLflow run, and the registry, asked for this run's version, stops it registering a second."""
    from mlflow import MlflowClient

    from training.tracking import STATE_FILE, Tracker

    config, family, uri = tiny_click
    first = Tracker(config)
    uri_1, version_1 = first.log_model(family, family.build_model(), {"family": "tiny_click"}, examples_seen=40)
    first.end("FAILED")
    state = tmp_path / "checkpoints" / STATE_FILE
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({k: saved[k] for k in ("run_id", "experiment_id")}))  # what a try had written before

    again = Tracker(config)
    assert again.run_id == first.run_id  # the same run, continued
    assert again.log_model(family, family.build_model(), {"family": "tiny_click"}, examples_seen=40) == (uri_1, version_1) == (
        "models:/tiny_click/1", "1")
    again.end()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert [str(v.version) for v in client.search_model_versions("name='tiny_click'")] == ["1"]
    assert json.loads(state.read_text())["model_version"] == "1"


def test_a_run_resumed_with_more_epochs_registers_the_model_it_trained_on(tmp_path: Path, tiny_click):
    """A finished run resumed with more epochs trains on from its last checkpoint in the same MLflow run: its model
    is a new version (before, the version of the shorter run was reported for it), and a retry of the extended run
    (its state file lost) finds that new version rather than the first."""
    from mlflow import MlflowClient

    from training.tracking import EXAMPLES_TAG, STATE_FILE, Tracker

    config, family, uri = tiny_click
    first = Tracker(config)
    first.log_params({"epochs": 1, "lr": 0.01})
    assert first.log_model(family, family.build_model(), {"family": "tiny_click"}, examples_seen=40) == ("models:/tiny_click/1", "1")
    first.end()

    extended = Tracker(config)
    assert extended.run_id == first.run_id
    extended.log_params({"epochs": 3, "lr": 0.01})  # the run's params keep 1 (MLflow); the tag says 3
    assert extended.log_model(family, family.build_model(), {"family": "tiny_click"}, examples_seen=120) == (
        "models:/tiny_click/2", "2")
    extended.end()
    state = tmp_path / "checkpoints" / STATE_FILE
    assert json.loads(state.read_text())["model_examples"] == 120
    state.write_text(json.dumps({k: json.loads(state.read_text())[k] for k in ("run_id", "experiment_id")}))
    retry = Tracker(config)
    assert retry.log_model(family, family.build_model(), {"family": "tiny_click"}, examples_seen=120) == (
        "models:/tiny_click/2", "2")
    retry.end()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    versions = {str(v.version): v for v in client.search_model_versions("name='tiny_click'")}
    assert sorted(versions) == ["1", "2"]
    assert versions["1"].tags[EXAMPLES_TAG] == "40" and versions["2"].tags[EXAMPLES_TAG] == "120"
    assert versions["1"].run_id == versions["2"].run_id == first.run_id
    run = client.get_run(first.run_id).data
    assert run.params["epochs"] == "1" and run.tags["pinflow.resumed_with.epochs"] == "3"
    assert "pinflow.resumed_with.lr" not in run.tags


def test_a_tracking_server_that_does_not_answer_stops_the_submit():
    """The training operator's preflight asks the tracking server's /health before submitting (issue 37, 8)."""
    import http.server
    import socket
    import threading

    from core.failures import InfraError
    from operators.training import tracking_server_answers

    class Health(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(Health.status if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        tracking_server_answers(url)  # answers
        tracking_server_answers("")  # no tracking
        tracking_server_answers("sqlite:////nowhere/mlflow.db")  # the job opens a database itself
        Health.status = 503
        with pytest.raises(InfraError, match=r"does not answer \(HTTP 503\).*nothing was submitted"):
            tracking_server_answers(url)
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(InfraError, match="PINFLOW_MLFLOW__TRACKING_URI"):
        tracking_server_answers(f"http://127.0.0.1:{closed}", timeout_s=5)


def test_a_run_of_another_family_is_refused_a_registered_model_of_one_family(tmp_path: Path, monkeypatch):
    """model_name names a registered model of one family: a run of another family given that name is refused before
    an MLflow run is started (it registered a content model as the next version of a ranker)."""
    monkeypatch.syspath_prepend(str(FAMILIES))
    from mlflow import MlflowClient

    from core.failures import ConfigError
    from training.sdk import load_family
    from training.tracking import FAMILY_TAG, Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = {
        "root": str(tmp_path), "train_days": ["2026-01-01"], "eval_ds": "2026-01-02", "output_dir": str(tmp_path / "job"),
        "mlflow_tracking_uri": uri, "mlflow_artifact_location": str(tmp_path / "artifacts"), "model_name": "shared",
    }
    first = Tracker(RunConfig.from_dict({**common, "checkpoint_dir": str(tmp_path / "a"), "family": "tiny_click",
                                         "family_module": "tiny_click"}))
    family = load_family("tiny_click", "tiny_click", {})
    assert first.log_model(family, family.build_model(), {"family": "tiny_click"}, examples_seen=8)[1] == "1"
    first.end()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert client.get_registered_model("shared").tags[FAMILY_TAG] == "tiny_click"
    runs = len(client.search_runs([first.experiment_id]))
    with pytest.raises(ConfigError, match="model_name 'shared' holds versions of family 'tiny_click', and this run "
                                          "trains family 'pin_content': give this run a model_name of its own"):
        Tracker(RunConfig.from_dict({**common, "checkpoint_dir": str(tmp_path / "b"), "family": "pin_content"}))
    assert len(client.search_runs([first.experiment_id])) == runs  # no run started for it
    sys.modules.pop("tiny_click", None)
