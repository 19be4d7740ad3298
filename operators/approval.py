"""A person's approval before a family's champion moves (``families.<name>.promotion: approval``).

The ``approve`` task of ``pin_ranker_training`` sits between training and the promote step. For a family with
``promotion: auto`` (the default) it returns at once. For ``promotion: approval`` it asks the gate what it would
decide (``services.promotion.preview``): a model the gate refuses is not put to anyone, and the promote step
records the gate's reason. A model that passes waits for an answer on Airflow's *Required Actions* page (the
standard provider's human-in-the-loop ``ApprovalOperator``: on Airflow 3.3 the task waits in the
``awaiting_input`` state, holding no worker slot), showing what a reviewer needs: each head's AUC next to the
champion's and the baseline's on the same day, the training days, the run's page and its MLflow run.

The answer (who, when, approve or reject; or no answer within ``promotion.approval_timeout_h``, which the scheduler
resolves as Reject) is this task's XCom; the promote step decides again under the model's lock and moves the alias
only if the answer was Approve, recording the reviewer as the mover (``services.champions``). Reject and timeout
leave the champion as it is, and the run's note says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator, HITLOperator
from airflow.sdk import BaseOperator, Context


def review_body(result: dict[str, Any], decision: dict[str, Any], run_url: str, mlflow_url: str) -> str:
    """What a reviewer reads before answering (Markdown): the candidate against the champion and the baseline."""
    from services.promotion import auc_text as _auc

    champion = decision.get("champion_version")
    rows = "\n".join(
        f"| {head} | {_auc(v.get('new'))} | {_auc(v.get('champion'))} | {_auc(v.get('baseline'))} |"
        for head, v in (decision.get("heads") or {}).items()
    )
    days = list(result.get("train_days") or [])
    trained_on = f"{days[0]} to {days[-1]} ({len(days)} days)" if days else "unknown"
    return (
        f"**{decision.get('model_name')} version {decision.get('model_version')}** passed the promotion gate and "
        f"would replace {'champion v' + str(champion) if champion else 'no champion (the family has none yet)'}.\n\n"
        f"AUC on the evaluation day {decision.get('eval_ds')}:\n\n"
        f"| head | candidate | champion{' v' + str(champion) if champion else ''} | baseline |\n|---|---|---|---|\n{rows}\n\n"
        f"Mean AUC {_auc(decision.get('auc'))}"
        + (f" vs the champion's {_auc(decision.get('champion_auc'))}" if decision.get("champion_auc") is not None else "")
        + f"; {decision.get('steps')} optimizer steps.\n\n"
        f"Trained on {trained_on}. The gate: {decision.get('reason')}\n\n"
        f"[The training run]({run_url}) · [its MLflow run]({mlflow_url})\n\n"
        "**Approve** makes it the champion (corpus inference then re-scores every pin with it); **Reject** leaves the "
        "champion as it is. No answer before the timeout counts as Reject."
    )


class ChampionApprovalOperator(ApprovalOperator):
    """Wait for a person's Approve or Reject before a model of a ``promotion: approval`` family becomes champion.

    ``result`` is the training job's result (the train task's XCom), ``tolerance`` the run's promotion tolerance and
    ``timeout_h`` the run's approval timeout (empty: ``promotion.approval_timeout_h``). Returns the answer:
    ``{"asked", "approved", "rejected", "timed_out", "responded_by", "responded_at", "timeout_h"}``; the promote step
    acts on it. Unlike the provider's ApprovalOperator, a Reject does not skip the promote step: that step records
    the rejection in the decision, the run's note and on the model version.
    """

    template_fields = (*ApprovalOperator.template_fields, "result", "tolerance", "timeout_h")

    def __init__(self, *, result: Any, tolerance: Any, timeout_h: Any = None, **kwargs: Any) -> None:
        super().__init__(subject="Approve the new champion?", defaults=[ApprovalOperator.REJECT], **kwargs)
        self.result, self.tolerance, self.timeout_h = result, tolerance, timeout_h

    def _hours(self) -> float:
        from core import config

        return float(self.timeout_h) if self.timeout_h not in (None, "") else config.load().promotion.approval_timeout_h

    def execute(self, context: Any) -> Any:
        from operators import links
        from services import promotion

        result = self.result if isinstance(self.result, dict) else {}
        if not promotion.needs_approval(result):
            self.log.info("family %s promotes without approval (promotion: auto): nothing to ask",
                          result.get("family"))
            return {"asked": False, "reason": "promotion: auto"}
        decision = promotion.preview(result, None if self.tolerance in (None, "") else float(self.tolerance))
        if not decision["promoted"]:
            self.log.info("not asking for approval: the gate refuses %s version %s: %s", decision["model_name"],
                          decision["model_version"], decision["reason"])
            return {"asked": False, "reason": decision["reason"]}
        hours = self._hours()
        self.response_timeout = timedelta(hours=hours)
        ti = context["ti"]
        self.subject = (f"Make {decision['model_name']} v{decision['model_version']} the champion "
                        f"(replacing {'v' + str(decision['champion_version']) if decision['champion_version'] else 'none'})?")
        self.body = review_body(result, decision, links.run_page_url(ti.dag_id, ti.run_id),
                                links.mlflow_run_url(ti.dag_id, ti.run_id))
        self.log.info("waiting up to %.4g h for a person to approve %s version %s on the Required Actions page",
                      hours, decision["model_name"], decision["model_version"])
        return super().execute(context)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        # HITLOperator's: validates the answer; ApprovalOperator's would also skip the promote step on Reject.
        answer = HITLOperator.execute_complete(self, context, event)
        approved = answer["chosen_options"] == [self.APPROVE]
        who = answer.get("responded_by_user")
        timed_out = bool(event.get("timedout")) and who is None
        outcome = {
            "asked": True, "approved": approved and not timed_out, "rejected": not approved and not timed_out,
            "timed_out": timed_out, "responded_at": str(answer.get("responded_at")),
            "responded_by": None if who is None else (who.get("name") or who.get("id")),
            "timeout_h": self._hours(),
        }
        self.log.info("approval answer: %s", outcome)
        return outcome


class ChampionPromoteOperator(BaseOperator):
    """The promotion gate after training (``services.promotion.promote_if_better``): promotes the trained model when
    it is better than the champion (and, for a ``promotion: approval`` family, a person approved it), else skips.

    ``result`` is the train task's XCom, ``approval`` the approve task's. The decision is this task's XCom (also
    under the key ``decision``, which the run's note reads) and goes to the job history with the run's cost; the
    champion asset gets an event, naming the family and version, only when the model is promoted, so corpus
    inference does not rerun for a worse model.
    """

    template_fields: Sequence[str] = ("result", "approval")

    def __init__(self, *, result: Any, approval: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.result = result
        self.approval = approval

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        from operators.assets import CHAMPION_MODEL_ASSET
        from services import job_history
        from services.promotion import promote_if_better

        params, ti, result = context["params"], context["ti"], self.result
        decision = promote_if_better(result, float(params["promotion_tolerance"]),
                                     moved_by=f"{ti.dag_id}/{ti.run_id}", approval=self.approval)
        # The Training progress page and the run's note (operators.run_notes) show it.
        cost, currency = job_history.run_cost(ti.dag_id, ti.run_id)
        gain = (None if decision.get("auc") is None or decision.get("champion_auc") is None
                else float(decision["auc"]) - float(decision["champion_auc"]))
        decision.update(cost=cost, currency=currency, cost_note=job_history.cost_note(cost, currency, gain))
        job_history.note(job_history.record_promotion, ti.dag_id, ti.run_id, decision)
        ti.xcom_push(key="decision", value=decision)
        self.log.info("%s version %s %s: %s", decision["model_name"], decision["model_version"],
                      "promoted to champion" if decision["promoted"] else "not promoted", decision["reason"])
        if not decision["promoted"]:
            raise AirflowSkipException(f"not promoted: {decision['reason']}")
        # Corpus inference reads which family's champion changed from the event.
        context["outlet_events"][CHAMPION_MODEL_ASSET].extra = {
            "model": result.get("family", params["model"]), "model_version": str(decision["model_version"]),
        }
        return decision
