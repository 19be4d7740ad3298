"""The promotion gate: whether a trained model becomes its family's champion, and why, in numbers.

A model is promoted only if every check holds (``decide``):

- **trained enough**: at least ``training.min_steps`` optimizer steps and at least its warmup;
- **on the days asked for**: a run that accepted fewer training days than it asked for is not promoted;
- **floors**, whether or not the family has a champion: every head's AUC on the evaluation day at least chance
  plus ``promotion.min_lift_over_chance``, and, where the family reports a baseline on that day (the ranker's
  popularity), at least the baseline's AUC plus ``promotion.min_lift_over_baseline``;
- **the champion, on the same day**: the training job evaluated the current champion on its own evaluation day
  (``training.champion``); the new mean AUC must be at least the champion's minus ``promotion_tolerance``. A
  champion that was not evaluated on that day, could not be, or moved while the run trained is not compared
  with numbers from elsewhere, and a run evaluated on a day before the champion's evaluation day (older data;
  the champion may have trained on that day) does not replace it: the gate refuses and says so.

Every decision names the numbers it compared; it is tagged on the model version (``promotion``), kept in the
promote task's XCom and the run's note, and written to the job history. An MLflow registry that does not answer
is INFRA (the task retries): an outage never promotes a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core import config
from core.failures import PinflowError, UserError, as_typed


@dataclass(frozen=True)
class GateSettings:
    """The gate's thresholds (``training.promotion_tolerance``, ``training.min_steps``, ``promotion:``)."""

    tolerance: float
    min_steps: int
    min_lift_over_chance: float
    min_lift_over_baseline: float

    @classmethod
    def from_config(cls, cfg: config.PlatformConfig, tolerance: float | None = None) -> GateSettings:
        return cls(
            tolerance=cfg.training.promotion_tolerance if tolerance is None else float(tolerance),
            min_steps=cfg.training.min_steps,
            min_lift_over_chance=cfg.promotion.min_lift_over_chance,
            min_lift_over_baseline=cfg.promotion.min_lift_over_baseline,
        )


def head_aucs(metrics: dict[str, Any]) -> dict[str, float | None]:
    """AUC per head (a family's ``auc``), or ``{"mean": mean_auc}`` for a family that reports only the mean."""
    aucs = metrics.get("auc")
    if isinstance(aucs, dict) and aucs:
        return {str(head): None if value is None else float(value) for head, value in aucs.items()}
    mean = metrics.get("mean_auc")
    return {"mean": None if mean is None else float(mean)}


def auc_text(value: Any) -> str:
    """An AUC as the gate's messages and the reviewer's table show it ('-' when undefined)."""
    return "-" if value is None else f"{float(value):.4f}"


