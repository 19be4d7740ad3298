"""Hyperparameter search: an Optuna study whose trials are the platform's training jobs.

One study per DAG run of ``pinflow_hpo`` (named after the DAG and run ids), on an RDB storage: SQLite under
``PINFLOW_HOME`` on the embedded default, ``hpo.storage_url`` (PostgreSQL) in production. Everything about
the study lives in that storage, so any task can be re-run and a re-run of the DAG run continues the study:

- :func:`create_study` validates the form (the search space above all: a bad entry is a USER error naming it),
  plans the training days, creates the study once (its definition in the study's user attributes), queues the
  baseline (the family's defaults) and any trials given to run first, and starts the MLflow parent run;
- :func:`ask_round` asks up to ``parallel`` trials (TPE, ``constant_liar`` so trials of one round spread out),
  each tagged with its round: a re-run of the round returns the same trials;
- :class:`HpoTrialOperator` trains one trial as a :class:`~operators.training.DistributedTrainingOperator`
  job (retries, exact resume, quotas and job history like any run); its trigger (:class:`HpoTrialTrigger`)
  reports the trial's per-step ``hpo.prune_metric`` from its MLflow run to the study as intermediate values and,
  when the pruner says so, cancels the job: the task ends with the trial recorded as pruned, not failed;
- :func:`tell_round` tells the study how each trial of the round ended (complete with its metric, pruned,
  or failed with the reason);
- :func:`promote_best` registers the best trial's model and puts it through the training DAG's promotion gate;
  :func:`summarize` returns the study's summary (best params, trials by state, parameter importance).

A trial that has ended (complete, pruned or failed) is never trained again; one that was running when the DAG
run stopped resumes from its checkpoint when the run is cleared.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import time
import types
import typing
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import Context
from airflow.triggers.base import TriggerEvent

from core.failures import ConfigError, PinflowError, UserError, as_typed
from operators.compute_job import JobRef, Submission, Watch
from operators.training import TUNABLE, DistributedTrainingOperator
from operators.triggers import ComputeJobTrigger

if TYPE_CHECKING:
    import optuna
    from airflow.triggers.base import BaseTrigger

    from core.config import PlatformConfig

log = logging.getLogger(__name__)

PRUNED = "PRUNED"
# Fields of RUN.json a search space may tune, with their types (the family's own Params are tunable too).
RUN_FIELDS: dict[str, type] = {
    "lr": float, "batch_size": int, "epochs": int, "weight_decay": float, "warmup_steps": int, "min_lr_ratio": float,
    "grad_clip": float,
}
# RUN.json fields the platform sets for every trial: a study's ``fixed`` fields may not.
PLATFORM_FIELDS = (
    "root", "train_days", "eval_ds", "output_dir", "checkpoint_dir", "mlflow_tracking_uri", "mlflow_artifact_location",
    "family", "family_module", "experiment", "model_name", "tags", "register", "run_name", "log_every",
    "train_days_requested", "evaluate_champion", "lease_s",
)
# Study and trial user attributes (the study's state lives in its storage).
SPEC_ATTR = "pinflow.spec"
ROUNDS_ATTR = "pinflow.rounds"
ENQUEUED_ATTR = "pinflow.enqueued"
STOPPED_ATTR = "pinflow.stopped"
PARENT_RUN_ATTR = "pinflow.mlflow_parent_run_id"
PROMOTION_ATTR = "pinflow.promotion"
ROUND_ATTR = "pinflow.round"
SLOT_ATTR = "pinflow.slot"
RESULT_ATTR = "pinflow.result"
ERROR_ATTR = "pinflow.error"
BASELINE_ATTR = "baseline"  # set by enqueue_trial's user_attrs on the baseline trial


# -- the search space ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Entry:
    """One searched parameter: where it goes (``run``: a RUN.json field; ``params``: the family's) and its range."""

    name: str
    target: str
    kind: str  # float | int | categorical
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def distribution(self) -> Any:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "categorical":
            return CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))  # type: ignore[arg-type]
        return FloatDistribution(float(self.low), float(self.high), log=self.log,  # type: ignore[arg-type]
                                 step=None if self.step is None else float(self.step))

    def contains(self, value: Any) -> bool:
        dist = self.distribution()
        try:
            return bool(dist._contains(dist.to_internal_repr(value)))
        except (ValueError, TypeError):
            return False

    def describe(self) -> str:
        if self.kind == "categorical":
            return f"one of {list(self.choices)}"
        return f"[{self.low}, {self.high}]" + (" (log)" if self.log else "") + (f" step {self.step}" if self.step else "")


_ENTRY_KEYS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
               "categorical": {"type", "choices"}}


def _number(where: str, value: Any, integer: bool) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise ConfigError(f"{where}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    return value


def parse_entry(name: str, raw: Any, target: str, field_type: Any) -> Entry:
    """One entry of the search space, checked on its own (the family's checks of its values come after)."""
    where = f"search space entry {name!r}"
    example = '{"type": "float", "low": 0.001, "high": 0.1, "log": true}'
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object such as {example}, got {raw!r}")
    kind = raw.get("type")
    if kind not in _ENTRY_KEYS:
        raise ConfigError(f"{where}: type must be float, int or categorical, got {kind!r} (e.g. {example})")
    unknown = sorted(set(raw) - _ENTRY_KEYS[kind])
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} for type {kind} "
                          f"(allowed: {', '.join(sorted(_ENTRY_KEYS[kind]))})")
    base = _base_type(field_type)
    if kind == "categorical":
        choices = raw.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: choices must be a non-empty list")
        for i, choice in enumerate(choices):
            if choice is not None and not isinstance(choice, bool | int | float | str):
                raise ConfigError(f"{where}: choices[{i}] = {choice!r} is not a number, string, boolean or null")
            _check_value(f"{where}: choices[{i}]", choice, field_type)
        if len({json.dumps(c) for c in choices}) != len(choices):
            raise ConfigError(f"{where}: choices repeat a value: {choices}")
        return Entry(name, target, kind, choices=tuple(choices))
    if base not in (int, float):
        raise ConfigError(f"{where}: the parameter is a {getattr(base, '__name__', base)}: search it with "
                          '{"type": "categorical", "choices": [...]}')
    if kind == "float" and base is int:
        raise ConfigError(f"{where}: the parameter is an integer: use type int")
    integer = kind == "int"
    for key in ("low", "high"):
        if key not in raw:
            raise ConfigError(f"{where}: {key} is missing")
    low = _number(f"{where}: low", raw["low"], integer)
    high = _number(f"{where}: high", raw["high"], integer)
    if low > high:
        raise ConfigError(f"{where}: low {low} is above high {high}")
    log_scale = raw.get("log", False)
    if not isinstance(log_scale, bool):
        raise ConfigError(f"{where}: log must be true or false, got {log_scale!r}")
    step = raw.get("step")
    if step is not None:
        step = _number(f"{where}: step", step, integer)
        if step <= 0:
            raise ConfigError(f"{where}: step must be positive, got {step}")
        if log_scale and step != 1:
            raise ConfigError(f"{where}: a log range takes no step")
    if log_scale and low <= 0:
        raise ConfigError(f"{where}: a log range needs low > 0, got {low}")
    return Entry(name, target, kind, low=low, high=high, log=log_scale, step=step)


