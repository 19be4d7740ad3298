"""The HPO layer without jobs: the search space and its errors, the study's rounds on a SQLite storage, pruning
from a trial's intermediate losses, the trial trigger's serialisation and the DAG's shape."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core import config
from core.failures import ConfigError, FailureClass
from operators import hpo, hpo_space, hpo_trial, hpo_trigger
from training.config import RunConfig

pytestmark = pytest.mark.unit

SPACE = {"lr": {"type": "float", "low": 0.0005, "high": 0.05, "log": True},
         "width": {"type": "int", "low": 16, "high": 64, "step": 16},
         "dropout": {"type": "categorical", "choices": [0.0, 0.1]}}


def form(**changes: Any) -> dict[str, Any]:
    return {"model": "pin_content", "search_space": SPACE, "n_trials": 5, "parallel_trials": 2, "metric": "mean_auc",
            "direction": "maximize", "time_budget_minutes": 0, **changes}


# -- the search space ----------------------------------------------------------------------------------------
def test_a_valid_space_maps_to_run_fields_and_family_params():
    spec = hpo_space.build_spec(form(), config.load())
    entries = spec.entries()
    assert {n: (e.target, e.kind) for n, e in entries.items()} == {
        "lr": ("run", "float"), "width": ("params", "int"), "dropout": ("params", "categorical")}
    assert spec.baseline == {"lr": 0.003, "width": 64, "dropout": 0.0}  # the family's defaults
    dists = spec.distributions()
    assert dists["lr"].log and dists["width"].step == 16 and dists["dropout"].choices == (0.0, 0.1)


@pytest.mark.parametrize("space, message", [
    ({"widht": {"type": "int", "low": 8, "high": 64}}, "entry 'widht': not a parameter of the family .* did you mean 'width'"),
    ({"lr": {"type": "float", "low": 0.1, "high": 0.01}}, "entry 'lr': low 0.1 is above high 0.01"),
    ({"lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}, "entry 'lr': a log range needs low > 0"),
    ({"lr": {"type": "normal", "mean": 0.1}}, "entry 'lr': type must be float, int or categorical"),
    ({"lr": {"type": "float", "low": 0.001, "hi": 0.1}}, r"entry 'lr': unknown key\(s\) 'hi'"),
    ({"width": {"type": "float", "low": 8, "high": 64}}, "entry 'width': the parameter is an integer: use type int"),
    ({"width": {"type": "int", "low": 0, "high": 64}}, "entry 'width': 0 is not a valid value: .*width=0 must be positive"),
    ({"batch_size": {"type": "categorical", "choices": [16, "big"]}}, r"entry 'batch_size': choices\[1\]: 'big' does not fit the parameter's type int"),
    ({"lr": {"type": "float", "low": 0.01, "high": 0.1}}, "entry 'lr': the default 0.003 .* is outside .* set baseline to false"),
    ({"lr": [0.001, 0.1]}, "entry 'lr': expected an object"),
    ([], "search space: expected a non-empty JSON object"),
    # Beyond the training form's own limits, or a model that cannot be built (issue 37): refused before a trial.
    ({"lr": {"type": "float", "low": 0.001, "high": 5.0}}, r"entry 'lr': 5.0 is not a valid value: .*training.lr = 5.0"),
    ({"epochs": {"type": "int", "low": 1, "high": 100000}}, "entry 'epochs': 100000 is not a valid value: .*less than or equal to 100"),
    ({"batch_size": {"type": "categorical", "choices": [4, 64]}}, "entry 'batch_size': 4 is not a valid value: .*greater than or equal to 8"),
    ({"dropout": {"type": "float", "low": 0.0, "high": 1.5}}, r"entry 'dropout': 1.5 is not a valid value: .*dropout=1.5 must be in \[0, 1\)"),
])
def test_a_bad_search_space_is_a_user_error_naming_the_entry(space, message):
    with pytest.raises(ConfigError, match=message) as err:
        hpo_space.build_spec(form(search_space=space), config.load())
    assert err.value.failure_class is FailureClass.USER


@pytest.mark.parametrize("changes, message", [
    ({"n_trials": 500, "parallel_trials": 1}, "needs 500 rounds; the DAG has hpo.max_rounds="),
    ({"fixed": {"epochs": "many"}}, "fixed: epochs: expected an integer"),
    ({"fixed": {"register": True}}, "register are set by the platform"),
    ({"fixed": {"lr": 0.01}}, "entry 'lr' is also in fixed"),
    ({"enqueue": [{"lr": 0.9}]}, r"enqueue\[0\].lr: 0.9 is outside"),
    ({"model": "pin_cotnent"}, "unknown model family 'pin_cotnent'"),
    ({"metric": "mean_acu"}, "metric 'mean_acu' is not reported by model family pin_content's evaluation "
                             r"\(did you mean 'mean_auc'\?\)"),
])
def test_other_bad_form_values_are_user_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        hpo_space.build_spec(form(**changes), config.load())


def test_the_baseline_may_be_switched_off_for_a_space_without_the_defaults():
    spec = hpo_space.build_spec(form(search_space={"lr": {"type": "float", "low": 0.01, "high": 0.1}}, baseline=False),
                          config.load())
    assert spec.baseline is None


# -- the study's rounds --------------------------------------------------------------------------------------
@pytest.fixture
def study_storage(tmp_path, monkeypatch):
    """A fresh study storage and MLflow stand-ins (no MLflow here): the plan and the parent run are stubbed."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    cfg = config.load()
    cfg = cfg.model_copy(update={"hpo": cfg.hpo.model_copy(update={"storage_url": url, "prune_warmup_steps": 2})})
    monkeypatch.setattr(config, "load", lambda: cfg)
    monkeypatch.setattr("operators.training.plan_training_days",
                        lambda model, end_ds, days: {"model": model, "train_days": ["2026-11-01"], "eval_ds": "2026-11-02"})
    monkeypatch.setattr(hpo, "_parent_run",
                        lambda study, spec, cfg, **kw: study.set_user_attr(hpo.PARENT_RUN_ATTR, "parent-run") or "parent-run")
    monkeypatch.setattr(hpo, "_log_parent", lambda study, spec: None)
    monkeypatch.setattr(hpo, "mlflow_client", lambda cfg: NullMlflow())
    return url


