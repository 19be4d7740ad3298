"""The Great Expectations 1.x suite of each raw dataset, as code, and its run on one partition.

``build_suite`` states the column set, the row count, nulls, well-formed ids, uniqueness, allowed values,
the partition's UTC day, and the derived checks' columns (``features.validation.derived``). ``run_suite``
runs it through an ephemeral context on the partition as one pandas dataframe and turns every expectation
result into a ``Check``; it can also render the run's GX Data Docs into a local folder (GX writes Data Docs
only to a local filesystem: the report copies them to the storage root, local or not).

Great Expectations is imported inside these functions: importing it takes seconds.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
    suite = gx.ExpectationSuite(name=source.replace("/", "."))

    # exact_match=False: derived check columns sit beside the contract's; schema.columns reports extras.
    suite.add_expectation(
        gxe.ExpectTableColumnsToMatchSet(
            column_set=[c for c in schema.names if not schema.field(c).nullable],  # nullable: optional
            exact_match=False,
            meta={"check": "table.columns_match_set"},
        )
    )
    suite.add_expectation(gxe.ExpectTableRowCountToBeBetween(min_value=1, meta={"check": "table.row_count"}))
    for col in schema.names:
        if col not in skip and not schema.field(col).nullable:
            suite.add_expectation(
                gxe.ExpectColumnValuesToNotBeNull(
                    column=col, meta={"check": f"{col}.not_null", "problem": f"null {col}"}
                )
            )
    for col in IDS.get(name, ()):
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeBetween(
                    column=col,
                    min_value=1,
                    meta={"check": f"{col}.well_formed", "problem": f"{col} that is not a positive id"},
                )
            )
    for col in UNIQUE.get(name, ()):
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeUnique(
                    column=col,
                    meta={"check": f"{col}.unique", "problem": f"{col} shared with another row"},
                )
            )
    for col, allowed in closed_sets(name, config).items():
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeInSet(
                    column=col,
                    value_set=list(allowed),
                    meta={"check": f"{col}.in_set", "problem": f"{col} outside {list(allowed)}"},
                )
            )
    for col, (regex, what) in REGEX.get(name, {}).items():
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToMatchRegex(
                    column=col,
                    regex=regex,
                    meta={"check": f"{col}.well_formed", "problem": f"{col} that is not {what}"},
                )
            )
    start, end = day_bounds(ds)
    for col in IN_DAY.get(name, ()):
        if col not in skip:
            suite.add_expectation(
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
            suite.add_expectation(
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
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeBetween(
                    column=check.column, min_value=config.embedding_dim, max_value=config.embedding_dim,
                    meta={**meta, "problem": f"an embedding whose length is not {config.embedding_dim}"},
                )
            )
        else:
            mostly = config.min_referential_integrity if check.referential else 1.0
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeInSet(column=check.column, value_set=[True], mostly=mostly, meta=meta)
            )
    return suite


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
) -> tuple[dict[str, Check], bool]:
    """Run the GX suite of ``dataset`` (a short name) on ``table``; return its checks by name, and whether
    the run's Data Docs were rendered into ``docs_dir`` (an empty local folder; None: do not render)."""
    quiet_gx()
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    source = raw_dataset(dataset)
    asset = source.replace("/", "_")
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    batch_definition = (
        context.data_sources.add_pandas("pinflow")
        .add_dataframe_asset(asset)
        .add_batch_definition_whole_dataframe("partition")
    )
    by_column = {c.column: c.name for c in DERIVED[dataset]}
    suite = context.suites.add(
        build_suite(
            dataset,
            ds,
            config=config,
            skip_columns=sorted(skip_columns),
            derived=[by_column[col] for col in derived],
        )
    )
    validation = context.validation_definitions.add(
        gx.ValidationDefinition(name=f"{asset}_ds={ds}", data=batch_definition, suite=suite)
    )
    for column, values in derived.items():
        table = table.append_column(column, values)
    # Columns of a closed set as pandas categoricals: GX hashes, filters and tests membership of every row,
    # several times faster on codes than on strings (measured by benchmarks/validation.py).
    for col in IN_SET.get(dataset, {}):
        if col in table.column_names and pa.types.is_string(table.schema.field(col).type):
            table = table.set_column(
                table.schema.get_field_index(col), col, pc.dictionary_encode(table.column(col))
            )
    frame: pd.DataFrame = table.to_pandas()
    with _no_dataframe_fingerprint():
        result = validation.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY")

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
        details = ""
        if not success:
            mismatched = (result.get("details") or {}).get("mismatched")
            details = f"observed {short(observed)}" + (f"; mismatched {mismatched}" if mismatched else "")
        return Check(name, bool(success), observed, expected, details)
    count = int(result.get("unexpected_count") or 0)
    total = int(result.get("element_count") or 0)
    # Distinct offending values with their counts: a duplicated id would otherwise fill the list.
    counts = result.get("partial_unexpected_counts") or [
        {"value": v, "count": 1} for v in result.get("partial_unexpected_list") or []
    ]
    examples = [c["value"] for c in counts[:EXAMPLES]]
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
            if c["value"] is not None
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