def _base_type(hint: Any) -> Any:
    """``int`` of ``int | None``; the hint itself otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _check_value(where: str, value: Any, hint: Any) -> None:
    """A categorical choice must fit the parameter's type (ints are numbers too)."""
    base = _base_type(hint)
    if value is None:
        if base is hint and hint is not Any:
            raise ConfigError(f"{where}: null is not allowed for this parameter")
        return
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
    }.get(base, True)
    if typing.get_origin(base) is typing.Literal:
        ok = value in typing.get_args(base)
    if not ok:
        raise ConfigError(f"{where}: {value!r} does not fit the parameter's type {getattr(base, '__name__', base)}")


def parse_space(space: Any, family_params: type) -> dict[str, Entry]:
    """The search space of a study: ``{name: {"type": ..., ...}}`` over the family's Params and :data:`RUN_FIELDS`.

    A name is a field of the family's ``Params`` or a RUN.json field in :data:`RUN_FIELDS`; ``params.<name>``
    names the family's param where both have it. A ConfigError names the bad entry.
    """
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"search space: expected a non-empty JSON object of entries such as "
                          f'{{"lr": {{"type": "float", "low": 0.001, "high": 0.1, "log": true}}}}, got {space!r}')
    hints = typing.get_type_hints(family_params)
    param_names = [f.name for f in dataclasses.fields(family_params)]
    entries: dict[str, Entry] = {}
    for name, raw in space.items():
        bare = name.removeprefix("params.")
        if name.startswith("params.") and bare in param_names:
            target, hint = "params", hints[bare]
        elif name in param_names and name in RUN_FIELDS:
            raise ConfigError(f"search space entry {name!r}: both the family's param and the run's field: "
                              f"write 'params.{name}' for the family's")
        elif name in param_names:
            target, hint = "params", hints[name]
        elif name in RUN_FIELDS:
            target, hint = "run", RUN_FIELDS[name]
        else:
            known = [*param_names, *RUN_FIELDS]
            close = difflib.get_close_matches(bare, known, n=1)
            raise ConfigError(
                f"search space entry {name!r}: not a parameter of the family (its params: {', '.join(param_names)}) "
                f"nor a tunable run field ({', '.join(RUN_FIELDS)})" + (f"; did you mean {close[0]!r}?" if close else "")
            )
        entries[bare] = parse_entry(name, raw, target, hint)
    return entries


# -- the study's definition ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StudySpec:
    """What a study searches and how: the form's values, checked, with the platform's HPO settings of its start."""

    family: str
    metric: str
    direction: str
    n_trials: int
    parallel: int
    time_budget_s: float
    space: dict[str, dict[str, Any]]  # name → Entry fields
    fixed: dict[str, Any]  # RUN.json fields of every trial (params: the family's)
    seed: int
    plan: dict[str, Any]
    baseline: dict[str, Any] | None
    enqueue: list[dict[str, Any]]
    tpe_startup_trials: int
    pruner: str
    prune_metric: str
    prune_startup_trials: int
    prune_warmup_steps: int
    report_every_steps: int

    def entries(self) -> dict[str, Entry]:
        return {name: Entry(**{**fields, "choices": tuple(fields.get("choices", ()))}) for name, fields in self.space.items()}

    def distributions(self) -> dict[str, Any]:
        return {name: entry.distribution() for name, entry in self.entries().items()}

    @property
    def prune_sign(self) -> float:
        """The prune metric is a loss (lower is better): negated for a maximised study, so the pruner compares
        intermediate values in the study's direction."""
        return 1.0 if self.direction == "minimize" else -1.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StudySpec:
        return cls(**data)


def run_defaults(cfg: PlatformConfig, family: str) -> dict[str, Any]:
    """The RUN.json values a trial of ``family`` gets when nothing is searched or fixed (as the operator sets them)."""
    from training.config import RunConfig

    fam, training = cfg.families[family], cfg.training
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.name in RUN_FIELDS}
    defaults.update(epochs=fam.epochs or training.epochs, batch_size=fam.batch_size or training.batch_size,
                    lr=fam.lr or training.lr)
    return defaults


def _check_run(fields: dict[str, Any], family: str, where: str) -> None:
    """RUN.json fields checked by the job's own RunConfig (types and ranges), on a placeholder run."""
    from training.config import RunConfig

    placeholder = {"root": "/", "train_days": ["2026-01-01"], "eval_ds": "2026-01-02", "output_dir": "/",
                   "checkpoint_dir": "/", "mlflow_tracking_uri": "sqlite://", "family": family}
    RunConfig.from_dict({**placeholder, **fields}, source=where)


