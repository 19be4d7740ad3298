"""The promotion gate's decision (``services.promotion.decide``): each way a model is refused, named with its
numbers; a model is promoted only when every check holds."""

from __future__ import annotations

from typing import Any

import pytest

from services.promotion import GateSettings, decide, head_aucs

pytestmark = pytest.mark.unit

SETTINGS = GateSettings(tolerance=0.002, min_steps=100, min_lift_over_chance=0.01, min_lift_over_baseline=0.0)
DAYS = ["2026-11-01", "2026-11-02", "2026-11-03"]


def result(auc: dict[str, float | None], *, baseline: dict[str, float] | None = None, steps: int = 300,
           champion: dict[str, Any] | None = None, days: list[str] = DAYS, asked: int | None = None,
           version: str = "6") -> dict[str, Any]:
    defined = [v for v in auc.values() if v is not None]
    metrics: dict[str, Any] = {"auc": auc, "mean_auc": sum(defined) / len(defined) if defined else None}
    if baseline is not None:
        metrics["baseline_auc"] = baseline
    return {"model_name": "pin_ranker", "model_version": version, "eval_ds": "2026-11-04", "metrics": metrics,
            "steps": steps, "warmup_steps": 20, "train_days": days, "train_days_requested": asked or len(days),
            "champion": champion}


def champion(version: str, auc: dict[str, float]) -> dict[str, Any]:
    return {"version": version, "run_id": "r", "eval_ds": "2026-11-04",
            "metrics": {"auc": auc, "mean_auc": sum(auc.values()) / len(auc)}}


GOOD = {"click": 0.72, "repin": 0.70, "hide": 0.66}
BASELINE = {"click": 0.65, "repin": 0.64, "hide": 0.60}


def test_the_first_model_that_clears_its_floors_is_promoted_and_the_reason_names_every_number():
    decision = decide(result(GOOD, baseline=BASELINE), None, SETTINGS)
    assert decision["promoted"] and decision["failed"] == []
    assert decision["reason"].startswith("the family's first model; every head clears its floors")
    for text in ("300 steps (min 100)", "3 of 3 days", "click 0.7200 / 0.6500", "hide 0.6600 / 0.6000", "2026-11-04"):
        assert text in decision["reason"], (text, decision["reason"])


@pytest.mark.parametrize(("auc", "baseline", "expected"), [
    ({"click": 0.43, "repin": 0.44, "hide": 0.41}, None, "click AUC 0.4300 is below chance + 0.01 = 0.5100"),
    ({"click": 0.505, "repin": 0.7, "hide": 0.7}, None, "click AUC 0.5050 is below chance + 0.01 = 0.5100"),
    ({"click": 0.616, "repin": 0.7, "hide": 0.7}, {"click": 0.659, "repin": 0.6, "hide": 0.6},
     "click AUC 0.6160 is below the baseline's 0.6590 + 0.0"),
    ({"click": 0.7, "repin": None, "hide": 0.7}, None, "repin AUC is undefined on 2026-11-04 (one class only)"),
])
def test_the_first_model_below_a_floor_is_not_promoted(auc, baseline, expected):
    decision = decide(result(auc, baseline=baseline), None, SETTINGS)
    assert not decision["promoted"]
    assert expected in decision["reason"], decision["reason"]


def test_a_margin_over_the_baseline_is_a_setting():
    strict = GateSettings(0.002, 100, 0.01, min_lift_over_baseline=0.1)
    decision = decide(result(GOOD, baseline=BASELINE), None, strict)
    assert not decision["promoted"] and "click AUC 0.7200 is below the baseline's 0.6500 + 0.1" in decision["reason"]


def test_a_family_without_head_aucs_is_judged_by_its_mean():
    one = result(GOOD)
    one["metrics"] = {"mean_auc": 0.49}
    assert head_aucs(one["metrics"]) == {"mean": 0.49}
    assert "mean AUC 0.4900 is below chance" in decide(one, None, SETTINGS)["reason"]


