"""The champion alias's history and the rollback (issue 36, 2) against a real MLflow registry (SQLite): every move
recorded in the job history database and tagged on the versions; a bad rollback moves nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from core import config
from core.config import JobHistoryConfig, MlflowConfig, PlatformConfig
from core.failures import UserError
from services import champions
from services import job_history as history
from services import model_registry as registry
from services.promotion import promote_if_better

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugins"))  # as Airflow puts the plugins folder on sys.path

from pinflow_ui import pages, web  # noqa: E402

pytestmark = pytest.mark.unit
RESULT = {"model_name": "pin_ranker", "model_version": "1", "metrics": {"auc": {"click": 0.7}, "mean_auc": 0.7},
          "eval_ds": "2026-11-20", "steps": 500, "warmup_steps": 20, "train_days": ["2026-11-19"], "champion": None}


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PlatformConfig:
    cfg = PlatformConfig(storage_root=str(tmp_path / "storage"), home=str(tmp_path),
                         mlflow=MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
                         job_history=JobHistoryConfig(url=f"sqlite:///{tmp_path / 'history.db'}"))
    monkeypatch.setattr(config, "load", lambda: cfg)
    client = registry.client(cfg.mlflow)
    client.create_registered_model("pin_ranker")
    experiment = client.create_experiment("x")
    for auc in (0.70, 0.72, 0.69):
        run = client.create_run(experiment).info
        client.log_metric(run.run_id, "eval_mean_auc", auc)
        client.create_model_version("pin_ranker", f"runs:/{run.run_id}/model", run_id=run.run_id)
    return cfg


def test_every_move_is_recorded_and_a_rollback_moves_the_champion_back(platform):
    client = registry.client(platform.mlflow)
    assert promote_if_better(RESULT, tolerance=0.0, moved_by="pin_ranker_training/run-1")["promoted"]
    with champions.model_lock("pin_ranker") as conn:
        champions.move(client, "pin_ranker", "2", kind="promotion", moved_by="pin_ranker_training/run-2",
                       reason="better", conn=conn)
    move = champions.rollback("pin_ranker", "1", "v2 ranks stale pins first", moved_by="ada via pinflow_rollback/r")
    assert move["moved"] and (move["from_version"], move["to_version"]) == ("2", "1")
    assert str(registry.champion(client, "pin_ranker").version) == "1"
    moves = history.alias_moves("pin_ranker")
    assert [(m["from_version"], m["to_version"], m["kind"]) for m in moves] == [
        (None, "1", "promotion"), ("1", "2", "promotion"), ("2", "1", "rollback")]
    assert moves[-1]["moved_by"] == "ada via pinflow_rollback/r" and moves[-1]["reason"] == "v2 ranks stale pins first"
    assert moves[0]["reason"].startswith("the family's first model") and moves[0]["moved_at"].tzinfo is not None
    tags = {v: client.get_model_version("pin_ranker", v).tags for v in ("1", "2")}
    assert tags["1"]["pinflow.champion_reason"] == "rollback by ada via pinflow_rollback/r: v2 ranks stale pins first"
    assert tags["2"]["pinflow.champion_until"] == moves[-1]["moved_at"].isoformat()
    # Already the champion: nothing moves (no re-scoring); this same rollback retried: its move stands.
    assert champions.rollback("pin_ranker", "1", "again", moved_by="bob via pinflow_rollback/s")["moved"] is False
    assert champions.rollback("pin_ranker", "1", "v2 ranks stale pins first",
                              moved_by="ada via pinflow_rollback/r")["moved"] is True
    assert len(history.alias_moves("pin_ranker")) == 3

    # The Models page: the champion, the moves newest first, each version's metrics and champion periods.
    (ranker,) = [f for f in pages.models(platform) if f["family"] == "pin_ranker"]
    assert ranker["champion"] == "1" and len(ranker["moves"]) == 3 and ranker["error"] is None
    by_version = {v["version"]: v for v in ranker["versions"]}
    assert by_version["2"]["mean_auc"] == pytest.approx(0.72) and len(by_version["1"]["champion_periods"]) == 2
    assert by_version["1"]["champion_periods"][-1][1] is None  # champion now
    html = web.render_models(SimpleNamespace(scope={"root_path": "/pinflow"}), pages.models(platform))  # type: ignore[arg-type]
    assert "champion: version 1" in html and "v2 ranks stale pins first" in html and "pinflow_rollback" in html


@pytest.mark.parametrize(("family", "version", "reason", "says"), [
    ("pin_ranker", "9", "why", "pin_ranker (family pin_ranker) has no version 9: its versions are 1, 2, 3"),
    ("pin_content", "2", "why", "pin_content (family pin_content) has no version 2: its versions are none"),
    ("pin_ranker", "two", "why", "to_version='two': give the number of a registered version of pin_ranker"),
    ("pin_ranker", "3", "why", "version 3 of pin_ranker was never champion (its promotion gate: not run): a rollback"),
    ("pin_ranker", "2", " ", "a rollback needs a reason"),
    ("pin_rankr", "2", "why", "unknown model family 'pin_rankr'"),
])
def test_a_bad_rollback_is_a_clear_error_and_moves_nothing(platform, family, version, reason, says):
    promote_if_better(RESULT, tolerance=0.0, moved_by="pin_ranker_training/run-1")
    before = history.alias_moves()
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")):
        champions.rollback(family, version, reason, moved_by="ada")
    assert history.alias_moves() == before
    assert str(registry.champion(registry.client(platform.mlflow), "pin_ranker").version) == "1"


def test_a_move_whose_record_was_lost_is_recorded_by_the_retry(platform):
    """A promote step (or a rollback) that moved the alias and then failed before its record: the retry finds the
    alias moved, decides "already the champion", and records the move it made."""
    client = registry.client(platform.mlflow)
    client.set_registered_model_alias("pin_ranker", registry.CHAMPION, "1")  # the first try's move, unrecorded
    decision = promote_if_better(RESULT, tolerance=0.0, moved_by="pin_ranker_training/run-1")
    assert decision["reason"] == "version 1 is already the champion"
    (move,) = history.alias_moves("pin_ranker")
    assert (move["from_version"], move["to_version"], move["moved_by"]) == (None, "1", "pin_ranker_training/run-1")
    assert "recorded after the move" in move["reason"]
    client.set_model_version_tag("pin_ranker", "3", "promotion", "promoted: better")  # a champion once
    client.set_registered_model_alias("pin_ranker", registry.CHAMPION, "3")  # a rollback's try, unrecorded
    again = champions.rollback("pin_ranker", "3", "v1 is stale", moved_by="ada via pinflow_rollback/r")
    assert again["moved"] and [m["to_version"] for m in history.alias_moves("pin_ranker")] == ["1", "3"]


def test_the_models_page_says_when_the_registry_does_not_answer(platform, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed
    down = platform.model_copy(update={"mlflow": MlflowConfig(tracking_uri=f"http://127.0.0.1:{port}")})
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    families = pages.models(down)
    assert all(f["error"] and "did not answer" in f["error"] for f in families)


# -- promotion: approval (issue 36, 1) ---------------------------------------------------------------------------
@pytest.fixture
def approval_family(platform: PlatformConfig) -> PlatformConfig:
    platform.families["pin_ranker"] = platform.families["pin_ranker"].model_copy(update={"promotion": "approval"})
    return platform


APPROVED = {"asked": True, "approved": True, "rejected": False, "timed_out": False, "responded_by": "alice",
            "responded_at": "2026-11-21T08:00:00+00:00", "timeout_h": 24.0}


def test_an_approval_family_moves_the_champion_only_when_a_person_approved(approval_family):
    client = registry.client(approval_family.mlflow)
    result = {**RESULT, "family": "pin_ranker"}
    unasked = promote_if_better(result, tolerance=0.0, moved_by="pin_ranker_training/run-1")
    assert not unasked["promoted"] and "needs a person's approval" in unasked["reason"]
    rejected = promote_if_better(result, tolerance=0.0, moved_by="pin_ranker_training/run-1",
                                 approval={**APPROVED, "approved": False, "rejected": True, "responded_by": "bob"})
    assert not rejected["promoted"] and rejected["reason"].startswith("rejected by bob at 2026-11-21")
    timed_out = promote_if_better(result, tolerance=0.0, moved_by="pin_ranker_training/run-1",
                                  approval={**APPROVED, "approved": False, "timed_out": True, "responded_by": None})
    assert not timed_out["promoted"] and "no answer within the approval timeout (24.0 h): the champion stays unset" \
        in timed_out["reason"]
    assert registry.champion(client, "pin_ranker") is None and history.alias_moves("pin_ranker") == []
    assert client.get_model_version("pin_ranker", "1").tags["promotion"].startswith("rejected: no answer")

    approved = promote_if_better(result, tolerance=0.0, moved_by="pin_ranker_training/run-1", approval=APPROVED)
    assert approved["promoted"] and approved["approved_by"] == "alice"
    assert str(registry.champion(client, "pin_ranker").version) == "1"
    [move] = history.alias_moves("pin_ranker")
    assert (move["kind"], move["moved_by"]) == ("approval", "alice (approved in pin_ranker_training/run-1)")
    assert client.get_model_version("pin_ranker", "1").tags["pinflow.approved_by"] == "alice"


def test_an_approved_model_the_gate_now_refuses_is_not_promoted(approval_family):
    # Approved, but the champion moved while the question waited: the promote step decides again, on the new one.
    client = registry.client(approval_family.mlflow)
    with champions.model_lock("pin_ranker") as conn:
        champions.move(client, "pin_ranker", "2", kind="promotion", moved_by="run-2", reason="better", conn=conn)
    result = {**RESULT, "family": "pin_ranker", "champion": {"version": "1", "eval_ds": "2026-11-20",
                                                             "metrics": {"mean_auc": 0.6}}}
    decision = promote_if_better(result, tolerance=0.0, moved_by="pin_ranker_training/run-1", approval=APPROVED)
    assert not decision["promoted"] and "the champion moved from v1 to v2" in decision["reason"]
    assert str(registry.champion(client, "pin_ranker").version) == "2"


def test_an_auto_family_ignores_the_approval_step(platform):
    assert promote_if_better({**RESULT, "family": "pin_ranker"}, tolerance=0.0, moved_by="r", approval=None)["promoted"]


def test_the_review_shows_each_head_against_the_champion_and_the_baseline():
    from operators.approval import review_body
    from services.promotion import GateSettings, decide

    result = {**RESULT, "metrics": {"auc": {"click": 0.71, "hide": 0.66}, "mean_auc": 0.685,
                                    "baseline_auc": {"click": 0.6, "hide": 0.55}},
              "train_days": ["2026-11-17", "2026-11-18", "2026-11-19"],
              "champion": {"version": "3", "eval_ds": "2026-11-20",
                           "metrics": {"auc": {"click": 0.70, "hide": 0.65}, "mean_auc": 0.675}}}
    decision = decide(result, "3", GateSettings(0.0, 100, 0.01, 0.0))
    body = review_body(result, decision, "http://x/run", "http://x/mlflow")
    assert "| click | 0.7100 | 0.7000 | 0.6000 |" in body and "| hide | 0.6600 | 0.6500 | 0.5500 |" in body
    assert "would replace champion v3" in body and "2026-11-17 to 2026-11-19 (3 days)" in body
    assert "[The training run](http://x/run)" in body and "[its MLflow run](http://x/mlflow)" in body