def build_spec(form: dict[str, Any], cfg: PlatformConfig, plan: dict[str, Any] | None = None) -> StudySpec:
    """The study's definition from the form (``params`` of the DAG run); a ConfigError names the bad value."""
    from core import config
    from training.sdk import load_family

    family_name = str(form.get("model") or cfg.training.model)
    if family_name not in cfg.families:
        raise ConfigError(f"unknown model family {family_name!r} (param model): configured are "
                          f"{', '.join(sorted(cfg.families))}")
    fam = cfg.families[family_name]
    family = load_family(family_name, fam.module, dict(fam.params))
    params_cls = type(family.params)
    hpo = cfg.hpo
    n_trials = _int_param(form, "n_trials", hpo.n_trials, 1)
    parallel = _int_param(form, "parallel_trials", hpo.parallel_trials, 1)
    if -(-n_trials // parallel) > hpo.max_rounds:
        raise ConfigError(
            f"n_trials={n_trials} with parallel_trials={parallel} needs {-(-n_trials // parallel)} rounds; the DAG has "
            f"hpo.max_rounds={hpo.max_rounds}: run more trials at once, fewer trials, or raise hpo.max_rounds"
        )
    direction = form.get("direction") or hpo.direction
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"direction must be maximize or minimize, got {direction!r}")
    metric = str(form.get("metric") or hpo.metric)
    if family.metrics and metric not in family.metrics:
        close = difflib.get_close_matches(metric, family.metrics, n=1)
        raise ConfigError(f"metric {metric!r} is not reported by model family {family_name}'s evaluation"
                          + (f" (did you mean {close[0]!r}?)" if close else "")
                          + f"; it reports {', '.join(family.metrics)}")
    budget = form.get("time_budget_minutes")
    budget = hpo.time_budget_minutes if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget < 0:
        raise ConfigError(f"time_budget_minutes must be a number >= 0 (0: no limit), got {budget!r}")

    entries = parse_space(form.get("search_space"), params_cls)
    fixed = form.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise ConfigError(f"fixed: expected a JSON object of RUN.json fields, got {fixed!r}")
    bad = sorted(set(fixed) & set(PLATFORM_FIELDS))
    if bad:
        raise ConfigError(f"fixed: {', '.join(bad)} are set by the platform for every trial, not by a study")
    fixed_params = fixed.get("params") or {}
    if not isinstance(fixed_params, dict):
        raise ConfigError(f"fixed.params: expected a JSON object of the family's params, got {fixed_params!r}")
    for name, entry in entries.items():
        if name in (fixed_params if entry.target == "params" else fixed):
            raise ConfigError(f"search space entry {name!r} is also in fixed: search it or fix it, not both")
    run_fixed = {k: v for k, v in fixed.items() if k != "params"}
    _check_run({**run_fixed, "params": fixed_params}, family_name, "fixed")
    configured = {**dict(fam.params), **fixed_params}
    load_family(family_name, fam.module, configured)  # the fixed params are the family's own (a USER error names one)

    # Every end of every range must make a valid run of the family, within the training form's own limits, and a
    # model the family can build: a bad value fails now, not in trial 7.
    form_limits = set(config.TrainingConfig.model_fields) & set(RUN_FIELDS)  # epochs, batch_size, lr
    for name, entry in entries.items():
        values = list(entry.choices) if entry.kind == "categorical" else [entry.low, entry.high]
        for value in values:
            try:
                if entry.target == "params":
                    load_family(family_name, fam.module, {**configured, name: value}).build_model("model")
                else:
                    if name in form_limits:
                        config.with_overrides(config.TrainingConfig(), {name: value}, "the training form's limits")
                    _check_run({**run_fixed, name: value}, family_name, "run")
            except ConfigError as err:
                raise ConfigError(f"search space entry {name!r}: {value!r} is not a valid value: {err}") from None
            except (ValueError, TypeError, RuntimeError) as err:  # the family's model refused it when built
                raise ConfigError(f"search space entry {name!r}: {value!r} cannot build model family "
                                  f"{family_name}'s model: {err}") from None

    defaults = {**run_defaults(cfg, family_name), **run_fixed}
    family_defaults = dataclasses.asdict(load_family(family_name, fam.module, configured).params)
    baseline: dict[str, Any] | None = None
    if form.get("baseline", True):
        baseline = {}
        for name, entry in entries.items():
            value = family_defaults[name] if entry.target == "params" else defaults[name]
            if not entry.contains(value):
                raise ConfigError(
                    f"search space entry {name!r}: the default {value!r} (the baseline trial's) is outside "
                    f"{entry.describe()}: widen the range, or set baseline to false"
                )
            baseline[name] = value
    enqueue = form.get("enqueue") or []
    if not isinstance(enqueue, list):
        raise ConfigError(f"enqueue: expected a list of objects of searched values, got {enqueue!r}")
    for i, trial in enumerate(enqueue):
        if not isinstance(trial, dict):
            raise ConfigError(f"enqueue[{i}]: expected an object of searched values, got {trial!r}")
        for name, value in trial.items():
            found = entries.get(name.removeprefix("params."))
            if found is None:
                raise ConfigError(f"enqueue[{i}].{name}: not in the search space ({', '.join(entries)})")
            if not found.contains(value):
                raise ConfigError(f"enqueue[{i}].{name}: {value!r} is outside {found.describe()}")
    seed = form.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    return StudySpec(
        family=family_name, metric=metric, direction=direction, n_trials=n_trials, parallel=parallel,
        time_budget_s=float(budget) * 60.0, space={n: dataclasses.asdict(e) for n, e in entries.items()},
        fixed={**run_fixed, "params": fixed_params}, seed=seed, plan=plan or {}, baseline=baseline,
        enqueue=[{k.removeprefix("params."): v for k, v in t.items()} for t in enqueue],
        tpe_startup_trials=hpo.tpe_startup_trials, pruner=hpo.pruner, prune_metric=hpo.prune_metric,
        prune_startup_trials=hpo.prune_startup_trials, prune_warmup_steps=hpo.prune_warmup_steps,
        report_every_steps=hpo.report_every_steps,
    )


def _int_param(form: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = form.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


# -- the storage ---------------------------------------------------------------------------------------------
def storage_url(cfg: PlatformConfig) -> str:
    return cfg.hpo.storage_url or f"sqlite:///{cfg.home}/hpo/optuna.db"


def redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - only for a log line
        return "(unparsable storage URL)"


def open_storage(cfg: PlatformConfig | None = None) -> Any:
    """The study storage (``hpo.storage_url``; SQLite under PINFLOW_HOME on the embedded default), one per process."""
    from core import config
    return _storage(storage_url(cfg or config.load()))


@functools.cache
def _storage(url: str) -> Any:
    from pathlib import Path

    import optuna

    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        # Tasks and triggers write to one file: wait for the lock rather than fail at once.
        engine_kwargs = {"connect_args": {"timeout": 60}}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except Exception as err:
        raise as_typed(err, f"the Optuna study storage {redacted(url)} (hpo.storage_url)") from err


def study_name(dag_id: str, run_id: str) -> str:
    return f"{dag_id}/{run_id}"


def _study_attrs(storage: Any, name: str) -> dict[str, Any] | None:
    import optuna

    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    except optuna.exceptions.OptunaError:
        return None
    return dict(storage.get_study_user_attrs(study_id))


def sampler_for(spec: StudySpec, trials_so_far: int) -> Any:
    """TPE with ``constant_liar`` (the trials of a round are asked together); its seed moves with the study, so
    each round's sampler (made anew in each task) does not repeat the last one's draws."""
    import numpy as np
    import optuna

    # Mixed, not seed + n: the first draws of generators seeded 1, 2, 3 lie close together.
    seed = int(np.random.SeedSequence([spec.seed, trials_so_far]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.tpe_startup_trials,
                                      constant_liar=True, multivariate=True)


def pruner_for(spec: StudySpec) -> Any:
    import optuna

    if spec.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=spec.prune_startup_trials,
                                       n_warmup_steps=spec.prune_warmup_steps, interval_steps=1)


def load(name: str, storage: Any | None = None) -> tuple[optuna.Study, StudySpec]:
    """The study ``name`` with its sampler and pruner, and its definition."""
    import optuna

    storage = storage or open_storage()
    attrs = _study_attrs(storage, name)
    if attrs is None or SPEC_ATTR not in attrs:
        raise UserError(f"Optuna study {name!r} does not exist in the study storage: its create_study task must run first")
    spec = StudySpec.from_json(attrs[SPEC_ATTR])
    count = storage.get_n_trials(storage.get_study_id_from_name(name))
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler_for(spec, count),
                             pruner=pruner_for(spec)), spec