def decide(result: dict[str, Any], champion_now: str | None, settings: GateSettings) -> dict[str, Any]:
    """The decision on ``result`` (a training job's result.json, with ``model_version``) given the version that
    holds the champion alias now (None: no champion). Pure: reads and writes nothing."""
    metrics = result.get("metrics") or {}
    version = str(result.get("model_version"))
    eval_ds = result.get("eval_ds")
    mean = metrics.get("mean_auc")
    decision: dict[str, Any] = {
        "model_name": result.get("model_name"), "model_version": version, "eval_ds": eval_ds, "auc": mean,
        "champion_version": champion_now,
    }
    if champion_now is not None and champion_now == version:  # a retried promote step, or a rerun of the gate
        return {**decision, "promoted": True, "failed": [], "reason": f"version {version} is already the champion"}
    failed: list[str] = []

    # Trained enough, on the days asked for.
    steps, warmup = int(result.get("steps") or 0), int(result.get("warmup_steps") or 0)
    need = max(settings.min_steps, warmup)
    if steps < need:
        what = f"training.min_steps={settings.min_steps}" if settings.min_steps >= warmup else f"its {warmup} warmup steps"
        failed.append(f"trained {steps} optimizer step(s), fewer than {what}")
    trained_days = len(result.get("train_days") or [])
    asked_days = int(result.get("train_days_requested") or trained_days)
    if trained_days < asked_days:
        failed.append(f"trained on {trained_days} of the {asked_days} days asked for")

    # The floors, on the evaluation day.
    aucs, baselines = head_aucs(metrics), metrics.get("baseline_auc") or {}
    chance_floor = 0.5 + settings.min_lift_over_chance
    for head, value in aucs.items():
        baseline = baselines.get(head)
        if value is None:
            failed.append(f"{head} AUC is undefined on {eval_ds} (one class only): its floors cannot be checked")
            continue
        if value < chance_floor:
            failed.append(f"{head} AUC {value:.4f} is below chance + {settings.min_lift_over_chance} = {chance_floor:.4f}")
        if baseline is not None and value < float(baseline) + settings.min_lift_over_baseline:
            failed.append(f"{head} AUC {value:.4f} is below the baseline's {float(baseline):.4f} + "
                          f"{settings.min_lift_over_baseline}")

    # The champion, evaluated on the same day by the training job.
    evaluated = result.get("champion") if isinstance(result.get("champion"), dict) else None
    champion_aucs: dict[str, float | None] = {}
    champion_mean = None
    if champion_now is None:
        standing = "the family's first model"
    else:
        standing = f"champion v{champion_now}"
        if evaluated is None:
            failed.append(f"the champion v{champion_now} was not evaluated on {eval_ds} by this run "
                          "(evaluate_champion off): no comparison on the same day")
        elif str(evaluated.get("version")) != champion_now:
            failed.append(f"the champion moved from v{evaluated.get('version')} to v{champion_now} while this run "
                          f"trained: its comparison is with v{evaluated.get('version')}; train again to compare with "
                          f"v{champion_now}")
        elif evaluated.get("is_this_run"):
            failed.append(f"the champion v{champion_now} is this run's own model: nothing to change")
        elif evaluated.get("error"):
            failed.append(f"the champion v{champion_now} could not be evaluated on {eval_ds}: {evaluated['error']}")
        else:
            champion_metrics = evaluated.get("metrics") or {}
            champion_aucs, champion_mean = head_aucs(champion_metrics), champion_metrics.get("mean_auc")
            if evaluated.get("eval_ds") and eval_ds and str(eval_ds) < str(evaluated["eval_ds"]):
                failed.append(f"this run was evaluated on {eval_ds}, before the champion v{champion_now}'s evaluation "
                              f"day {evaluated['eval_ds']}: a model of older data does not replace a newer one (the "
                              f"champion may have trained on {eval_ds})")
            if mean is None or champion_mean is None:
                failed.append(f"mean AUC {auc_text(mean)} vs champion v{champion_now}'s {auc_text(champion_mean)}: "
                              "undefined, no comparison")
            elif float(mean) + settings.tolerance < float(champion_mean):
                failed.append(f"mean AUC {float(mean):.4f} is below champion v{champion_now}'s {float(champion_mean):.4f} "
                              f"- {settings.tolerance} on {eval_ds}")
            else:
                standing = (f"mean AUC {float(mean):.4f} >= champion v{champion_now}'s {float(champion_mean):.4f} - "
                            f"{settings.tolerance} on {eval_ds}")

    heads = {head: {"new": value, "baseline": baselines.get(head), "champion": champion_aucs.get(head)}
             for head, value in aucs.items()}
    columns = "new / baseline" + (f" / champion v{champion_now}" if champion_aucs else "")
    per_head = "; ".join(
        f"{head} " + " / ".join(auc_text(v[k]) for k in ("new", "baseline", "champion") if k != "champion" or champion_aucs)
        for head, v in heads.items()
    )
    compared = (f"compared: {steps} steps (min {need}), {trained_days} of {asked_days} days, AUC on {eval_ds} "
                f"{columns}: {per_head}; mean {auc_text(mean)}" + (f" vs {auc_text(champion_mean)}" if champion_aucs else ""))
    promoted = not failed
    if promoted:
        reason = f"{standing}; every head clears its floors ({compared})"
    else:
        reason = "; ".join(failed) + f" ({compared})"
    decision.update(promoted=promoted, failed=failed, reason=reason, heads=heads, champion_auc=champion_mean,
                    steps=steps, min_steps=need, train_days=trained_days, train_days_requested=asked_days)
    return decision


