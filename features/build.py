"""Feature computation (docs/architecture.md §2–3): daily aggregates → window features → sequences → examples.

Each step is a function of explicit arguments (storage root, day, parameters) that reads complete input
partitions, computes one output with DuckDB SQL, writes it atomically with its metadata
(``_metadata.json``: rows, inputs used, missing days, parameters) and returns that metadata as a summary.
Rerunning a day replaces that day's outputs and nothing else. The steps live in ``features.steps`` (``daily``,
``window``, ``sequences``, ``examples``: each its SQL beside the function that runs it), on the machinery of
``features.step_io`` (DuckDB, input checks, atomic Parquet output) and ``features.sharding``. This module runs
them: ``build_day`` (every step in order), ``build_step`` (one step, of one shard), ``merge_shards`` and the CLI.

    python -m features.build --root /data/pinflow --ds 2024-01-31 --step all

Builds only from validated data: every raw partition a step reads needs a passed validation report
(``python -m features.validate``) for its current contents (the content fingerprint the report records);
otherwise the step raises ``UnvalidatedInputError`` naming the partition and the command that validates it.
``--skip-validation`` (``require_validation=False``) builds anyway and says so in the outputs' metadata.

Point-in-time rule: the examples of day ``ds`` join features as of the end of ``ds-1`` only, so nothing
of day ``ds`` leaks into its own features. Raw partitions are assumed to hold the events whose ``ts``
lies in their day (the validation step checks it); sequences additionally cut on ``ts``.
"""

from __future__ import annotations

import argparse
import contextvars
import datetime as dt
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from core.config import FeaturesConfig
from core.contracts import EXAMPLES, PIN_DAILY, PIN_WINDOW, USER_DAILY, USER_SEQUENCE, USER_WINDOW, combined_digest
from core.failures import (
    ConfigError,
    DataError,
    ExitCode,
    FailureClass,
    InfraError,
    PinflowError,
    classify,
    disk_full,
    exit_code_for,
)
from core.storage import (
    MARKER,
    METADATA_FILE,
    check_root,
    copy_file,
    ds_str,
    exists,
    is_complete,
    is_remote,
    join,
    local_path,
    read_json,
    read_metadata,
    remove_tree,
    resolve,
    write_json,
    write_partition,
)
from features.bucketed_events import day_counts
from features.sharding import DATASET_KEYS, Shard, hash_layout, shard_file, shard_folder
from features.spec import STAGED_STEPS, STEP_GROUPS
from features.step_io import (
    DEFAULTS,
    DuckDBSettings,
    has_raw,
    input_versions,
    overlapped_outputs,
    partition_ref,
    shared_database,
    unvalidated_inputs,
)
from features.steps.daily import build_daily
from features.steps.examples import build_examples
from features.steps.sequences import build_sequences
from features.steps.window import STAGED_DAY_VERSION, StagedDay, build_window, daily_version

if TYPE_CHECKING:
    from features.spec import BuildSpec

log = logging.getLogger(__name__)


def build_day(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    *,
    window_days: int = DEFAULTS.window_days,
    sequence_length: int = DEFAULTS.sequence_length,
    prior_impressions: float = DEFAULTS.pin_prior_impressions,
    negative_downsample: float = DEFAULTS.negative_downsample,
    seed: int = DEFAULTS.negative_downsample_seed,
    recompute: bool = False,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
) -> dict[str, Any]:
    """Run daily → window → sequences → examples for ``ds``; the summaries of every output, by dataset.

    ``recompute`` builds the window and the sequences from the raw events of the window's days instead of
    the daily aggregates and the previous day's sequences (the full recompute). ``require_validation=False``
    builds from raw partitions without a passed validation report (``skip_validation`` in the metadata).
    """
    # The window reads the day's aggregates: published (the first block's end) before it starts.
    with overlapped_outputs():
        summary = build_daily(root, ds, require_validation=require_validation, engine=engine)
    with overlapped_outputs():
        summary |= build_window(root, ds, window_days, prior_impressions, recompute=recompute, require_validation=require_validation, engine=engine)
        summary |= build_sequences(root, ds, sequence_length, window_days, recompute=recompute, require_validation=require_validation, engine=engine)
        summary |= build_examples(root, ds, prior_impressions, negative_downsample, seed, require_validation=require_validation, engine=engine)
    return summary


