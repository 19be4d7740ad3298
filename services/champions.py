"""The champion alias of each model: every move recorded, and a rollback.

Corpus inference follows the ``champion`` alias of a family's registered model, so who moved it, when, from which
version and why is a control a team needs (MLflow keeps no alias history: mlflow/mlflow#2169). Every move (the
promotion gate's, a rollback) goes through :func:`move`, which sets the alias and records it twice:

- a row of ``pinflow_alias_history`` in the job history database (``services.job_history``): model, alias, from
  and to version, when, by whom or which run, what kind of move and why;
- tags on the versions: ``pinflow.champion_since`` and ``pinflow.champion_reason`` on the new champion,
  ``pinflow.champion_until`` on the one it replaced.

:func:`rollback` (the ``pinflow_rollback`` DAG) moves the alias back to a version of the family's model; the DAG's
champion asset event makes ``pin_corpus_inference`` re-score the whole corpus with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from core import config
from core.failures import PinflowError, UserError, as_typed
from services import job_history
from services import model_registry as registry


@contextlib.contextmanager
def model_lock(name: str) -> Iterator[Any]:
    """Serialise the read-decide-move of ``name``'s champion across processes (the promote steps of concurrent
    training runs, an HPO study, a rollback): its lock row in the job history database, held for the block. Yields
    the transaction's connection, which :func:`move` records through."""
    with job_history.locked(f"model:{name}") as conn:
        yield conn


def move(client: Any, name: str, to_version: str, *, kind: str, moved_by: str, reason: str, conn: Any) -> dict[str, Any]:
    """Point ``name``'s champion alias at ``to_version`` and record the move (inside :func:`model_lock`, whose
    connection is ``conn``); returns it. The alias moves first, the record follows in the same locked transaction:
    a failure between the two is repaired by the retry (:func:`record_if_missing`)."""
    previous = registry.champion(client, name)
    from_version = None if previous is None else str(previous.version)
    client.set_registered_model_alias(name, registry.CHAMPION, to_version)
    record = _record(name, from_version, to_version, kind=kind, moved_by=moved_by, reason=reason, conn=conn)
    when = record["moved_at"]
    client.set_model_version_tag(name, to_version, "pinflow.champion_since", when.isoformat())
    client.set_model_version_tag(name, to_version, "pinflow.champion_reason", f"{kind} by {moved_by}: {reason}"[:5000])
    if from_version is not None and from_version != to_version:
        client.set_model_version_tag(name, from_version, "pinflow.champion_until", when.isoformat())
    return record


def record_if_missing(name: str, version: str, *, kind: str, moved_by: str, reason: str, conn: Any) -> dict[str, Any] | None:
    """``version`` holds the alias already: when the history does not end there (a try that moved the alias and
    failed before its record, or a move made outside pinflow), record the move now and return it; else None."""
    moves = job_history.alias_moves(name, conn=conn)
    if moves and moves[-1]["to_version"] == version:
        return None
    return _record(name, moves[-1]["to_version"] if moves else None, version, kind=kind, moved_by=moved_by,
                   reason=f"{reason} (recorded after the move: the alias had moved, its record had not)", conn=conn)


def _record(name: str, from_version: str | None, to_version: str, *, kind: str, moved_by: str, reason: str,
            conn: Any) -> dict[str, Any]:
    """A row of the alias history, written in the caller's locked transaction; returns it."""
    record = {"model_name": name, "alias": registry.CHAMPION, "from_version": from_version, "to_version": to_version,
              "moved_at": job_history.now(), "moved_by": moved_by, "kind": kind, "reason": reason[:4000]}
    job_history.record_alias_move(record, conn)
    return record


def model_name(family: str) -> str:
    """The registered model of a family (``families.<name>.model_name``, else the family's name)."""
    cfg = config.load()
    if family not in cfg.families:
        raise UserError(f"unknown model family {family!r}: configured are {', '.join(sorted(cfg.families))}")
    return cfg.families[family].model_name or family


def rollback(family: str, to_version: str, reason: str, moved_by: str) -> dict[str, Any]:
    """Move ``family``'s champion back to ``to_version``, checked first (nothing moves on a bad input): the version
    must be one of the family's model's versions that was champion before (promoted by the gate, or a recorded
    champion: a rollback never crowns a model the gate did not pass), and a reason is required. Returns the move,
    with ``moved`` False when that version was the champion already (before this rollback)."""
    name = model_name(family)
    version = str(to_version).strip()
    if not version.isdigit():
        raise UserError(f"to_version={to_version!r}: give the number of a registered version of {name}")
    if len(reason.strip()) < 3:
        raise UserError("a rollback needs a reason (param reason): it is recorded with the move")
    client = registry.client(config.load().mlflow)
    try:
        versions = sorted((str(v.version) for v in client.search_model_versions(f"name='{name}'")), key=int)
        if version not in versions:
            raise UserError(
                f"{name} (family {family}) has no version {version}: its versions are {', '.join(versions) or 'none'} "
                "(version numbers are per model: another family's model may have a version of that number)"
            )
        tags = client.get_model_version(name, version).tags or {}
        was_champion = "pinflow.champion_since" in tags or str(tags.get("promotion", "")).startswith("promoted") or any(
            m["to_version"] == version for m in job_history.alias_moves(name))
        if not was_champion:
            raise UserError(
                f"version {version} of {name} was never champion (its promotion gate: "
                f"{str(tags.get('promotion') or 'not run')[:300]}): a rollback returns to an earlier champion; to crown "
                "another version, put it through the promotion gate"
            )
        with model_lock(name) as conn:
            current = registry.champion(client, name)
            if current is None or str(current.version) != version:
                return {"model": family, **move(client, name, version, kind="rollback", moved_by=moved_by,
                                                reason=reason.strip(), conn=conn), "moved": True}
            last = record_if_missing(name, version, kind="rollback", moved_by=moved_by, reason=reason.strip(),
                                     conn=conn) or job_history.alias_moves(name, conn=conn)[-1]
            if last["moved_by"] == moved_by:  # this rollback's own move (its retry, or recorded just now)
                return {"model": family, **last, "moved": True}
            return {"model": family, "model_name": name, "from_version": version, "to_version": version,
                    "moved": False, "reason": f"version {version} is the champion of {name} already"}
    except PinflowError:
        raise
    except Exception as err:
        raise as_typed(err, f"the rollback of {name} to version {version}") from err