def _trials(study: optuna.Study, round_index: int | None = None) -> list[optuna.trial.FrozenTrial]:
    trials = [t for t in study.get_trials(deepcopy=False) if ROUND_ATTR in t.user_attrs]
    if round_index is not None:
        trials = [t for t in trials if t.user_attrs[ROUND_ATTR] == round_index]
    return sorted(trials, key=lambda t: (t.user_attrs[ROUND_ATTR], t.user_attrs.get(SLOT_ATTR, 0), t.number))


# -- the tasks -----------------------------------------------------------------------------------------------
def create_study(dag_id: str, run_id: str, form: dict[str, Any], *, team: str = "") -> dict[str, Any]:
    """Create the study of this DAG run, or continue it: its definition is the first run's."""
    import optuna

    from core import config
    from operators.training import plan_training_days

    cfg = config.load()
    storage = open_storage(cfg)
    name = study_name(dag_id, run_id)
    attrs = _study_attrs(storage, name) or {}
    if SPEC_ATTR in attrs:
        spec = StudySpec.from_json(attrs[SPEC_ATTR])
        log.info("continuing Optuna study %r in %s: %d trial(s) so far", name, redacted(storage_url(cfg)),
                 storage.get_n_trials(storage.get_study_id_from_name(name)))
    else:
        spec = build_spec(form, cfg)  # the form first: a bad search space fails before anything is created
        plan = plan_training_days(spec.family, form.get("end_ds"), int(form.get("train_days") or cfg.hpo.train_days))
        spec = dataclasses.replace(spec, plan=plan)
        study = optuna.create_study(study_name=name, storage=storage, direction=spec.direction,  # type: ignore[arg-type]
                                    load_if_exists=True)
        study.set_user_attr(SPEC_ATTR, spec.to_json())
        log.info("created Optuna study %r in %s: %s %s of %s over %s", name, redacted(storage_url(cfg)),
                 spec.direction, spec.metric, spec.family, json.dumps(spec.space))
    study, spec = load(name, storage)
    if not study.user_attrs.get(ENQUEUED_ATTR):  # skip_if_exists: a re-run after a crash queues nothing twice
        if spec.baseline is not None:
            study.enqueue_trial(spec.baseline, user_attrs={BASELINE_ATTR: True}, skip_if_exists=True)
        for values in spec.enqueue:
            study.enqueue_trial(values, skip_if_exists=True)
        study.set_user_attr(ENQUEUED_ATTR, True)
    parent = _parent_run(study, spec, cfg, dag_id=dag_id, run_id=run_id, team=team)
    return {"study": name, "family": spec.family, "metric": spec.metric, "direction": spec.direction,
            "n_trials": spec.n_trials, "parallel_trials": spec.parallel, "plan": spec.plan, "mlflow_parent_run_id": parent}


def _mlflow(cfg: PlatformConfig) -> Any:
    from operators import registry

    return registry.client(cfg.mlflow)


def _experiment_id(client: Any, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location=artifact_location or None))
    except Exception:  # noqa: BLE001 - created meanwhile by a job: read it again
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


def _parent_run(study: optuna.Study, spec: StudySpec, cfg: PlatformConfig, *, dag_id: str, run_id: str, team: str) -> str:
    """The study's MLflow parent run in the family's experiment, made once (this also creates MLflow's schema and
    the experiment before the trials fan out: two jobs creating them at once on an empty database collide)."""
    existing = study.user_attrs.get(PARENT_RUN_ATTR)
    if existing:
        return str(existing)
    try:
        client = _mlflow(cfg)
        fam = cfg.families[spec.family]
        experiment = _experiment_id(client, fam.experiment or spec.family, cfg.mlflow.artifact_root)
        run = client.create_run(experiment, run_name=f"hpo-{run_id}", tags={
            "pinflow.dag": dag_id, "pinflow.run": run_id, "pinflow.family": spec.family, "pinflow.team": team,
            "pinflow.hpo.study": study.study_name, "pinflow.hpo.role": "study",
            "mlflow.note.content": f"Optuna study {study.study_name}: {spec.direction} {spec.metric} over "
                                   f"{', '.join(spec.space)}; {spec.n_trials} trials, {spec.parallel} at a time",
        })
        from mlflow.entities import Param

        params = {"metric": spec.metric, "direction": spec.direction, "n_trials": spec.n_trials,
                  "parallel_trials": spec.parallel, "time_budget_s": spec.time_budget_s, "sampler": "TPE(constant_liar)",
                  "pruner": spec.pruner, "prune_metric": spec.prune_metric, "seed": spec.seed,
                  "search_space": json.dumps(spec.space), "fixed": json.dumps(spec.fixed),
                  "eval_ds": spec.plan.get("eval_ds"), "train_days": json.dumps(spec.plan.get("train_days"))}
        client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    except Exception as err:
        raise as_typed(err, f"the MLflow parent run of study {study.study_name}") from err
    study.set_user_attr(PARENT_RUN_ATTR, run.info.run_id)
    return str(run.info.run_id)


def _rounds(study: optuna.Study) -> dict[str, dict[str, float]]:
    return dict(study.user_attrs.get(ROUNDS_ATTR) or {})


def _set_round(study: optuna.Study, round_index: int, **times: float) -> None:
    rounds = _rounds(study)
    rounds[str(round_index)] = {**rounds.get(str(round_index), {}), **times}
    study.set_user_attr(ROUNDS_ATTR, rounds)


def _spent(study: optuna.Study) -> float:
    """Seconds the study's finished rounds took (the time budget counts these, not time the run stood still)."""
    return sum(max(0.0, r["told_at"] - r["asked_at"]) for r in _rounds(study).values() if "told_at" in r and "asked_at" in r)