# --- one step, its shards -------------------------------------------------------------------------------

STEP_DATASETS: dict[str, tuple[str, ...]] = {
    "daily": (USER_DAILY, PIN_DAILY),
    "window": (USER_WINDOW, PIN_WINDOW),
    "sequences": (USER_SEQUENCE,),
    "examples": (EXAMPLES,),
}
def steps_of(step: str) -> tuple[str, ...]:
    """The steps a job of ``step`` (one step, or a group of ``STEP_GROUPS``) builds, in order."""
    return STEP_GROUPS.get(step, (step,))


def step_datasets(step: str) -> tuple[str, ...]:
    """The datasets a job of ``step`` always writes (a group's published together)."""
    return tuple(dataset for one in steps_of(step) for dataset in STEP_DATASETS[one])


def staged_datasets(step: str) -> tuple[str, ...]:
    """The datasets the shards of a group's job also write when they can (``spec.STAGED_STEPS``): published with the
    others when every shard wrote them."""
    return tuple(dataset for one in STAGED_STEPS.get(step, ()) for dataset in STEP_DATASETS[one])


# Metadata that differs from shard to shard (summed or dropped by the merge); every other key must agree.
_SUMMED_KEYS = ("rows", "events", "unknown_action_events", "impressions", "impressions_unknown_pin")
# Totals of columns by name (the examples' labels, the pin counts of pin_daily): summed per name.
_SUMMED_DICTS = ("positives", "sums")
_PER_SHARD_KEYS = (*_SUMMED_KEYS, *_SUMMED_DICTS, "content_digest", "shard")