@pytest.mark.parametrize(("steps", "expected"), [
    (1, "trained 1 optimizer step(s), fewer than training.min_steps=100"),
    (99, "trained 99 optimizer step(s), fewer than training.min_steps=100"),
])
def test_a_short_run_is_not_promoted_however_good_its_numbers(steps, expected):
    decision = decide(result(GOOD, baseline=BASELINE, steps=steps), None, SETTINGS)
    assert not decision["promoted"] and expected in decision["reason"]


def test_fewer_steps_than_the_warmup_is_named_when_the_warmup_is_longer():
    settings = GateSettings(0.002, min_steps=10, min_lift_over_chance=0.01, min_lift_over_baseline=0.0)
    decision = decide(result(GOOD, steps=15), None, settings)
    assert not decision["promoted"] and "fewer than its 20 warmup steps" in decision["reason"]


def test_a_run_on_fewer_days_than_asked_is_not_promoted():
    decision = decide(result(GOOD, baseline=BASELINE, days=DAYS, asked=30), None, SETTINGS)
    assert not decision["promoted"] and "trained on 3 of the 30 days asked for" in decision["reason"]


def test_the_champion_is_compared_on_the_candidates_day():
    better = decide(result(GOOD, baseline=BASELINE, champion=champion("5", {"click": 0.7, "repin": 0.7, "hide": 0.65})),
                    "5", SETTINGS)
    assert better["promoted"] and better["champion_version"] == "5"
    assert better["reason"].startswith("mean AUC 0.6933 >= champion v5's 0.6833 - 0.002 on 2026-11-04")
    assert "click 0.7200 / 0.6500 / 0.7000" in better["reason"] and better["heads"]["click"]["champion"] == 0.7

    worse = decide(result(GOOD, baseline=BASELINE, champion=champion("5", {"click": 0.75, "repin": 0.72, "hide": 0.7})),
                   "5", SETTINGS)
    assert not worse["promoted"]
    assert "mean AUC 0.6933 is below champion v5's 0.7233 - 0.002 on 2026-11-04" in worse["reason"]


def test_within_the_tolerance_of_the_champion_is_promoted():
    near = decide(result(GOOD, champion=champion("5", {"click": 0.721, "repin": 0.701, "hide": 0.661})), "5", SETTINGS)
    assert near["promoted"]


@pytest.mark.parametrize(("evaluated", "expected"), [
    (None, "the champion v5 was not evaluated on 2026-11-04 by this run"),
    ({"version": "4", "run_id": "r", "metrics": {"mean_auc": 0.5}}, "the champion moved from v4 to v5 while this run trained"),
    ({"version": "5", "run_id": "r", "error": "DataError: embeddings are 19-d"},
     "the champion v5 could not be evaluated on 2026-11-04: DataError: embeddings are 19-d"),
    ({"version": "5", "run_id": "r", "is_this_run": True}, "the champion v5 is this run's own model"),
    ({**champion("5", {"click": 0.6}), "eval_ds": "2026-11-05"},
     "this run was evaluated on 2026-11-04, before the champion v5's evaluation day 2026-11-05"),
])
def test_no_comparison_on_the_same_day_is_no_promotion(evaluated, expected):
    decision = decide(result(GOOD, baseline=BASELINE, champion=evaluated), "5", SETTINGS)
    assert not decision["promoted"] and expected in decision["reason"], decision["reason"]


def test_a_version_that_is_already_the_champion_stays_promoted():
    decision = decide(result(GOOD, version="5"), "5", SETTINGS)
    assert decision["promoted"] and decision["reason"] == "version 5 is already the champion"


def test_every_failed_check_is_named():
    decision = decide(result({"click": 0.43, "repin": 0.44, "hide": 0.41}, steps=1, asked=30,
                             champion=champion("5", GOOD)), "5", SETTINGS)
    assert len(decision["failed"]) == 6  # steps, days, three heads below chance, the champion
    assert decision["reason"].index("trained 1 optimizer step") < decision["reason"].index("compared:")
