"""A study's search space and definition (:class:`StudySpec`), parsed from the ``pinflow_hpo`` form and checked
against the family's ``Params`` and the training run's fields: a bad entry is a USER error naming it."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from typing import TYPE_CHECKING, Any

from core.failures import ConfigError

if TYPE_CHECKING:

    from core.config import PlatformConfig


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