def build_step(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    step: str,
    features: FeaturesConfig,
    *,
    recompute: bool = False,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Build one step (or a group of ``STEP_GROUPS``, its steps in order) of ``ds`` with the ``features:`` settings (of
    one shard, if given): the summaries by dataset."""
    common: dict[str, Any] = {"require_validation": require_validation, "engine": engine, "shard": shard}
    if step in STEP_GROUPS:
        return _build_group(root, ds, step, features, recompute=recompute, **common)
    if step not in STEP_DATASETS:
        raise ValueError(f"unknown feature step {step!r}: choose one of {', '.join([*STEP_DATASETS, *STEP_GROUPS])}")
    # Unsharded, published when it returns (or, in a group, by the group's end). A shard's steps already run side by side.
    with overlapped_outputs() if shard is None else nullcontext():
        if step == "daily":
            return build_daily(root, ds, **common)
        if step == "window":
            return build_window(root, ds, features.window_days, features.pin_prior_impressions, recompute=recompute, **common)
        if step == "sequences":
            return build_sequences(root, ds, features.sequence_length, features.window_days, recompute=recompute, **common)
        return build_examples(
            root, ds, features.pin_prior_impressions, features.negative_downsample, features.negative_downsample_seed,
            **common,
        )


def _window_of_staged_day(root: str | os.PathLike[str], ds: str | dt.date, features: FeaturesConfig,
                          common: dict[str, Any]) -> dict[str, Any]:
    """A shard's part of the day's window, from the daily aggregates it has just built (``StagedDay``), when the
    window can be incremental and the day's events were bucketed with their counts; else nothing (the DAG's window
    job builds it once the day is merged). Saves the window job: its start, its reads of the merged day, its merge."""
    shard: Shard = common["shard"]
    counts, why = day_counts(root, ds_str(ds))
    if counts is None:  # the day's pin totals are not known here
        log.info("window of ds=%s: left to the window job: %s", ds_str(ds), why)
        return {}
    user_daily, pin_daily = (join(resolve(shard.folder(d)), shard_file(shard.index)) for d in (USER_DAILY, PIN_DAILY))
    staged = StagedDay(user_daily, pin_daily, counts)
    try:
        return build_window(root, ds, features.window_days, features.pin_prior_impressions,
                            require_validation=common["require_validation"], engine=common["engine"], shard=shard,
                            staged=staged)
    except Exception as exc:  # optional here: the window job builds it, and its own failure is said there
        log.warning("window of ds=%s: left to the window job: building it in shard %d of %d failed (%s: %s)",
                    ds_str(ds), shard.index, shard.count, type(exc).__name__, exc)
        for dataset in STEP_DATASETS["window"]:
            remove_tree(shard.folder(dataset))
        return {}


def _build_group(
    root: str | os.PathLike[str], ds: str | dt.date, group: str, features: FeaturesConfig, *,
    recompute: bool, require_validation: bool, engine: DuckDBSettings | None, shard: Shard | None,
) -> dict[str, Any]:
    """The steps of a group (none reads another's output), each publishing its own outputs. Unsharded, one after
    another: each query keeps the cores busy and has the whole memory limit (a step's last files encode while the next
    one's query runs, ``overlapped_outputs``: every output published by the group's end). A shard's steps run side by side, on
    threads sharing one DuckDB database (its memory limit, threads and spill folder): a shard's queries are small next
    to its fixed parts (Python, the DuckDB start, its one file encoded on one thread), which then overlap; on the
    benchmark's day a shard of 8 took 0.62-0.66 s against 0.71 s one after another (docs/data.md, issue 33's tenth
    round). A shard also builds the group's ``STAGED_STEPS`` when it can: the window after its daily aggregates, on
    the same thread. The first error is raised once every step has ended, the others logged."""
    common: dict[str, Any] = {"recompute": recompute, "require_validation": require_validation, "engine": engine,
                              "shard": shard}
    steps = STEP_GROUPS[group]
    summary: dict[str, Any] = {}
    if shard is None:
        with overlapped_outputs():  # a step's last files encode while the next one's query runs
            for one in steps:
                summary |= build_step(root, ds, one, features, **common)
        return summary

    staged_window = "window" in STAGED_STEPS.get(group, ()) and not recompute
    for dataset in staged_datasets(group):  # an earlier try's: this try stages it again, or leaves it to its job
        remove_tree(shard.folder(dataset))

    def run(one: str) -> dict[str, Any]:
        built = build_step(root, ds, one, features, **common)
        if one == "daily" and staged_window:
            built |= _window_of_staged_day(root, ds, features, common)
        return built

    # The pool is shut down (every step ended) before the database is closed.
    with shared_database(engine, root), ThreadPoolExecutor(len(steps), thread_name_prefix="feature-step") as pool:
        # Each thread a copy of this context: the shared database is found there (``step_io.connect``).
        futures = [pool.submit(contextvars.copy_context().run, run, one) for one in steps]
    failed = [(one, error) for one, future in zip(steps, futures, strict=True) if (error := future.exception())]
    for one, error in failed[1:]:  # the first is raised (and said by the caller); the others would go unsaid
        log.error("%s of ds=%s, shard %d of %d, failed too: %s", one, ds, shard.index, shard.count, error)
    if failed:
        raise failed[0][1]
    for future in futures:
        summary |= future.result()
    return summary


def missing_shards(staging: str, step: str, count: int) -> list[int]:
    """The shards of a sharded build step whose outputs are not all in ``staging`` yet."""
    return [
        i for i in range(count)
        if not all(exists(join(shard_folder(staging, d, i), MARKER)) for d in step_datasets(step))
    ]


def window_built_by_group(root: str | os.PathLike[str], ds: str, settings: dict[str, Any]) -> bool:
    """Whether the window of ``ds`` was built by the shards of the day's first job (``STAGED_STEPS``) and still
    stands: the DAG's window job then has nothing to build (``window_job_reason``)."""
    return window_job_reason(root, ds, settings) is None


def window_job_reason(root: str | os.PathLike[str], ds: str, settings: dict[str, Any]) -> str | None:
    """Why the DAG's window job must build the window of ``ds``; None when the shards of the day's first job built it
    with these ``settings`` (``recorded_settings``) from inputs that are all still as published now (``stale_inputs``:
    a day of its window rebuilt or landed since, the day before's window rebuilt, and it must be built again)."""
    if not all(is_complete(root, dataset, ds) for dataset in STEP_DATASETS["window"]):
        return (f"the first job's shards did not build it (its log says why: not incremental, or the day's pin totals "
                f"unknown), and no window of ds={ds} is published")
    for dataset in STEP_DATASETS["window"]:
        meta = read_metadata(root, dataset, ds)
        if not meta.get("staged_day"):
            return f"{dataset} ds={ds} was not built by the first job's shards (they left it to this job, said in its log)"
        differ = sorted(key for key, value in settings.items() if key in meta and meta[key] != value)
        if differ:
            return f"{dataset} ds={ds} was built with other settings ({', '.join(differ)})"
        stale = stale_inputs(root, meta)
        if stale:
            return f"{dataset} ds={ds} was built from inputs rebuilt since: {', '.join(stale)}"
    return None