def ask_round(name: str, round_index: int) -> list[dict[str, Any]]:
    """The trials of round ``round_index``: those already asked for it (a re-run), else up to ``parallel`` new ones.

    Once the study has all its trials or its time budget is spent, records why and skips (so do later rounds).
    """
    from airflow.sdk.exceptions import AirflowSkipException
    from optuna.trial import TrialState

    study, spec = load(name)
    mine = _trials(study, round_index)
    earlier = [t for t in _trials(study) if t.user_attrs[ROUND_ATTR] < round_index]
    if not mine:
        stopped = study.user_attrs.get(STOPPED_ATTR)
        if stopped:
            raise AirflowSkipException(f"study {name} is done: {stopped}")
        reason = ""
        if len(earlier) >= spec.n_trials:
            reason = f"all {spec.n_trials} trials have run"
        elif spec.time_budget_s and _spent(study) >= spec.time_budget_s:
            reason = (f"its time budget of {spec.time_budget_s / 60:g} min is spent ({_spent(study) / 60:.1f} min in "
                      f"{len(_rounds(study))} round(s)); {len(earlier)} of {spec.n_trials} trials ran")
        if reason:
            study.set_user_attr(STOPPED_ATTR, reason)
            log.info("study %s: no round %d: %s", name, round_index, reason)
            raise AirflowSkipException(f"study {name} is done: {reason}")
    want = min(spec.parallel, spec.n_trials - len(earlier))
    if "asked_at" not in _rounds(study).get(str(round_index), {}):
        _set_round(study, round_index, asked_at=time.time())
    distributions = spec.distributions()
    # Asked by an earlier try that died before tagging them: this round's, not asked again.
    orphans = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if ROUND_ATTR not in t.user_attrs]
    for slot in range(len(mine), want):
        if orphans:
            orphan = orphans.pop(0)
            number, params = orphan.number, orphan.params
            trial_id = orphan._trial_id
        else:
            trial = study.ask(fixed_distributions=distributions)  # an enqueued trial (baseline) first
            number, params, trial_id = trial.number, trial.params, trial._trial_id
        study._storage.set_trial_user_attr(trial_id, ROUND_ATTR, round_index)
        study._storage.set_trial_user_attr(trial_id, SLOT_ATTR, slot)
        log.info("study %s round %d: trial %d %s", name, round_index, number, json.dumps(params))
    mine = _trials(study, round_index)
    return [trial_spec(name, spec, t) for t in mine]