def needs_approval(result: dict[str, Any]) -> bool:
    """Whether the result's family moves its champion only with a person's approval (``families.<f>.promotion``)."""
    family = config.load().families.get(str(result.get("family") or ""))
    return family is not None and family.promotion == "approval"


def preview(result: dict[str, Any], tolerance: float | None = None) -> dict[str, Any]:
    """What the gate would decide now, reading the current champion and writing nothing: what a reviewer is shown
    before approving (the promote step decides again, under the model's lock, after the answer)."""
    from services import model_registry as registry

    cfg = config.load()
    name = str(result.get("model_name"))
    try:
        champion = registry.champion(registry.client(cfg.mlflow), name)
    except Exception as err:
        raise as_typed(err, f"reading the champion of {name}") from err
    return decide(result, None if champion is None else str(champion.version), GateSettings.from_config(cfg, tolerance))


def _apply_approval(decision: dict[str, Any], approval: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """A decision of a family with ``promotion: approval`` given the reviewer's answer (the approve task's XCom):
    promoted only if the gate passed *and* a person approved. Returns it and the kind of the move."""
    answer = approval or {}
    decision["approval"] = answer or None
    if not decision["promoted"] or decision["champion_version"] == decision["model_version"]:  # no move to approve
        return decision, "promotion"
    who = answer.get("responded_by")
    if answer.get("approved"):
        decision["approved_by"] = who
        decision["reason"] = f"approved by {who} at {answer.get('responded_at')}; {decision['reason']}"
        return decision, "approval"
    if answer.get("timed_out"):
        why = (f"no answer within the approval timeout ({answer.get('timeout_h')} h): the champion stays "
               f"{'v' + str(decision['champion_version']) if decision['champion_version'] else 'unset'}")
    elif answer.get("rejected"):
        why = f"rejected by {who} at {answer.get('responded_at')}"
    else:
        why = "passed the gate, but the family's promotion needs a person's approval (promotion: approval)"
    decision.update(promoted=False, failed=[why], reason=f"{why} (the gate: {decision['reason']})")
    return decision, "promotion"


def promote_if_better(result: dict[str, Any], tolerance: float | None = None,
                      moved_by: str = "the promotion gate", approval: dict[str, Any] | None = None) -> dict[str, Any]:
    """Decide on ``result`` against the current champion and, if promoted, move the ``champion`` alias to it
    (recorded by ``services.champions``: ``moved_by``, the run that decided); the decision is tagged on the version
    (``promotion``) either way. For a family with ``promotion: approval`` the alias moves only with ``approval``
    approved (the reviewer is recorded as the mover). A registry that does not answer raises INFRA."""
    from services import champions
    from services import model_registry as registry

    cfg = config.load()
    if not result.get("model_version"):
        raise UserError(f"nothing to promote: the training result has no registered model version "
                        f"(model {result.get('model_name')}, MLflow run {result.get('mlflow_run_id')})")
    client = registry.client(cfg.mlflow)
    name, version = str(result["model_name"]), str(result["model_version"])
    settings = GateSettings.from_config(cfg, tolerance)
    try:
        # One decision at a time per model: concurrent runs (and a rollback) read, decide and move in turn.
        with champions.model_lock(name) as conn:
            champion = registry.champion(client, name)
            decision = decide(result, None if champion is None else str(champion.version), settings)
            kind = "promotion"
            if needs_approval(result):
                decision, kind = _apply_approval(decision, approval)
                if kind == "approval":
                    moved_by = f"{decision['approved_by']} (approved in {moved_by})"
                    client.set_model_version_tag(name, version, "pinflow.approved_by", str(decision["approved_by"]))
            verdict = "promoted: " if decision["promoted"] else "rejected: "
            client.set_model_version_tag(name, version, "promotion", (verdict + decision["reason"])[:5000])
            if decision["promoted"] and decision["champion_version"] != version:
                champions.move(client, name, version, kind=kind, moved_by=moved_by, reason=decision["reason"],
                               conn=conn)
            elif decision["promoted"]:  # a retried promote step: its move stands; record it if the try did not
                champions.record_if_missing(name, version, kind="promotion", moved_by=moved_by,
                                            reason=decision["reason"], conn=conn)
    except PinflowError:
        raise
    except Exception as err:
        raise as_typed(err, f"promotion of {name} version {version}") from err
    return decision