def stale_inputs(root: str | os.PathLike[str], meta: dict[str, Any]) -> list[str]:
    """What a window's metadata says it was built from that is not so any more: an input partition republished
    (``input_versions``), a summed day's aggregates rebuilt (``daily_versions``; a staged day's, not published yet,
    is left to its merge), or a day it lacked that has data now (``missing_days``)."""
    recorded = dict(meta.get("input_versions") or {})
    stale = [ref for ref, version in input_versions(root, list(recorded)).items() if version != recorded[ref]]
    stale += [f"the daily aggregates of {day}" for day, version in (meta.get("daily_versions") or {}).items()
              if version != STAGED_DAY_VERSION and daily_version(root, day) != version]
    stale += [f"{day} (missing then)" for day in meta.get("missing_days") or []
              if daily_version(root, day) is not None or has_raw(root, day)]
    return stale


def recorded_settings(features: FeaturesConfig, *, skip_validation: bool) -> dict[str, Any]:
    """The build settings as the steps' metadata records them (what a merge checks its shards were built with)."""
    return {
        "window_days": features.window_days, "prior_impressions": features.pin_prior_impressions,
        "sequence_length": features.sequence_length, "negative_downsample": features.negative_downsample,
        "seed": features.negative_downsample_seed, "skip_validation": skip_validation,
    }