def trial_spec(name: str, spec: StudySpec, trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """What a trial's training task needs: its RUN.json fields and family params (fixed, then searched)."""
    entries = spec.entries()
    run = {k: v for k, v in spec.fixed.items() if k != "params"}
    params = dict(spec.fixed.get("params") or {})
    for key, value in trial.params.items():
        (params if entries[key].target == "params" else run)[key] = value
    return {"study": name, "number": trial.number, "round": trial.user_attrs[ROUND_ATTR], "params": dict(trial.params),
            "run": run, "family_params": params, "plan": spec.plan, "baseline": bool(trial.user_attrs.get(BASELINE_ATTR))}


def tell_round(name: str, round_index: int, ask_state: str | None = None) -> dict[str, Any]:
    """Tell the study how each trial of the round ended; a trial whose task failed is a failed trial.

    ``ask_state`` is the state of the round's ask task: skipped (the study is done) or upstream_failed (an earlier
    task failed, which fails the run already) skip this task too; failed fails it. Raises when every trial of the
    round failed (something is wrong with every trial, not with one point of the space).
    """
    from airflow.sdk.exceptions import AirflowSkipException
    from optuna.trial import TrialState

    if ask_state in ("skipped", "upstream_failed"):
        raise AirflowSkipException(f"round {round_index} asked no trials (its ask task is {ask_state})")
    if ask_state == "failed":
        raise UserError(f"round {round_index} of study {name}: its ask task failed (see its log); the study stops here")
    study, spec = load(name)
    mine = _trials(study, round_index)
    if not mine:
        stopped = study.user_attrs.get(STOPPED_ATTR)
        if stopped:
            raise AirflowSkipException(f"study {name} is done: {stopped}")
        raise UserError(f"round {round_index} of study {name} asked no trials: its ask task did not run (see it)")
    failures = []
    for trial in mine:
        result = trial.user_attrs.get(RESULT_ATTR) or {}
        if trial.state.is_finished():
            if trial.state == TrialState.FAIL:
                failures.append(f"trial {trial.number}: {trial.user_attrs.get(ERROR_ATTR, 'failed')}")
            continue
        if result.get("state") == "COMPLETE" and result.get("value") is not None and math.isfinite(result["value"]):
            study.tell(trial.number, float(result["value"]))
        elif result.get("state") == PRUNED:
            study.tell(trial.number, state=TrialState.PRUNED)
        else:
            reason = trial.user_attrs.get(ERROR_ATTR) or "its training task did not finish"
            if result.get("state") == "COMPLETE":
                reason = f"metric {spec.metric} is {result.get('value')!r}"
            study.tell(trial.number, state=TrialState.FAIL)
            failures.append(f"trial {trial.number}: {reason}")
    _set_round(study, round_index, told_at=time.time())
    summary = round_summary(study, spec, round_index)
    _log_parent(study, spec)
    log.info("study %s round %d: %s", name, round_index, json.dumps(summary["trials"]))
    if failures and len(failures) == len(mine):
        raise UserError(
            f"every trial of round {round_index} of study {name} failed, so the study stops: " + "; ".join(failures)
            + " — fix the cause (the trials' task logs say more), then clear the DAG run: finished trials are kept"
        )
    return summary


def _trial_row(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    return {"number": trial.number, "state": trial.state.name, "value": trial.value, "params": trial.params,
            "baseline": bool(trial.user_attrs.get(BASELINE_ATTR))}


def round_summary(study: optuna.Study, spec: StudySpec, round_index: int) -> dict[str, Any]:
    best = _best(study)
    return {"study": study.study_name, "round": round_index, "trials": [_trial_row(t) for t in _trials(study, round_index)],
            "best": _trial_row(best) if best else None}


def _best(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    try:
        return study.best_trial
    except ValueError:  # no trial completed yet
        return None


def _log_parent(study: optuna.Study, spec: StudySpec) -> None:
    """The parent run's view of the study: each trial's value and state counts, the best so far."""
    from optuna.trial import TrialState

    from core import config

    run_id = study.user_attrs.get(PARENT_RUN_ATTR)
    if not run_id:
        return
    try:
        from mlflow.entities import Metric

        client = _mlflow(config.load())
        now = int(time.time() * 1000)
        trials = _trials(study)
        metrics = [Metric(f"trial_{spec.metric}", float(t.value), now, t.number)
                   for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        finished = sum(t.state.is_finished() for t in trials)
        for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            metrics.append(Metric(f"trials_{state.name.lower()}", float(sum(t.state == state for t in trials)), now, finished))
        best = _best(study)
        if best is not None and best.value is not None:
            metrics.append(Metric(f"best_{spec.metric}", float(best.value), now, finished))
            client.set_tag(run_id, "pinflow.hpo.best_trial", str(best.number))
            client.set_tag(run_id, "pinflow.hpo.best_params", json.dumps(best.params))
        client.log_batch(str(run_id), metrics=metrics)
    except Exception as err:  # noqa: BLE001 - the study is the record; its MLflow view must not fail a round
        log.warning("could not log study %s to its MLflow parent run %s: %s", study.study_name, run_id, err)


def promote_best(name: str, tolerance: float, promote: bool = True) -> dict[str, Any] | None:
    """Register the best trial's model and put it through the promotion gate (``promote_if_better``).

    Returns the decision (also kept in the study); None when promotion is switched off.
    """
    from operators.promotion import promote_if_better

    study, spec = load(name)
    best = _best(study)
    if best is None:
        raise UserError(f"study {name} has no completed trial: nothing to promote ({_counts(study)})")
    if not promote:
        decision: dict[str, Any] = {"promoted": False, "reason": "promotion switched off (param promote)", "trial": best.number}
        study.set_user_attr(PROMOTION_ATTR, decision)
        return None
    cached = study.user_attrs.get(PROMOTION_ATTR)
    if cached and cached.get("trial") == best.number and cached.get("model_version"):
        log.info("best trial %d was put through the gate already: %s", best.number, cached.get("reason"))
        return dict(cached)
    result = dict(best.user_attrs[RESULT_ATTR])
    version = register_trial_model(spec, best.number, result)
    decision = promote_if_better({**result, "model_version": version}, tolerance,
                                 moved_by=f"HPO study {name} (best trial {best.number})")
    decision.update(trial=best.number, value=best.value, params=best.params)
    study.set_user_attr(PROMOTION_ATTR, decision)
    return decision


def register_trial_model(spec: StudySpec, number: int, result: dict[str, Any]) -> str:
    """The registered version of a trial's logged model (registered once: a re-run finds the version by run id)."""
    import mlflow

    from core import config

    cfg = config.load()
    client = _mlflow(cfg)
    name = result["model_name"]
    run_id = result["mlflow_run_id"]
    try:
        found = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
        if found:
            return str(found[0].version)
        mlflow.set_tracking_uri(cfg.mlflow.tracking_uri)
        mlflow.set_registry_uri(cfg.mlflow.tracking_uri)
        version = mlflow.register_model(result["model_uri"], name, tags={
            "pinflow.hpo.study": str(result.get("study", "")), "pinflow.hpo.trial": str(number),
            f"pinflow.hpo.{spec.metric}": str(result.get("value")),
        })
        return str(version.version)
    except PinflowError:
        raise
    except Exception as err:
        raise as_typed(err, f"registering the model of trial {number} ({result.get('model_uri')})") from err


def _counts(study: optuna.Study) -> dict[str, int]:
    counts: dict[str, int] = {}
    for trial in _trials(study):
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    return counts


def importance(study: optuna.Study) -> dict[str, float] | None:
    """Each searched parameter's share of the metric's variation over completed trials (Optuna's PED-ANOVA);
    None with too few completed trials or a single parameter value."""
    import optuna

    try:
        return {k: round(float(v), 4) for k, v in optuna.importance.get_param_importances(study).items()}
    except (ValueError, RuntimeError, ZeroDivisionError) as err:
        log.info("no parameter importance for study %s: %s", study.study_name, err)
        return None


def summarize(name: str, run: tuple[str, str] | None = None) -> dict[str, Any]:
    """The study's summary: best trial and params, the baseline's value, trials by state, importance, promotion,
    and what its trials cost (the jobs of DAG run ``run``: (dag_id, run_id)) next to the gain over the baseline."""
    from core import config
    study, spec = load(name)
    trials = _trials(study)
    best = _best(study)
    baseline = next((t for t in trials if t.user_attrs.get(BASELINE_ATTR)), None)
    summary: dict[str, Any] = {
        "study": name, "family": spec.family, "metric": spec.metric, "direction": spec.direction,
        "trials_requested": spec.n_trials, "trials": _counts(study), "rounds": len(_rounds(study)),
        "stopped": study.user_attrs.get(STOPPED_ATTR),
        "best": None, "baseline": _trial_row(baseline) if baseline else None,
        "importance": importance(study), "promotion": study.user_attrs.get(PROMOTION_ATTR),
        "mlflow_parent_run_id": study.user_attrs.get(PARENT_RUN_ATTR),
    }
    if best is not None:
        result = best.user_attrs.get(RESULT_ATTR) or {}
        summary["best"] = {**_trial_row(best), "mlflow_run_id": result.get("mlflow_run_id"),
                           "model_uri": result.get("model_uri")}
        if baseline is not None and baseline.value is not None and best.value is not None:
            summary["gain_over_baseline"] = best.value - baseline.value
    if run is not None:
        from operators import job_history

        cost, currency = job_history.run_cost(*run)
        gain = summary.get("gain_over_baseline")
        improvement = None if gain is None else (gain if spec.direction == "maximize" else -gain)
        summary.update(cost=cost, currency=currency, cost_note=job_history.cost_note(
            cost, currency, improvement, over="the baseline", metric=spec.metric))
    summary["note"] = run_note(summary)
    run_id = summary["mlflow_parent_run_id"]
    if run_id:
        try:
            client = _mlflow(config.load())
            _log_parent(study, spec)
            client.set_tag(run_id, "pinflow.hpo.summary", json.dumps(summary, default=str)[:5000])
            client.set_tag(run_id, "mlflow.note.content", summary["note"])
            client.set_terminated(run_id, "FINISHED")
        except Exception as err:  # noqa: BLE001 - the summary is the task's result either way
            log.warning("could not close the MLflow parent run %s: %s", run_id, err)
    return summary


def run_note(summary: dict[str, Any]) -> str:
    """The summary as a short Markdown note (the DAG run's note, the MLflow parent run's description)."""
    lines = [f"**Optuna study** `{summary['study']}`: {summary['direction']} `{summary['metric']}` of {summary['family']}"]
    counts = summary["trials"]
    lines.append("trials: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" (of {summary['trials_requested']})")
    best = summary.get("best")
    if best:
        lines.append(f"best: trial {best['number']}, {summary['metric']} {best['value']:.4f}, params `{json.dumps(best['params'])}`")
    if summary.get("gain_over_baseline") is not None:
        lines.append(f"gain over the baseline (the family's defaults): {summary['gain_over_baseline']:+.4f}")
    if summary.get("cost_note"):
        lines.append(f"trials' {summary['cost_note']}")
    if summary.get("importance"):
        lines.append("importance: " + ", ".join(f"{k} {v:.2f}" for k, v in summary["importance"].items()))
    promotion = summary.get("promotion")
    if promotion:
        lines.append(("promoted" if promotion.get("promoted") else "not promoted") +
                     (f" version {promotion['model_version']}" if promotion.get("model_version") else "") +
                     f": {promotion.get('reason')}")
    if summary.get("stopped"):
        lines.append(f"stopped: {summary['stopped']}")
    return "\n\n".join(lines)


# -- a trial's intermediate values and pruning ---------------------------------------------------------------
class TrialMonitor:
    """A running trial seen from outside: its per-step metric from its MLflow run reported to the study as
    intermediate values, and the pruner's verdict. Used by the trigger while the job runs and by the operator
    when it ends (so a completed trial's curve is complete for the pruner's comparisons)."""

    def __init__(self, study: str, number: int, output_dir: str) -> None:
        self.study_name = study
        self.number = number
        self.output_dir = output_dir
        self._study: Any = None
        self._spec: StudySpec | None = None
        self._trial_id: int | None = None
        self._run_id: str | None = None
        self._linked = False

    def _load(self) -> tuple[Any, StudySpec, int]:
        if self._study is None:
            self._study, self._spec = load(self.study_name)
            self._trial_id = self._study._storage.get_trial_id_from_study_id_trial_number(
                self._study._study_id, self.number)
        assert self._spec is not None and self._trial_id is not None
        return self._study, self._spec, self._trial_id

    def mlflow_run_id(self) -> str | None:
        """The trial's MLflow run (``mlflow_run.json`` in its checkpoint folder, named by its RUN.json)."""
        if self._run_id:
            return self._run_id
        from core import storage
        from training.tracking import STATE_FILE

        try:
            run = storage.read_json(storage.join(self.output_dir, "RUN.json"))
            state = storage.read_json(storage.join(run["checkpoint_dir"], STATE_FILE))
        except (OSError, KeyError, ValueError):
            return None
        self._run_id = state.get("run_id")
        return self._run_id

    def report(self) -> int | None:
        """Report the steps not reported yet; return the last step reported (None: nothing logged yet)."""
        import optuna

        from core import config

        study, spec, trial_id = self._load()
        run_id = self.mlflow_run_id()
        if not run_id:
            return None
        client = _mlflow(config.load())
        if not self._linked:
            self.link(client, run_id, study)
        history = client.get_metric_history(run_id, spec.prune_metric)
        frozen = study._storage.get_trial(trial_id)
        if frozen.state.is_finished():
            return frozen.last_step
        trial = optuna.trial.Trial(study, trial_id)
        done = set(frozen.intermediate_values)
        for point in sorted(history, key=lambda m: m.step):
            if point.step not in done and math.isfinite(point.value):
                trial.report(spec.prune_sign * float(point.value), int(point.step))
                done.add(point.step)
        return max(done) if done else None

    def link(self, client: Any, run_id: str, study: Any) -> None:
        """Make the trial's MLflow run a child of the study's parent run."""
        parent = study.user_attrs.get(PARENT_RUN_ATTR)
        tags = {"pinflow.hpo.study": self.study_name, "pinflow.hpo.trial": str(self.number)}
        if parent:
            tags["mlflow.parentRunId"] = str(parent)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        self._linked = True

    def should_prune(self) -> dict[str, Any] | None:
        """Report, then ask the pruner: the verdict (step, value, reason) or None."""
        import optuna

        step = self.report()
        if step is None:
            return None
        study, spec, trial_id = self._load()
        if study._storage.get_trial(trial_id).state.is_finished():
            return None
        trial = optuna.trial.Trial(study, trial_id)
        if not trial.should_prune():
            return None
        frozen = study._storage.get_trial(trial_id)
        value = frozen.intermediate_values.get(step)
        loss = None if value is None else spec.prune_sign * value
        return {"step": step, "value": value, "reason": (
            f"trial {self.number} pruned at step {step}: {spec.prune_metric} {loss} is worse than the median of the "
            f"completed trials at that step ({spec.pruner} pruner)")}


class HpoTrialTrigger(ComputeJobTrigger):
    """:class:`ComputeJobTrigger` for a trial: while the job runs, report its intermediate values to the study and
    cancel it when the pruner says so; the event then has state ``PRUNED`` (the job's own end otherwise).

    Serialises only ids and settings: the study's name and the trial's number besides the job's; the study storage
    comes from the platform config in the triggerer.
    """

    def __init__(self, *, study: str, trial: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.study = study
        self.trial = int(trial)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{type(self).__module__}.{type(self).__qualname__}", {**kwargs, "study": self.study, "trial": self.trial}

    def _check(self, monitor: TrialMonitor) -> dict[str, Any] | None:
        try:
            return monitor.should_prune()
        except Exception as err:  # noqa: BLE001 - pruning is an optimisation: never fail a trial over it
            self.log.warning("trial %d: could not report or check pruning: %s", self.trial, err)
            return None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import asyncio

        monitor = TrialMonitor(self.study, self.trial, str(self.output_dir))
        inner = typing.cast(Any, super().run())  # an async generator: closed below
        pending = asyncio.ensure_future(inner.__anext__())
        verdict: dict[str, Any] | None = None
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=self.poll_seconds)
                if pending in done:
                    event = pending.result()
                    break
                if verdict is None:
                    verdict = await asyncio.to_thread(self._check, monitor)
                    if verdict is not None:
                        self.log.info("%s: cancelling job %s", verdict["reason"], self.job_id)
                        try:
                            backend = await asyncio.to_thread(self._backend)
                            await asyncio.to_thread(backend.cancel, self.job_id)
                        except Exception as err:  # noqa: BLE001 - not pruned after all: the job runs to its end
                            self.log.warning("could not cancel job %s to prune it: %s", self.job_id, err)
                            verdict = None
        finally:
            if not pending.done():
                pending.cancel()
            await inner.aclose()
        payload = dict(event.payload)
        if verdict is not None and payload.get("state") != "SUCCEEDED":
            payload.update(state=PRUNED, failure_class=None, reason=verdict["reason"], step=verdict["step"],
                           value=verdict["value"])
        yield TriggerEvent(payload)


# -- the trial's task ----------------------------------------------------------------------------------------
class HpoTrialOperator(DistributedTrainingOperator):
    """One trial of a study as a training job: :class:`DistributedTrainingOperator` with the trial's values.

    ``trial`` is one element of :func:`ask_round`'s list (mapped). The job trains the family with the trial's
    RUN.json fields and params, logs ``hpo.prune_metric`` every ``hpo.report_every_steps`` steps and does not
    register its model (the best trial's is registered at the end); its job name and checkpoints are the trial's,
    so a retry resumes the trial. Always deferrable: its trigger reports the trial's intermediate values and
    prunes it. A trial that has ended (a re-run of the DAG run) returns its recorded outcome without a job.

    :param trial: the trial (from ``ask_round``).
    :param team: a team under ``teams:`` (templated).
    """

    # Not ``trial``: its values are the sampler's, never templates.
    template_fields: Sequence[str] = (*DistributedTrainingOperator.template_fields, "team")
    ui_color = "#e8dcff"

    def __init__(self, *, trial: dict[str, Any], plan: Any = None, **kwargs: Any) -> None:
        kwargs["deferrable"] = True
        super().__init__(plan=plan, **kwargs)
        self.trial = trial

    # -- what makes it a trial -----------------------------------------------------------------------------
    def job_key(self, context: Context) -> tuple[str, ...]:
        return (f"trial{int(self.trial['number'])}",)

    def _bind(self) -> None:
        trial = self.trial
        self.plan = trial["plan"]
        self.overrides = {**{k: v for k, v in trial["run"].items() if k in TUNABLE}, "params": trial["family_params"]}

    def prepare(self, context: Context, name: str) -> Submission:
        from core import config
        from training.config import RunConfig

        submission = super().prepare(context, name)
        run_config, trial, ti = submission.settings, self.trial, context["ti"]
        run_config.update({k: v for k, v in trial["run"].items() if k not in TUNABLE})
        run_config.update(
            log_every=config.load().hpo.report_every_steps,  # the steps at which trials are compared
            register=False,  # only the best trial's model is registered
            run_name=f"{ti.run_id}-trial{trial['number']}-try{ti.try_number}",
            tags={**run_config["tags"], "hpo_study": trial["study"], "hpo_trial": str(trial["number"])},
        )
        RunConfig.from_dict(run_config, source=f"RUN.json of trial {trial['number']} of study {trial['study']}")
        return submission

    def trigger(self, job: JobRef, watch: Watch) -> BaseTrigger:
        return HpoTrialTrigger(
            study=self.trial["study"], trial=int(self.trial["number"]), backend=job.backend, job_id=job.job_id,
            output_dir=job.output_dir, poll_seconds=watch.poll_s, stall_seconds=watch.stall_s,
            queue_timeout_seconds=watch.queue_timeout_s,
        )

    # -- the task ------------------------------------------------------------------------------------------
    def execute(self, context: Context) -> Any:
        recorded = self._recorded()
        if recorded is not None:
            return recorded
        self._bind()
        try:
            return super().execute(context)
        except PinflowError as err:
            self._record_error(err)
            raise

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None,
                         job: dict[str, Any] | None = None) -> Any:
        self._bind()
        if event and event.get("state") == PRUNED:
            return self._pruned(context, event)
        try:
            return super().execute_complete(context, event, job)
        except PinflowError as err:
            self._record_error(err)
            raise

    def finish(self, context: Context, job: JobRef) -> dict[str, Any]:
        from training.evaluate import flat_metrics

        result = super().finish(context, job)
        study, spec = load(self.trial["study"])
        metrics = flat_metrics(result.get("metrics") or {}, prefix="")
        if spec.metric not in metrics:
            raise ConfigError(
                f"trial {self.trial['number']}: the family's evaluation has no metric {spec.metric!r} (param metric); "
                f"it has {', '.join(sorted(metrics))}"
            )
        self._report_final(job)
        outcome = {
            "state": "COMPLETE", "trial": self.trial["number"], "study": self.trial["study"],
            "value": metrics[spec.metric], "params": self.trial["params"], "metrics": result.get("metrics"),
            "mlflow_run_id": result.get("mlflow_run_id"), "model_uri": result.get("model_uri"),
            "model_name": result.get("model_name"), "family": result.get("family"), "eval_ds": result.get("eval_ds"),
            "train_days": result.get("train_days"), "steps": result.get("steps"), "job": job.job_id,
        }
        self._record(study, outcome)
        self.log.info("trial %d complete: %s %s with %s", self.trial["number"], spec.metric, outcome["value"],
                      json.dumps(self.trial["params"]))
        return outcome

    def _report_final(self, job: JobRef) -> None:
        """The whole curve of an ended trial, for the pruner's comparisons (the trigger may have missed the end)."""
        try:
            TrialMonitor(self.trial["study"], int(self.trial["number"]), str(job.output_dir)).report()
        except Exception as err:  # noqa: BLE001 - the curve helps pruning later trials; the result is what counts
            self.log.warning("trial %d: could not report its last intermediate values: %s", self.trial["number"], err)

    def _pruned(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The trigger pruned the trial and cancelled its job: the task succeeds with the trial recorded as pruned."""
        from core import config
        self._forget(context)
        self._job = None
        outcome = {"state": PRUNED, "trial": self.trial["number"], "study": self.trial["study"],
                   "step": event.get("step"), "value": event.get("value"), "params": self.trial["params"],
                   "reason": event.get("reason"), "job": event.get("job_id")}
        study, _ = load(self.trial["study"])
        self._record(study, outcome)
        try:  # the job history: cancelled, not failed
            from operators import job_history

            job_history.note(job_history.mark_ended, event["backend"], event["job_id"], job_history.CANCELLED,
                             reason=event.get("reason"), started_at=event.get("started_at"),
                             queued_s=event.get("queued_s"))
        except Exception as err:  # noqa: BLE001 - the study has the record
            self.log.warning("could not record pruned job %s in the job history: %s", event.get("job_id"), err)
        monitor = TrialMonitor(self.trial["study"], int(self.trial["number"]), str(event.get("output_dir")))
        run_id = monitor.mlflow_run_id()
        if run_id:
            try:
                client = _mlflow(config.load())
                monitor.link(client, run_id, study)
                client.set_tag(run_id, "pinflow.hpo.state", PRUNED)
                client.set_terminated(run_id, "KILLED")
            except Exception as err:  # noqa: BLE001 - the study has the record
                self.log.warning("could not mark MLflow run %s of pruned trial %d: %s", run_id, self.trial["number"], err)
        self.log.info("%s; job %s cancelled", event.get("reason"), event.get("job_id"))
        return outcome

    def _record(self, study: Any, outcome: dict[str, Any]) -> None:
        from core import config
        study._storage.set_trial_user_attr(self._trial_id(study), RESULT_ATTR, outcome)
        if outcome.get("mlflow_run_id"):
            try:
                client = _mlflow(config.load())
                TrialMonitor(self.trial["study"], int(self.trial["number"]), "").link(client, outcome["mlflow_run_id"], study)
                client.set_tag(outcome["mlflow_run_id"], "pinflow.hpo.state", outcome["state"])
            except Exception as err:  # noqa: BLE001
                self.log.warning("could not tag MLflow run %s: %s", outcome["mlflow_run_id"], err)

    def _trial_id(self, study: Any) -> int:
        return int(study._storage.get_trial_id_from_study_id_trial_number(study._study_id, int(self.trial["number"])))

    def _record_error(self, err: PinflowError) -> None:
        try:
            study, _ = load(self.trial["study"])
            study._storage.set_trial_user_attr(
                self._trial_id(study), ERROR_ATTR, f"{err.failure_class.value}: {str(err)[:1500]}")
        except Exception as record_err:  # noqa: BLE001 - the task fails with the original error anyway
            self.log.warning("could not record the error of trial %d: %s", self.trial["number"], record_err)

    def _recorded(self) -> dict[str, Any] | None:
        """The outcome of a trial that has ended (a re-run of the DAG run); a failed one fails again, saying so."""
        from optuna.trial import TrialState

        study, _ = load(self.trial["study"])
        frozen = study._storage.get_trial(self._trial_id(study))
        if frozen.state == TrialState.FAIL:
            raise UserError(f"trial {frozen.number} of study {self.trial['study']} failed in an earlier run of the study "
                            f"and is not trained again: {frozen.user_attrs.get(ERROR_ATTR, '')}")
        outcome = frozen.user_attrs.get(RESULT_ATTR)
        if outcome:
            self.log.info("trial %d has ended (%s): not training it again", frozen.number, outcome.get("state"))
            return dict(outcome)
        return None