class NullMlflow:
    """An MLflow client that accepts every call and does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def finish(name: str, number: int, value: float | None = None, pruned: bool = False) -> None:
    study, _ = hpo.load(name)
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    outcome = {"state": hpo.PRUNED} if pruned else {"state": "COMPLETE", "value": value}
    study._storage.set_trial_user_attr(trial_id, hpo.RESULT_ATTR, outcome)


def test_rounds_ask_tell_and_a_rerun_adds_no_trial(study_storage):
    from airflow.sdk.exceptions import AirflowSkipException

    created = hpo.create_study("pinflow_hpo", "manual__1", form(enqueue=[{"lr": 0.02}]))
    name = created["study"]
    assert created["plan"]["eval_ds"] == "2026-11-02" and created["mlflow_parent_run_id"] == "parent-run"
    assert hpo.create_study("pinflow_hpo", "manual__1", form(search_space={"bad": 1}))["study"] == name  # continued

    first = hpo.ask_round(name, 0)
    assert [t["number"] for t in first] == [0, 1] and first[0]["baseline"]
    assert first[0]["run"] == {"lr": 0.003} and first[0]["family_params"] == {"width": 64, "dropout": 0.0}
    assert first[1]["params"]["lr"] == 0.02  # the enqueued trial
    assert hpo.ask_round(name, 0) == first  # a re-run of the round asks nothing new
    finish(name, 0, 0.70)
    finish(name, 1, 0.80)
    told = hpo.tell_round(name, 0, ask_state="success")
    assert [t["state"] for t in told["trials"]] == ["COMPLETE", "COMPLETE"] and told["best"]["number"] == 1

    second = hpo.ask_round(name, 1)
    assert [t["number"] for t in second] == [2, 3]
    assert len({json.dumps(t["params"]) for t in second}) == 2  # constant liar / fresh seeds: not the same point
    finish(name, 2, pruned=True)  # trial 3's task failed: no result
    hpo.tell_round(name, 1, ask_state="success")
    assert [t["number"] for t in hpo.ask_round(name, 2)] == [4]  # 5 trials in all
    finish(name, 4, 0.9)
    hpo.tell_round(name, 2)
    with pytest.raises(AirflowSkipException, match="all 5 trials have run"):
        hpo.ask_round(name, 3)
    with pytest.raises(AirflowSkipException):
        hpo.tell_round(name, 3, ask_state="skipped")

    study, _ = hpo.load(name)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE", "PRUNED", "FAIL", "COMPLETE"]
    summary = hpo.summarize(name)
    assert summary["trials"] == {"complete": 3, "pruned": 1, "fail": 1}
    assert summary["best"]["number"] == 4 and summary["gain_over_baseline"] == pytest.approx(0.2)
    assert "best: trial 4" in summary["note"] and summary["stopped"] == "all 5 trials have run"


def test_a_trial_asked_by_a_try_that_died_before_tagging_it_is_adopted(study_storage):
    name = hpo.create_study("pinflow_hpo", "manual__6", form(baseline=False))["study"]
    study, spec = hpo.load(name)
    orphan = study.ask(fixed_distributions=spec.distributions())  # the try died here
    trials = hpo.ask_round(name, 0)
    assert [t["number"] for t in trials] == [orphan.number, orphan.number + 1]
    assert trials[0]["params"] == orphan.params


def test_a_round_whose_every_trial_failed_stops_the_study(study_storage):
    from core.failures import UserError

    name = hpo.create_study("pinflow_hpo", "manual__2", form(baseline=False))["study"]
    trials = hpo.ask_round(name, 0)
    study, _ = hpo.load(name)
    for t in trials:
        tid = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, t["number"])
        study._storage.set_trial_user_attr(tid, hpo.ERROR_ATTR, "USER: loss is nan at step 3")
    with pytest.raises(UserError, match="every trial of round 0 .* failed.*loss is nan"):
        hpo.tell_round(name, 0)


def test_the_time_budget_stops_new_rounds(study_storage):
    from airflow.sdk.exceptions import AirflowSkipException

    name = hpo.create_study("pinflow_hpo", "manual__3", form(time_budget_minutes=1))["study"]
    hpo.ask_round(name, 0)
    study, _ = hpo.load(name)
    study.set_user_attr(hpo.ROUNDS_ATTR, {"0": {"asked_at": 1000.0, "told_at": 1090.0}})  # 90 s spent
    with pytest.raises(AirflowSkipException, match="time budget of 1 min is spent"):
        hpo.ask_round(name, 1)


def test_a_bad_search_space_creates_nothing(study_storage):
    import optuna

    with pytest.raises(ConfigError, match="entry 'widht'"):
        hpo.create_study("pinflow_hpo", "manual__4", form(search_space={"widht": {"type": "int", "low": 1, "high": 2}}))
    assert optuna.get_all_study_summaries(hpo.open_storage()) == []


# -- pruning -------------------------------------------------------------------------------------------------
class FakeMlflow:
    def __init__(self, curves: dict[str, list[float]]) -> None:
        self.curves = curves
        self.tags: dict[str, dict[str, str]] = {}

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        return [SimpleNamespace(step=2 * (i + 1), value=v) for i, v in enumerate(self.curves[run_id])]

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags.setdefault(run_id, {})[key] = value


def test_a_trial_whose_loss_is_above_the_median_is_pruned(study_storage, tmp_path, monkeypatch):
    from core import storage

    name = hpo.create_study("pinflow_hpo", "manual__5", form(parallel_trials=2, n_trials=4))["study"]
    fake = FakeMlflow({"run0": [0.9, 0.6, 0.4], "run1": [0.9, 0.5, 0.3], "run2": [0.9, 0.85, 0.8],
                       "run3": [0.8, 0.5, 0.2]})
    monkeypatch.setattr(hpo, "mlflow_client", lambda cfg: fake)

    def monitor(number: int) -> hpo_trigger.TrialMonitor:
        out = tmp_path / f"job{number}"
        RunConfig.checked("RUN.json", root=str(tmp_path), train_days=["2026-01-01"], eval_ds="2026-01-02",
                          output_dir=str(out), checkpoint_dir=str(tmp_path / f"ckpt{number}"),
                          mlflow_tracking_uri="").write(storage.join(str(out), "RUN.json"))
        storage.write_json(storage.join(str(tmp_path / f"ckpt{number}"), "mlflow_run.json"), {"run_id": f"run{number}"})
        return hpo_trigger.TrialMonitor(name, number, str(out))

    hpo.ask_round(name, 0)
    for number in (0, 1):
        assert monitor(number).should_prune() is None  # no completed trial to compare with yet
        finish(name, number, 0.8)
    hpo.tell_round(name, 0)
    hpo.ask_round(name, 1)
    verdict = monitor(2).should_prune()
    assert verdict is not None and verdict["step"] == 6 and "train_loss 0.8 is worse than the median" in verdict["reason"]
    assert monitor(3).should_prune() is None
    study, _ = hpo.load(name)
    assert study.trials[2].intermediate_values == {2: -0.9, 4: -0.85, 6: -0.8}  # negated: the study maximises
    assert fake.tags["run2"] == {"pinflow.hpo.study": name, "pinflow.hpo.trial": "2", "mlflow.parentRunId": "parent-run"}


def test_the_trial_trigger_serializes_ids_and_settings_only():
    trigger = hpo_trigger.HpoTrialTrigger(study="pinflow_hpo/manual__1", trial=3, backend="local", job_id="train-x",
                                  output_dir="/runs/train-x", poll_seconds=5, stall_seconds=60, queue_timeout_seconds=0)
    path, kwargs = trigger.serialize()
    assert path == "operators.hpo_trigger.HpoTrialTrigger"
    # A trial deferred before the trigger moved is resumed by its old classpath.
    from airflow._shared.module_loading import import_string  # as the triggerer loads a trigger

    assert import_string("operators.hpo_trial.HpoTrialTrigger") is hpo_trigger.HpoTrialTrigger
    assert json.loads(json.dumps(kwargs)) == kwargs
    again = hpo_trigger.HpoTrialTrigger(**kwargs)
    assert again.serialize() == (path, kwargs) and kwargs["study"] == "pinflow_hpo/manual__1" and kwargs["trial"] == 3


def test_a_trials_tries_share_its_checkpoints_and_trials_do_not(study_storage):
    """A retried trial resumes: every try of a trial has its own job but the trial's checkpoint folder; another
    trial of the same DAG run has another folder (and does not register its model)."""
    name = hpo.create_study("pinflow_hpo", "manual__7", form(baseline=False))["study"]
    first, second = hpo.ask_round(name, 0)

    def prepared(trial: dict, try_number: int) -> tuple[str, RunConfig]:
        op = hpo_trial.HpoTrialOperator(task_id="trial", trial=trial, model="pin_content", backend="local")
        op._bind()
        ti = SimpleNamespace(dag_id="pinflow_hpo", run_id="manual__7", try_number=try_number)
        context: Any = {"ti": ti}
        submission = op.prepare(context, op.job_name(context, try_number))
        return submission.spec.name, submission.settings

    (job1, run1), (job2, run2), (other_job, other) = prepared(first, 1), prepared(first, 2), prepared(second, 1)
    assert len({job1, job2, other_job}) == 3
    assert run1.checkpoint_dir == run2.checkpoint_dir != other.checkpoint_dir
    assert run1.lr == first["params"]["lr"] and run1.params["width"] == first["params"]["width"]
    assert run1.register is False and run1.tags["hpo_trial"] == str(first["number"])


# -- the DAG -------------------------------------------------------------------------------------------------
def test_the_dag_has_rounds_of_ask_trial_tell_then_promote_and_summary():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags" / "pinflow_hpo.py"))
    assert bag.import_errors == {}
    dag = bag.dags["pinflow_hpo"]
    rounds = config.load().hpo.max_rounds
    assert len(dag.tasks) == 3 * rounds + 3
    trial = dag.task_dict["round_1.trial"]
    assert trial.upstream_task_ids == {"round_1.ask"} and dag.task_dict["round_1.ask"].upstream_task_ids == {"round_0.tell"}
    assert dag.task_dict["round_1.tell"].trigger_rule == "all_done"
    assert dag.task_dict["promote"].upstream_task_ids == {"create_study", *(f"round_{r}.tell" for r in range(rounds))}
    assert dag.params.get_param("model").schema["enum"] == sorted(config.load().families)
    assert dag.params.get_param("team").schema["enum"] == sorted(config.load().teams)


def test_the_run_note_keeps_the_users_note_above_the_latest_summary():
    from operators.run_notes import merged_note

    first = merged_note(None, "**Optuna study** `s`: best trial 1")
    assert first == "**Optuna study** `s`: best trial 1"
    mine = merged_note("wider lr range than last week", first)
    assert mine == "wider lr range than last week\n\n---\n**Optuna study** `s`: best trial 1"
    assert merged_note(mine, "**Optuna study** `s`: best trial 4").endswith("---\n**Optuna study** `s`: best trial 4")
    assert merged_note(mine, "**Optuna study** x").count("Optuna study") == 1


def test_the_promotion_decision_becomes_the_training_runs_note():
    from operators.run_notes import NOTES, PROMOTION_MARK, merged_note, promotion_note

    source = NOTES["pin_ranker_training"]
    assert (source.task_id, source.key) == ("promote", "decision")
    note = promotion_note({"model_name": "pin_ranker", "model_version": "3", "promoted": False,
                           "reason": "mean AUC 0.801 < champion v2 0.812 - 0.002"})
    assert note == (f"{PROMOTION_MARK}: pin_ranker version 3 not promoted: "
                    "mean AUC 0.801 < champion v2 0.812 - 0.002")
    # The user's own note stays above it; a rerun's decision replaces the earlier one.
    mine = merged_note("retrained after the logging fix", note, PROMOTION_MARK)
    again = merged_note(mine, note.replace("not promoted", "promoted to champion"), PROMOTION_MARK)
    assert again.startswith("retrained after the logging fix") and again.count(PROMOTION_MARK) == 1
    assert promotion_note(None) is None and promotion_note({"reason": "x"}) is None