def merge_shards(
    root: str | os.PathLike[str], ds: str | dt.date, step: str, staging: str, count: int,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Publish the partitions of ``step`` for ``ds`` from the ``count`` shards in ``staging``; their summaries.

    Cheap (no data is read): each partition is published whole (``core.storage.publish``) with one file per shard
    (linked locally, copied server-side on an object store) and the shards' metadata merged: ``rows``,
    ``positives`` and ``sums`` summed, ``shards`` recorded. The shards must be those this merge names: of ``ds``,
    ``count`` of them, built with ``settings`` (``recorded_settings``; a ConfigError otherwise: merge with the
    build's flags). Every other metadata key must be equal in every shard (the same inputs, parameters and
    validation fingerprints): shards built from different data are never merged (DataError; they are removed, so
    that the step's rerun builds every shard again). A shard's missing output is an InfraError (a retry builds it).
    Afterwards the step's shard outputs are removed from ``staging``, and the folder itself once empty. The published
    metadata names the staging folder (``merged_from``): merging it again once its shards are gone (a retry of a merge
    that published, or the CLI's ``--merge`` twice) returns what was published instead of failing.
    """
    ds = ds_str(ds)
    missing = missing_shards(staging, step, count)
    # Every shard gone: merged (some left: a new build in the folder, or a merge killed while removing them, whose
    # retry builds the rest and merges again).
    if len(missing) == count and (published := _merged_from(root, ds, step, staging, count)):
        log.info("%s of ds=%s: already merged from the %d shard(s) in %s: nothing to do", step, ds, count, staging)
        _remove_shards(staging, step)  # the staged datasets a merge killed while removing its shards left
        return published
    if missing:
        # Shards of another build there first: building the missing ones (the advice below) would not make this merge.
        first = step_datasets(step)[0]
        for i in range(count):
            if i not in missing:
                meta = dict(read_json(join(shard_folder(staging, first, i), METADATA_FILE)))
                _check_shard_named(first, ds, staging, count, i, meta)
        raise InfraError(_missing_shards_message(root, ds, step, staging, count, missing))
    summary: dict[str, Any] = {}
    try:
        # Every dataset's shards checked before any is published: a step's partitions are published together.
        shards: dict[str, tuple[list[str], list[dict[str, Any]]]] = {}
        for dataset in (*step_datasets(step), *_staged_by_every_shard(root, staging, step, count)):
            # Each shard's published version (on an object store the version folder its marker names).
            folders = [resolve(shard_folder(staging, dataset, i)) for i in range(count)]
            metas = [dict(read_json(join(folder, METADATA_FILE))) for folder in folders]
            _check_shards_named(dataset, ds, staging, count, metas, settings or {})
            common = {k: v for k, v in metas[0].items() if k not in _PER_SHARD_KEYS}
            for i, meta in enumerate(metas[1:], start=1):
                other = {k: v for k, v in meta.items() if k not in _PER_SHARD_KEYS}
                if other != common:
                    differ = sorted(k for k in set(other) | set(common) if other.get(k) != common.get(k))
                    _remove_shards(staging, step)
                    raise DataError(
                        f"{dataset} ds={ds}: shard {i} was built from other inputs or settings than shard 0 ({', '.join(differ)} "
                        f"differ; an input was rebuilt during the build?): nothing was published and the step's shards "
                        f"in {staging} were removed, so that rerunning the step builds every shard from the current inputs"
                    )
            shards[dataset] = folders, metas
        for dataset, (folders, metas) in shards.items():
            merged = {k: v for k, v in metas[0].items() if k not in _PER_SHARD_KEYS}
            for key in _SUMMED_KEYS:
                if key in metas[0]:
                    merged[key] = sum(int(m[key]) for m in metas)
            for key in _SUMMED_DICTS:  # absent from a shard built before it was recorded: left out (its readers fall back)
                if all(key in m for m in metas):
                    merged[key] = {k: sum(int(m[key][k]) for m in metas) for k in metas[0][key]}
            if all("content_digest" in m for m in metas):  # else each examples shard of the next day digests every file
                merged["content_digest"] = combined_digest([m["content_digest"] for m in metas])
            merged["shards"] = count
            merged["merged_from"] = staging
            if merged.get("staged_day"):  # a window of the day's staged aggregates: published above, now its inputs
                _add_staged_day(root, ds, dataset, merged)
            # File part-i holds shard i's rows: the next day's shard i reads only its files (``shard_part``).
            merged["hash_buckets"] = hash_layout(DATASET_KEYS[dataset], count)
            with write_partition(root, dataset, ds) as out:
                for i, folder in enumerate(folders):
                    copy_file(join(folder, shard_file(i)), join(out, shard_file(i)))
                write_json(join(out, METADATA_FILE), merged)
            summary[dataset] = merged
    except FileNotFoundError as exc:
        # Another merge of the same shards published them and removed them meanwhile (a partition appears only whole).
        raise InfraError(
            f"{step} of ds={ds}: a shard's file in {staging} disappeared during the merge ({exc.filename}): another "
            "merge of the same shards ran at the same time? Nothing half-published; a rerun says whether the day is "
            "merged"
        ) from None
    _remove_shards(staging, step)
    return summary


def _merged_from(root: str | os.PathLike[str], ds: str, step: str, staging: str, count: int) -> dict[str, Any]:
    """The published metadata of ``step``'s datasets of ``ds`` when every one of them was merged from the ``count``
    shards in ``staging`` (with those the shards staged and that merge published too); else nothing."""
    always = step_datasets(step)
    published: dict[str, Any] = {}
    for dataset in (*always, *staged_datasets(step)):
        meta = read_metadata(root, dataset, ds) if is_complete(root, dataset, ds) else {}
        if meta.get("merged_from") == staging and meta.get("shards") == count:
            published[dataset] = meta
        elif dataset in always:
            return {}
    return published


def _staged_by_every_shard(root: str | os.PathLike[str], staging: str, step: str, count: int) -> tuple[str, ...]:
    """The datasets of the step's ``STAGED_STEPS`` that every shard wrote (merged with the rest); a step some shards
    left out is left to its own job (each shard decides from the same published state: only a shard rebuilt after it
    changed decides otherwise)."""
    staged: list[str] = []
    for one in STAGED_STEPS.get(step, ()):
        datasets = STEP_DATASETS[one]
        built = [i for i in range(count) if all(exists(join(shard_folder(staging, d, i), MARKER)) for d in datasets)]
        if 0 < len(built) < count:
            log.warning("%s was built by shard(s) %s of %d only (a shard's log says why it did not, unless it was "
                        "killed before): left to its own job", one, built, count)
        if len(built) < count:
            continue
        # Built minutes or hours ago (the array's spread, a retried shard): from the same inputs in every shard, and
        # none rebuilt since; otherwise left to its job (not a DataError of the whole day's shards).
        inputs = {d: {json.dumps({key: meta.get(key) for key in ("input_versions", "daily_versions", "missing_days")},
                                 sort_keys=True)
                      for i in built for meta in [read_json(join(resolve(shard_folder(staging, d, i)), METADATA_FILE))]}
                  for d in datasets}
        if any(len(recorded) > 1 for recorded in inputs.values()):
            log.warning("%s of the shards left to its own job: its shards were built from different inputs", one)
            continue
        stale = sorted({what for recorded in inputs.values() for what in stale_inputs(root, json.loads(recorded.pop()))})
        if stale:
            log.warning("%s of the shards left to its own job: built from inputs rebuilt since: %s", one, ", ".join(stale))
            continue
        staged.extend(datasets)
    return tuple(staged)


def _add_staged_day(root: str | os.PathLike[str], ds: str, dataset: str, merged: dict[str, Any]) -> None:
    """A window that its shards built from their staged daily aggregates of ``ds``: those, now published, are its
    inputs, with their publish stamps (``daily_versions``, which the next day's incremental window checks)."""
    daily = USER_DAILY if dataset == USER_WINDOW else PIN_DAILY
    ref = partition_ref(daily, ds)
    version = daily_version(root, ds)
    if merged["daily_versions"].get(ds) != STAGED_DAY_VERSION or version is None:  # the merge published them first
        raise InfraError(f"{dataset} ds={ds}: the day's daily aggregates it was built from are not published")
    merged["inputs"] = [merged["inputs"][0], ref, *merged["inputs"][1:]]  # as built after them: window, day, leaving
    merged["input_versions"] = {**merged["input_versions"], **input_versions(root, [ref])}
    unvalidated = unvalidated_inputs(root, merged["inputs"])  # the day's too (built with --skip-validation)
    if unvalidated:
        merged["unvalidated_inputs"] = unvalidated
    merged["daily_versions"] = {**merged["daily_versions"], ds: version}


def _missing_shards_message(root: str | os.PathLike[str], ds: str, step: str, staging: str, count: int,
                            missing: list[int]) -> str:
    from core.arrays import format_shards

    what = f"{step} of ds={ds}: shard(s) {missing} have no output in {staging}"
    if len(missing) == count:
        first = step_datasets(step)[0]
        published = read_metadata(root, first, ds).get("shards") if is_complete(root, first, ds) else None
        if published:
            what += f" (none built yet, or already merged: {first} ds={ds} is published from {published} shard(s))"
    return (f"{what}: build them (the same command without --merge, with --run-shards {format_shards(missing)}), "
            "then merge; in the DAG the task's retry builds them")


def _check_shard_named(dataset: str, ds: str, staging: str, count: int, index: int, meta: dict[str, Any]) -> None:
    built = {"ds": meta.get("ds"), "shards": meta.get("shards"), "shard": meta.get("shard")}
    if built != {"ds": ds, "shards": count, "shard": index}:
        raise ConfigError(
            f"{dataset}: shard-{index:05d} in {staging} is shard {built['shard']} of {built['shards']} of "
            f"ds={built['ds']}, but this merge is of {count} shard(s) of ds={ds}: merge with the --ds and --shards the "
            "shards were built with (nothing was published)"
        )


def _check_shards_named(dataset: str, ds: str, staging: str, count: int, metas: list[dict[str, Any]],
                        settings: dict[str, Any]) -> None:
    """ConfigError unless every shard's metadata says it is shard i of ``count`` of ``ds``, built with ``settings``."""
    for i, meta in enumerate(metas):
        _check_shard_named(dataset, ds, staging, count, i, meta)
        differ = sorted(k for k, v in settings.items() if k in meta and meta[k] != v)
        if differ:
            given = ", ".join(f"{k} {meta[k]!r} (this merge: {settings[k]!r})" for k in differ)
            raise ConfigError(
                f"{dataset} ds={ds}: the shards in {staging} were built with {given}: merge with the settings they were "
                "built with, or rebuild them (nothing was published)"
            )


def _remove_shards(staging: str, step: str) -> None:
    """Remove the step's shard outputs from ``staging`` (and their unfinished temporaries), then the folders above
    them up to ``staging`` itself where left empty; nothing else under it (the spec refuses a staging folder that
    holds data)."""
    for dataset in (*step_datasets(step), *staged_datasets(step)):
        shards = join(staging, *dataset.split("/"))
        remove_tree(shards)
        if exists(shards):
            log.warning("could not remove the merged shards in %s (permissions?): remove the folder by hand", shards)
        if is_remote(staging):
            continue  # an object store has no empty folders
        top, folder = local_path(staging), local_path(shards).parent
        while True:
            try:
                folder.rmdir()
            except OSError:  # not empty (another step's shards, anything else: left alone), or gone
                break
            if folder == top:
                break
            folder = folder.parent


# --- CLI ------------------------------------------------------------------------------------------------


def _parser(defaults: FeaturesConfig) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m features.build",
        description="Build the feature partitions of one day (daily aggregates, windows, sequences, examples): as "
        "--spec says (a BUILD.json, features.spec.BuildSpec, as the feature operator writes it), or as the flags "
        "say, which build the same spec. Defaults come from the features: section of the platform configuration "
        "(python -m core.config).",
    )
    parser.add_argument("--spec", default="",
                        help="the build's spec, BUILD.json (a local path or URL); the settings flags may not be given too")
    # Settings flags default to None: given with --spec, they are refused, never silently ignored.
    parser.add_argument("--root", help="storage root: a local folder, a file:// or an s3:// URL")
    parser.add_argument("--ds", help="the partition day, YYYY-MM-DD")
    parser.add_argument("--step", choices=(*STEP_DATASETS, *STEP_GROUPS, "all"),
                        help="which output to build (daily_sequences_examples: those three steps, in one job; "
                        "default: all, in order)")
    parser.add_argument("--window-days", type=int,
                        help=f"days in the window features and sequences (default: {defaults.window_days})")
    parser.add_argument("--sequence-length", type=int,
                        help=f"engagements kept per user (default: {defaults.sequence_length})")
    parser.add_argument("--prior-impressions", type=float, help="pseudo-impressions at the global rate that smooth "
                        f"each pin's rates (default: {defaults.pin_prior_impressions})")
    parser.add_argument("--negative-downsample", type=float, help="probability of keeping an example without a "
                        f"positive label, in (0, 1] (default: {defaults.negative_downsample})")
    parser.add_argument("--seed", type=int,
                        help=f"seed of the negative downsampling hash (default: {defaults.negative_downsample_seed})")
    parser.add_argument(
        "--recompute",
        action="store_true", default=None,
        help="build the window and the sequences from the raw events of the window's days (full recompute)",
    )
    parser.add_argument(
        "--skip-validation",
        action="store_true", default=None,
        help="build even from raw partitions without a passed validation report for their current contents "
        "(python -m features.validate); recorded as skip_validation in the outputs' metadata. For experts",
    )
    parser.add_argument(
        "--shards", type=int,
        help="split the step into this many shards by user-id / pin-id hash (one --step, not all); each shard "
        "writes under --staging, and --merge publishes the day from them (default: 1, unsharded; the DAG's runs take "
        "features.shards, this command does not)",
    )
    parser.add_argument("--run-shards", default="",
                        help="the shards to build, e.g. 0,3,5-7 (default: all); in an array job the index picks one")
    parser.add_argument("--staging", help="the sharded build's staging folder (a local path or URL)")
    parser.add_argument("--merge", action="store_true", default=None,
                        help="publish the step's partitions from the shards in --staging")
    parser.add_argument("--threads", type=int, help=f"DuckDB threads (default: {defaults.duckdb_threads})")
    parser.add_argument("--memory-limit", help=f"DuckDB memory limit, e.g. 4GB (default: {defaults.duckdb_memory_limit})")
    parser.add_argument("--temp-directory", help="parent folder for DuckDB spill files (default: "
                        f"{defaults.duckdb_temp_directory or 'the system temporary folder'})")
    return parser


# The settings flags and the spec's fields they set.
_FLAGS = {"root": "root", "ds": "ds", "step": "step", "window_days": "window_days", "sequence_length": "sequence_length",
          "prior_impressions": "pin_prior_impressions", "negative_downsample": "negative_downsample",
          "seed": "negative_downsample_seed", "recompute": "recompute", "skip_validation": "skip_validation",
          "shards": "shards", "staging": "staging", "merge": "merge", "threads": "duckdb_threads",
          "memory_limit": "duckdb_memory_limit", "temp_directory": "duckdb_temp_directory"}


def spec_of(args: argparse.Namespace, defaults: FeaturesConfig) -> BuildSpec:
    """The build's spec: read from ``--spec``, or built from the flags over the configuration's defaults."""
    from features.spec import FEATURE_FIELDS, BuildSpec

    given = {field: getattr(args, flag) for flag, field in _FLAGS.items() if getattr(args, flag) is not None}
    if args.spec:
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in _FLAGS if getattr(args, f) is not None)
            raise ConfigError(f"--spec {args.spec} and {flags}: give the spec or the flags, not both (edit the spec)")
        return BuildSpec.read(args.spec)
    missing = [f"--{name}" for name in ("root", "ds") if name not in given]
    if missing:
        raise ConfigError(f"give --spec, or {' and '.join(missing)} (python -m features.build --help)")
    return BuildSpec.checked("the command line", **{**{f: getattr(defaults, f) for f in FEATURE_FIELDS}, **given})


def run(spec: BuildSpec, run_shards: str = "") -> dict[str, Any]:
    engine = DuckDBSettings(threads=spec.duckdb_threads, memory_limit=spec.duckdb_memory_limit,
                            temp_directory=spec.duckdb_temp_directory or None)
    require = not spec.skip_validation
    if spec.skip_validation:
        log.warning("skip_validation: building %s from raw partitions that may not have passed validation", spec.ds)
    check_root(spec.root)
    if run_shards and spec.shards <= 1:
        raise ValueError(f"--run-shards {run_shards} picks shards of a sharded build: give --shards N > 1 and --staging too")
    if spec.shards > 1 or spec.merge:
        return _run_sharded(spec, engine, require, run_shards)
    if spec.step != "all":
        return build_step(spec.root, spec.ds, spec.step, spec.features(), recompute=spec.recompute,
                          require_validation=require, engine=engine)
    return build_day(
        spec.root,
        spec.ds,
        window_days=spec.window_days,
        sequence_length=spec.sequence_length,
        prior_impressions=spec.pin_prior_impressions,
        negative_downsample=spec.negative_downsample,
        seed=spec.negative_downsample_seed,
        recompute=spec.recompute,
        require_validation=require, engine=engine,
    )


def _run_sharded(spec: BuildSpec, engine: DuckDBSettings, require: bool, run_shards: str) -> dict[str, Any]:
    from core.arrays import parse_shards, shards_of_this_process

    if spec.merge:
        settings = recorded_settings(spec.features(), skip_validation=spec.skip_validation)
        return merge_shards(spec.root, spec.ds, spec.step, spec.staging, spec.shards, settings)
    features = spec.features()
    summary: dict[str, Any] = {}
    for index in shards_of_this_process(parse_shards(run_shards) or list(range(spec.shards))):
        shard = Shard(index, spec.shards, spec.staging)
        log.info("building %s of ds=%s, shard %d of %d", spec.step, spec.ds, index, spec.shards)
        built = build_step(spec.root, spec.ds, spec.step, features, recompute=spec.recompute, require_validation=require,
                           engine=engine, shard=shard)
        summary[f"shard-{index:05d}"] = built
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    from core import config

    # A job's log (a local node log, CloudWatch, the pod's) then says which shard it built and how (window mode, gaps).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec: BuildSpec | None = None
    try:
        defaults = config.load().features
        args = _parser(defaults).parse_args(argv)
        spec = spec_of(args, defaults)
        summary = run(spec, args.run_shards)
    except PinflowError as exc:
        print(f"features.build: {exc.failure_class.value} error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:  # a bad setting (the typed settings' or a step's own check): fix the command
        print(f"features.build: USER error: {exc}", file=sys.stderr)
        return int(ExitCode.USER)
    except PermissionError as exc:  # nothing was published (a partition appears only whole)
        print(f"features.build: USER error: {exc.strerror} on {exc.filename}: make it writable by this user, or "
              "choose another --root / --staging", file=sys.stderr)
        return int(ExitCode.USER)
    except Exception as exc:
        if classify(exc) is FailureClass.USER:
            raise  # a bug: the traceback says where (exit 1, USER)
        # Nothing was published (a partition appears only whole); the exit code tells the operator to retry or stop.
        log.error("failed", exc_info=exc)
        hint = ""
        if disk_full(exc) and spec is not None:
            hint = (f" (the disk is full: free space under the storage root {spec.root} or in DuckDB's temp directory "
                    f"{spec.duckdb_temp_directory or tempfile.gettempdir()}; the task's retries build it again)")
        print(f"features.build: {classify(exc).value} error: {exc}{hint}", file=sys.stderr)
        return int(exit_code_for(exc))
    print(json.dumps(summary, sort_keys=True))  # one line: a log's last lines keep the progress lines above it
    return 0


if __name__ == "__main__":
    sys.exit(main())
