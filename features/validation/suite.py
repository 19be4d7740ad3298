"""The Great Expectations 1.x suite of each raw dataset, as code, and its run on one partition.

``build_suite`` states the column set, the row count, nulls, well-formed ids, uniqueness, allowed values,
the partition's UTC day, and the derived checks' columns (``features.validation.derived``). ``run_suite``
runs it through an ephemeral context on the partition as one pandas dataframe and turns every expectation
result into a ``Check``; it can also render the run's GX Data Docs into a local folder (GX writes Data Docs
only to a local filesystem: the report copies them to the storage root, local or not).

Without Data Docs, the context (with its data source and the suite added) is built once per process for each
suite content and reused (``_cached_runner``), and a run skips work GX would repeat without changing any
result (``_gx_shortcuts``, ``_no_dataframe_fingerprint``): the checks and their results are GX's.

Great Expectations is imported inside these functions: importing it takes seconds.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from core import contracts
from core.config import ValidationConfig
from features.validation.checks import EXAMPLES, Check, dataset_name, day_bounds, jsonable, raw_dataset, short
from features.validation.derived import DERIVED

if TYPE_CHECKING:
    import great_expectations as gx
    import pandas as pd

log = logging.getLogger(__name__)

# Columns whose values must be unique in a partition, per dataset.
UNIQUE: dict[str, tuple[str, ...]] = {
    "events": ("event_id",), "pins": ("pin_id",), "users": ("user_id",), "pin_labels": ("review_id",),
}
# Id columns that must be well formed (positive int64: upstream ids start at 1), per dataset.
IDS: dict[str, tuple[str, ...]] = {
    "events": ("event_id", "impression_id", "user_id", "pin_id"),
    "pins": ("pin_id", "creator_id"),
    "users": ("user_id",),
    "pin_labels": ("review_id", "pin_id"),
}
# Columns whose values must come from a closed set, per dataset.
IN_SET: dict[str, dict[str, tuple[Any, ...]]] = {
    "events": {"action": contracts.ACTIONS, "surface": contracts.SURFACES},
    "pin_labels": {"is_unsafe": (0, 1), "topic": tuple(range(contracts.TOPICS))},
}
# Columns that must match a regular expression, per dataset: column -> (regex, what it is).
REGEX: dict[str, dict[str, tuple[str, str]]] = {"users": {"country": (r"^[A-Z]{2}$", "an ISO 3166 alpha-2 code")}}
# Columns of timestamps that must lie inside the partition's UTC day, per dataset.
IN_DAY: dict[str, tuple[str, ...]] = {"events": ("ts",), "pin_labels": ("reviewed_at",)}
# Columns of timestamps that must not be after the partition's UTC day (a snapshot of ds knows no later row).
NOT_AFTER_DAY: dict[str, tuple[str, ...]] = {"pins": ("created_at",), "users": ("created_at",)}


def build_suite(
    dataset: str,
    ds: str | dt.date,
    *,
    config: ValidationConfig,
    skip_columns: Sequence[str] = (),
    derived: Sequence[str] | None = None,
) -> gx.ExpectationSuite:
    """The GX expectation suite of a raw dataset (``events``, ``pins``, ``users``, ``pin_labels``) for ``ds``.

    Every expectation carries its check name in ``meta["check"]`` and a phrase for its offending rows
    in ``meta["problem"]``. ``config``: the thresholds (``min_referential_integrity``). ``skip_columns``:
    columns to leave out of the column-level expectations (missing, or of the wrong type, so that GX cannot
    judge them). ``derived``: the names of the derived checks whose column the dataframe has (default: all
    of the dataset's, see ``DerivedCheck``).
    """
    quiet_gx()
    import great_expectations as gx
    import great_expectations.expectations as gxe

    name = dataset_name(dataset)
    source = contracts.RAW_DATASETS[name]
    schema = contracts.RAW_SCHEMAS[name]
    skip = set(skip_columns)
    expectations: list[gxe.Expectation] = []
    seen: list[tuple[str, dict[str, Any]]] = []

    def add(expectation: gxe.Expectation) -> None:
        # As ExpectationSuite.add_expectation: a suite is a set, an expectation equal but for its meta is not added
        # twice. The suite is made from the list at the end: adding one by one looks each up in a context's store.
        same = (expectation.expectation_type, expectation.dict(exclude={"id", "rendered_content", "notes", "meta"}))
        if same not in seen:
            seen.append(same)
            expectations.append(expectation)

    # exact_match=False: derived check columns sit beside the contract's; schema.columns reports extras.
    add(
        gxe.ExpectTableColumnsToMatchSet(
            column_set=[c for c in schema.names if not schema.field(c).nullable],  # nullable: optional
            exact_match=False,
            meta={"check": "table.columns_match_set"},
        )
    )
    add(gxe.ExpectTableRowCountToBeBetween(min_value=1, meta={"check": "table.row_count"}))
    for col in schema.names:
        if col not in skip and not schema.field(col).nullable:
            add(
                gxe.ExpectColumnValuesToNotBeNull(
                    column=col, meta={"check": f"{col}.not_null", "problem": f"null {col}"}
                )
            )
    for col in IDS.get(name, ()):
        if col not in skip:
            add(
                gxe.ExpectColumnValuesToBeBetween(
                    column=col,
                    min_value=1,
                    meta={"check": f"{col}.well_formed", "problem": f"{col} that is not a positive id"},
                )
            )
    for col in UNIQUE.get(name, ()):
        if col not in skip:
            add(
                gxe.ExpectColumnValuesToBeUnique(
                    column=col,
                    meta={"check": f"{col}.unique", "problem": f"{col} shared with another row"},
                )
            )
    for col, allowed in closed_sets(name, config).items():
        if col not in skip:
            add(
                gxe.ExpectColumnValuesToBeInSet(
                    column=col,
                    value_set=list(allowed),
                    meta={"check": f"{col}.in_set", "problem": f"{col} outside {list(allowed)}"},
                )
            )
    for col, (regex, what) in REGEX.get(name, {}).items():
        if col not in skip:
            add(
                gxe.ExpectColumnValuesToMatchRegex(
                    column=col,
                    regex=regex,
                    meta={"check": f"{col}.well_formed", "problem": f"{col} that is not {what}"},
                )
            )
    start, end = day_bounds(ds)
    for col in IN_DAY.get(name, ()):
        if col not in skip:
            add(
                gxe.ExpectColumnValuesToBeBetween(
                    column=col,
                    min_value=start,
                    max_value=end,
                    strict_max=True,
                    meta={
                        "check": f"{col}.in_partition_day",
                        "problem": f"{col} outside [{start.isoformat()}, {end.isoformat()})",
                    },
                )
            )
    for col in NOT_AFTER_DAY.get(name, ()):
        if col not in skip:
            add(
                gxe.ExpectColumnValuesToBeBetween(
                    column=col,
                    max_value=end,
                    strict_max=True,
                    meta={
                        "check": f"{col}.not_after_partition_day",
                        "problem": f"{col} at or after the end of the partition day {end.isoformat()}",
                    },
                )
            )
    wanted = None if derived is None else set(derived)
    for check in DERIVED[name]:
        if wanted is not None and check.name not in wanted:
            continue
        meta = {"check": check.name, "problem": check.problem}
        if check.kind == "embedding_length":
            add(
                gxe.ExpectColumnValuesToBeBetween(
                    column=check.column, min_value=config.embedding_dim, max_value=config.embedding_dim,
                    meta={**meta, "problem": f"an embedding whose length is not {config.embedding_dim}"},
                )
            )
        else:
            mostly = config.min_referential_integrity if check.referential else 1.0
            add(
                gxe.ExpectColumnValuesToBeInSet(column=check.column, value_set=[True], mostly=mostly, meta=meta)
            )
    return gx.ExpectationSuite(name=source.replace("/", "."), expectations=expectations)


def closed_sets(dataset: str, config: ValidationConfig) -> dict[str, tuple[Any, ...]]:
    """The closed sets of ``dataset``'s columns; the surfaces come from the configuration (empty: any)."""
    sets = dict(IN_SET.get(dataset, {}))
    if dataset == "events":
        if config.surfaces:
            sets["surface"] = tuple(config.surfaces)
        else:
            sets.pop("surface", None)
    return sets


def suite_check_names(dataset: str) -> list[str]:
    """The names of the checks of ``build_suite(dataset, ...)``, in order (no GX import)."""
    name = dataset_name(dataset)
    schema = contracts.RAW_SCHEMAS[name]
    names = ["table.columns_match_set", "table.row_count"]
    names += [f"{c}.not_null" for c in schema.names if not schema.field(c).nullable]
    names += [f"{c}.well_formed" for c in IDS.get(name, ())]
    names += [f"{c}.unique" for c in UNIQUE.get(name, ())]
    names += [f"{c}.in_set" for c in IN_SET.get(name, {})]
    names += [f"{c}.well_formed" for c in REGEX.get(name, {})]
    names += [f"{c}.in_partition_day" for c in IN_DAY.get(name, ())]
    names += [f"{c}.not_after_partition_day" for c in NOT_AFTER_DAY.get(name, ())]
    names += [c.name for c in DERIVED[name]]
    return names


def run_suite(
    dataset: str,
    ds: str,
    table: pa.Table,
    *,
    config: ValidationConfig,
    skip_columns: set[str],
    derived: dict[str, pa.Array],
    docs_dir: Path | None = None,
    encoded: Mapping[str, pa.ChunkedArray] | None = None,
) -> tuple[dict[str, Check], bool]:
    """Run the GX suite of ``dataset`` (a short name) on ``table``; return its checks by name, and whether
    the run's Data Docs were rendered into ``docs_dir`` (an empty local folder; None: do not render).
    ``encoded``: string columns of ``table`` as dictionary codes already (``ReadPartition.encoded``).

    Without Data Docs the suite runs through a context kept for the process (``_cached_runner``, keyed by the
    suite's content), and its result is not stored in a results store nobody reads; with Data Docs it runs
    through a new ephemeral context, whose results store the rendered site shows."""
    quiet_gx()
    from great_expectations.validator.v1_validator import Validator

    source = raw_dataset(dataset)
    by_column = {c.column: c.name for c in DERIVED[dataset]}
    suite = build_suite(
        dataset,
        ds,
        config=config,
        skip_columns=sorted(skip_columns),
        derived=[by_column[col] for col in derived],
    )
    frame = _frame(dataset, table, derived, encoded or {})
    context: Any = None
    with _no_dataframe_fingerprint(), _gx_shortcuts():
        runner = _cached_runner(source, suite) if docs_dir is None else None
        if runner is not None and runner.lock.acquire(blocking=False):
            try:
                validator = Validator(
                    batch_definition=runner.batch_definition,
                    batch_parameters={"dataframe": frame},
                    result_format="SUMMARY",
                )
                result = validator.validate_expectation_suite(runner.suite)
            finally:
                _forget_batch(runner)
                runner.lock.release()
        else:  # Data Docs asked for, or the process's context is busy in another thread: a context of its own
            fresh = _new_runner(source, suite)
            context = fresh.context
            validation = context.validation_definitions.add(
                _validation_definition(fresh.batch_definition, fresh.suite, f"{source.replace('/', '_')}_ds={ds}")
            )
            result = validation.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY")
    del frame

    checks: dict[str, Check] = {}
    for item in result.results:
        expectation = item.expectation_config
        if expectation is None:
            raise RuntimeError(f"GX returned a result without its expectation for {source} ds={ds}")
        meta = expectation.meta or {}
        check_name = meta.get("check", expectation.type)
        checks[check_name] = check_from_result(
            check_name, meta, expectation.kwargs, item.success, item.result, item.exception_info
        )

    rendered = docs_dir is not None and render_data_docs(context, docs_dir)
    return checks, rendered


def _frame(
    dataset: str, table: pa.Table, derived: dict[str, pa.Array], encoded: Mapping[str, pa.ChunkedArray]
) -> pd.DataFrame:
    """The partition with the derived check columns, as the pandas dataframe GX judges."""
    for column, values in derived.items():
        table = table.append_column(column, values)
    # Columns of a closed set as pandas categoricals: GX hashes, filters and tests membership of every row,
    # several times faster on codes than on strings (measured by benchmarks/validation.py). The codes as the
    # files store them when the read kept them (the same values), else encoded here.
    for col in IN_SET.get(dataset, {}):
        if col in table.column_names and pa.types.is_string(table.schema.field(col).type):
            codes = encoded.get(col)
            if codes is None or len(codes) != table.num_rows or not codes.type.value_type.equals(pa.string()):
                codes = pc.dictionary_encode(table.column(col))
            table = table.set_column(table.schema.get_field_index(col), col, codes)
    # One block per column: a column of one chunk without nulls becomes a view of its Arrow buffer instead of
    # being copied into a two-dimensional block (the values, and every expectation's result, are the same).
    return table.to_pandas(split_blocks=True)


@dataclass
class _Runner:
    """An ephemeral GX context with the pandas batch definition of one raw dataset and one suite added."""

    context: Any
    batch_definition: Any
    suite: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


# GX contexts with their suite, by suite content (``_suite_key``), most recently used last. Building one (the
# context, its data source, and the suite's expectation objects in its store) took about a tenth of a day's
# validation; a process validating several partitions with the same suite reuses it.
_RUNNERS: OrderedDict[str, _Runner] = OrderedDict()
_RUNNERS_LOCK = threading.Lock()
_MAX_RUNNERS = 8


def _suite_key(source: str, suite: gx.ExpectationSuite) -> str:
    """The content of a suite (every expectation's type, arguments and meta), as canonical JSON."""
    return json.dumps(
        {
            "source": source,
            "suite": suite.name,
            "expectations": [
                {"type": e.expectation_type, "kwargs": e.configuration.kwargs, "meta": e.meta}
                for e in suite.expectations
            ],
        },
        sort_keys=True,
        default=repr,
    )


def _cached_runner(source: str, suite: gx.ExpectationSuite) -> _Runner:
    """The process's runner for ``suite`` (built from it when there is none for its content)."""
    key = _suite_key(source, suite)
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(key)
        if runner is not None:
            _RUNNERS.move_to_end(key)
            return runner
    runner = _new_runner(source, suite)
    with _RUNNERS_LOCK:
        _RUNNERS[key] = runner
        _RUNNERS.move_to_end(key)
        while len(_RUNNERS) > _MAX_RUNNERS:
            _RUNNERS.popitem(last=False)
    return runner


def _forget_batch(runner: _Runner) -> None:
    """Drop the partition the kept context's execution engine holds after a run (until the next one, it would
    keep the whole dataframe alive)."""
    try:
        manager = runner.batch_definition.data_asset.datasource.get_execution_engine().batch_manager
        manager.batch_data_cache.clear()
        manager.batch_cache.clear()
    except AttributeError as err:  # another GX: the next run replaces the batch anyway
        log.debug("could not drop the last batch of a kept GX context: %s", err)


def clear_cache() -> None:
    """Forget the GX contexts kept for this process (the next run builds its suite's context again)."""
    with _RUNNERS_LOCK:
        _RUNNERS.clear()


def _new_runner(source: str, suite: gx.ExpectationSuite) -> _Runner:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    batch_definition = (
        context.data_sources.add_pandas("pinflow")
        .add_dataframe_asset(source.replace("/", "_"))
        .add_batch_definition_whole_dataframe("partition")
    )
    return _Runner(context, batch_definition, context.suites.add(suite))


def _validation_definition(batch_definition: Any, suite: Any, name: str) -> Any:
    import great_expectations as gx

    return gx.ValidationDefinition(name=name, data=batch_definition, suite=suite)


@contextmanager
def _no_dataframe_fingerprint() -> Iterator[None]:
    """GX's pandas engine hashes every row of a batch of under 1 GB (``hash_pandas_object``) only to put a
    ``pandas_data_fingerprint`` among the result's batch markers: no expectation reads it, and it took a quarter
    of a day's validation. The report records the partition's own content fingerprint instead
    (``features.validation.report.content_fingerprint``). Turned off for the run by GX's threshold for it."""
    from great_expectations.execution_engine import pandas_execution_engine as engine

    threshold = engine.HASH_THRESHOLD
    engine.HASH_THRESHOLD = 0
    try:
        yield
    finally:
        engine.HASH_THRESHOLD = threshold


# GX work a run repeats, skipped for the runs of this module (``_gx_shortcuts``): installed while at least one
# run is under way (runs may overlap on threads), GX's own again after the last one.
_SHORTCUTS_LOCK = threading.Lock()
_shortcut_runs = 0
_restore: list[Callable[[], None]] = []
_UNIQUE_CONDITION = "column_values.unique.condition"


@contextmanager
def _gx_shortcuts() -> Iterator[None]:
    """For the run: ``_configurations_kept`` and ``_unique_ids_in_order``; each gives GX's own answers."""
    global _shortcut_runs
    with _SHORTCUTS_LOCK:
        if _shortcut_runs == 0:
            _restore.extend(filter(None, (_configurations_kept(), _unique_ids_in_order())))
        _shortcut_runs += 1
    try:
        yield
    finally:
        with _SHORTCUTS_LOCK:
            _shortcut_runs -= 1
            if _shortcut_runs == 0:
                while _restore:
                    _restore.pop()()


def _configurations_kept() -> Callable[[], None] | None:
    """GX asks each expectation of a run for its ``configuration`` a hundred times or so while it builds the
    run's metric graph and judges the results, and each time rebuilds it from the expectation's fields (a pydantic
    ``dict()``): a fifth of the suite's time. The expectations of a run are made for the run and not changed
    during it: each one's configuration is built once (per object, which is kept alive while its configuration
    is kept). Returns what restores GX's own property (None: not a GX this was written for, left alone)."""
    from great_expectations.expectations.expectation import Expectation

    built = Expectation.__dict__.get("configuration")
    if not isinstance(built, property) or built.fget is None:
        return None
    build = built.fget
    kept: dict[int, tuple[Any, Any]] = {}

    def configuration(self: Any) -> Any:
        entry = kept.get(id(self))
        if entry is None or entry[0] is not self:
            entry = kept[id(self)] = (self, build(self))
        return entry[1]

    def restore() -> None:
        Expectation.configuration = built  # type: ignore[method-assign,assignment]
        kept.clear()

    Expectation.configuration = property(configuration, doc=built.__doc__)  # type: ignore[method-assign,assignment]
    return restore


def _unique_ids_in_order() -> Callable[[], None] | None:
    """GX's pandas uniqueness condition (``ExpectColumnValuesToBeUnique``) hashes every value of the column
    (``Series.duplicated``), a quarter of the suite's time on a day of events. An id column that is strictly
    increasing (events are written in id order, snapshots in key order) has no duplicate, which one comparison of
    neighbours proves: the condition answers such a column without hashing and hands any other column to GX's
    own ``~column.duplicated(keep=False)``; the result is the same series either way. Built with GX's own
    ``column_condition_partial``, so that domains and nulls are handled as GX does. Returns what restores GX's
    own condition (None: not a GX this was written for, left alone)."""
    from great_expectations.execution_engine import PandasExecutionEngine
    from great_expectations.expectations import registry
    from great_expectations.expectations.metrics.map_metric_provider.column_condition_partial import (
        column_condition_partial,
    )

    providers = registry._registered_metrics.get(_UNIQUE_CONDITION, {}).get("providers", {})
    engine = PandasExecutionEngine.__name__
    original = providers.get(engine)
    if original is None:
        return None
    providers[engine] = (original[0], column_condition_partial(engine=PandasExecutionEngine)(_unique_condition))

    def restore() -> None:
        providers[engine] = original

    return restore


def _unique_condition(cls: Any, column: pd.Series, **kwargs: Any) -> pd.Series:
    """Per row: its value occurs once in the column (``ColumnValuesUnique._pandas``, with the in-order shortcut)."""
    import numpy as np
    import pandas as pd

    if np.issubdtype(column.dtype, np.integer):
        values = column.to_numpy()
        if len(values) < 2 or bool(np.all(values[1:] > values[:-1])):
            return pd.Series(True, index=column.index, name=column.name)
    return ~column.duplicated(keep=False)


def check_from_result(
    name: str,
    meta: dict[str, Any],
    kwargs: dict[str, Any],
    success: bool | None,
    result: dict[str, Any],
    exception_info: dict[str, Any] | None,
) -> Check:
    """A ``Check`` from one GX expectation result: its observed value, or the offending rows with examples."""
    expected = {k: v for k, v in kwargs.items() if k not in {"column", "batch_id"}}
    raised = _raised_exception(exception_info)
    if raised:
        return Check(name, False, None, expected, f"GX could not evaluate this check: {raised}")
    if "observed_value" in result:
        observed: Any = result["observed_value"]
        mismatched = (result.get("details") or {}).get("mismatched")
        if name == "table.columns_match_set":  # the derived check columns sit beside the file's: not the user's
            derived = {check.column for checks in DERIVED.values() for check in checks}
            observed = [c for c in observed or [] if c not in derived]
            mismatched = {k: kept for k, v in (mismatched or {}).items() if (kept := [c for c in v if c not in derived])}
        details = ""
        if not success:
            details = f"observed {short(observed)}" + (f"; mismatched {mismatched}" if mismatched else "")
        return Check(name, bool(success), observed, expected, details)
    count = int(result.get("unexpected_count") or 0)
    total = int(result.get("element_count") or 0)
    # Distinct offending values with their counts: a duplicated id would otherwise fill the list.
    counts = result.get("partial_unexpected_counts") or [
        {"value": v, "count": 1} for v in result.get("partial_unexpected_list") or []
    ]
    examples = [jsonable(c["value"]) for c in counts[:EXAMPLES]]
    observed = {
        "unexpected_count": count,
        "element_count": total,
        "unexpected_percent": result.get("unexpected_percent"),
        "examples": examples,
    }
    details = ""
    if not success:
        problem = meta.get("problem", "unexpected value")
        details = f"{count} of {total} rows have {problem}"
        shown = [
            f"{short(json.dumps(jsonable(c['value'])), 60)} ({c['count']}x)"
            for c in counts[:3]
            if jsonable(c["value"]) is not None
        ]
        if shown:
            details += f", e.g. {', '.join(shown)}"
    return Check(name, bool(success), observed, expected, details)


def _raised_exception(exception_info: dict[str, Any] | None) -> str:
    """The message of an exception GX caught while evaluating one expectation, or ''."""
    if not exception_info:
        return ""
    infos = [exception_info] if "raised_exception" in exception_info else list(exception_info.values())
    for info in infos:
        if isinstance(info, dict) and info.get("raised_exception"):
            return str(info.get("exception_message") or "unknown error")
    return ""


def render_data_docs(context: Any, folder: Path) -> bool:
    """Render the context's Data Docs site into the local ``folder``; False (and a warning) when it fails."""
    site = {
        "class_name": "SiteBuilder",
        "show_how_to_buttons": False,
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(folder)},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    }
    try:
        context.add_data_docs_site("pinflow", site)
        context.build_data_docs(site_names=["pinflow"])
    except Exception as err:  # noqa: BLE001 - the HTML is a convenience; the JSON report is the result
        log.warning("could not render GX Data Docs into %s: %s", folder, err)
        return False
    # The site copies 3 MB of animated tutorial GIFs that no page of a validation result shows; on an object
    # store every file is one more PUT per report.
    for gif in (folder / "static" / "images").glob("*.gif"):
        gif.unlink()
    return (folder / "index.html").is_file()


def quiet_gx() -> None:
    """Import great_expectations with analytics off and its logging at WARNING."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    # Before the import: importing GX logs hundreds of INFO lines, which a task log at INFO would show.
    gx_logger = logging.getLogger("great_expectations")
    if gx_logger.level == logging.NOTSET:
        gx_logger.setLevel(logging.WARNING)
    import great_expectations  # noqa: F401 - imported here so that the next line finds its logger set up

    # This module pins its own logger to INFO and logs a temporary folder for every ephemeral context.
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)
