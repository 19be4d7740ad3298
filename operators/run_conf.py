"""A trigger's conf against its DAG's params: a key the DAG does not know (a typo: ``dss``, ``epoch``) would be
ignored by Airflow and the run would go on with the default (a features run then waits for today's data); the
first task of each pinflow DAG fails at once instead, naming the key and the closest param."""

from __future__ import annotations

import difflib
from typing import Any

from core.failures import UserError


def check_run_conf(context: Any) -> None:
    """Raise UserError (no retry) when the run's conf has keys that are not params of its DAG.

    The params the DAG (and the task) declare: a task's ``params`` in its context already hold every key of the conf
    (Airflow merges the conf into them, ``core.dag_run_conf_overrides_params``), so they are only the fallback of a
    context without the DAG."""
    dag_run = context.get("dag_run")
    conf = getattr(dag_run, "conf", None) or {}
    declared = {str(name) for owner in (context.get("dag"), context.get("task"))
                for name in (getattr(owner, "params", None) or {})}
    known = sorted(declared or (context.get("params") or {}))
    unknown = sorted(str(key) for key in conf if key not in known)
    if not unknown:
        return
    names = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        names.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise UserError(f"the run's conf has key(s) {', '.join(names)} that {getattr(dag_run, 'dag_id', 'this DAG')} "
                    f"does not know: its params are {', '.join(known)}; trigger it again with those")
