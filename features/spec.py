"""What one feature build job builds: :class:`BuildSpec`, the typed hand-off from the feature operator to the job.

The operator (``operators.features``) builds it from the platform configuration and the run's params, writes it as
``BUILD.json`` in the job's folder and starts ``python -m features.build --spec <BUILD.json>`` on every backend (a
local process, an AWS Batch or Kubernetes job), as the training operator hands a run its RUN.json. The command
line's flags build the same spec by hand. Light on purpose (no DuckDB, no pyarrow): the operator imports it.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.config import FeaturesConfig
from core.failures import ConfigError
from core.storage import parse_ds

# Steps one job builds, in order. The DAG's first build job runs every step of ``ds`` that reads only the day's raw
# partitions and the day before's features, so that each of its shards starts a process and DuckDB once, not three
# times (per job, that start costs about what a shard's share of a step's query does), and runs them side by side
# (``features.build``); the window reads the day's merged daily aggregates (the pin totals of every shard) and is a
# job of its own, after it. Here (no DuckDB, no pyarrow) for the operator, which sizes a group's shard jobs.
STEP_GROUPS: dict[str, tuple[str, ...]] = {"daily_sequences_examples": ("daily", "sequences", "examples")}
DAY_JOBS = ("daily_sequences_examples", "window")  # the DAG's build jobs of a day, in order
# Steps the shards of a group's job also build when they can: the window, incrementally, from each shard's own daily
# aggregates before they are merged and the day's pin totals recorded when its events were bucketed (the DAG's window
# job then has nothing to do: ``features.build.window_built_by_group``); otherwise the window job builds it.
STAGED_STEPS: dict[str, tuple[str, ...]] = {"daily_sequences_examples": ("window",)}
# One step, a group of STEP_GROUPS, or every step in order.
Step = Literal["daily", "window", "sequences", "examples", "daily_sequences_examples", "all"]
SPEC_FILE = "BUILD.json"
# Under the storage root: the shard outputs of sharded builds not merged yet (no dataset's folder starts with _).
STAGING = "_staging"

_FEATURES = FeaturesConfig()  # the defaults of a spec written by hand: the configuration's, defined once there
# The spec's fields that are settings of the ``features:`` section, checked by its model.
FEATURE_FIELDS = ("window_days", "sequence_length", "pin_prior_impressions", "negative_downsample",
                  "negative_downsample_seed", "duckdb_threads", "duckdb_memory_limit", "duckdb_temp_directory")


class BuildSpec(BaseModel):
    """One build of one day: where, which step, the ``features:`` settings it uses, and how it is split."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    root: str = Field(description="storage root: a local folder, a file:// or an s3:// URL")
    ds: str = Field(description="the partition day, YYYY-MM-DD")
    step: Step = Field("all", description="which output to build (daily_sequences_examples: those steps in one job; "
                      "all: every step, in order)")
    window_days: int = _FEATURES.window_days
    sequence_length: int = _FEATURES.sequence_length
    pin_prior_impressions: float = _FEATURES.pin_prior_impressions
    negative_downsample: float = _FEATURES.negative_downsample
    negative_downsample_seed: int = _FEATURES.negative_downsample_seed
    duckdb_threads: int = _FEATURES.duckdb_threads
    duckdb_memory_limit: str = _FEATURES.duckdb_memory_limit
    duckdb_temp_directory: str = _FEATURES.duckdb_temp_directory
    recompute: bool = Field(False, description="build the window and the sequences from the raw events of the window")
    skip_validation: bool = Field(False, description="build even from raw partitions without a passed validation report")
    shards: int = Field(1, ge=1, description="split the step into this many shards by user-id / pin-id hash")
    staging: str = Field("", description="a sharded build's staging folder (a local path or URL)")
    merge: bool = Field(False, description="publish the step's partitions from the shards in staging")

    @model_validator(mode="after")
    def _check(self) -> BuildSpec:
        parse_ds(self.ds)  # a ValueError naming the day
        self.features()
        if (self.shards > 1 or self.merge) and (self.step == "all" or not self.staging):
            raise ValueError("a sharded build needs one step (daily, window, sequences or examples, or "
                             "daily_sequences_examples) and a staging folder")
        if self.staging:
            problem = staging_problem(self.root, self.staging)
            if problem:
                raise ValueError(problem)
        return self

    def features(self) -> FeaturesConfig:
        """The ``features:`` settings of this build, checked by the configuration's own model."""
        values = {name: getattr(self, name) for name in FEATURE_FIELDS}
        try:
            return FeaturesConfig.model_validate(values)
        except ValidationError as err:
            raise ValueError("; ".join(f"{e['loc'][0]} = {e.get('input')!r}: {e['msg']}" for e in err.errors())) from None

    @classmethod
    def checked(cls, source: str, **values: Any) -> BuildSpec:
        """A spec from keyword values; a ConfigError (USER) names ``source``, each bad field and what it expects."""
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            raise ConfigError(f"{source} is invalid: " + "; ".join(_problem(e) for e in err.errors())) from None

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> BuildSpec:
        """``BUILD.json`` (a local path or a URL), checked; a ConfigError naming the file and the field."""
        from core.storage import read_settings

        return cls.checked(f"build spec {path}", **read_settings(path, "build spec"))

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write it as one atomic file (a local path or a URL): what :meth:`read` reads."""
        from core.storage import write_json

        write_json(path, self.model_dump())


def staging_problem(root: str, staging: str) -> str:
    """Why ``staging`` cannot hold a sharded build's shards ('' if it can): a merge removes the shard outputs under
    it, so it must not be the storage root, a folder above it, or a folder of the root's data (only ``_staging``)."""
    from core.storage import is_remote, join, local_path

    def normal(location: str) -> str:
        return location.rstrip("/") if is_remote(location) else str(local_path(location).resolve())

    if is_remote(root) != is_remote(staging):
        return ""
    base, folder = normal(root), normal(staging)
    allowed = normal(join(root, STAGING))
    if base == folder or base.startswith(folder + "/"):
        where = "the storage root" if base == folder else f"a folder above the storage root {root}"
    elif folder.startswith(base + "/") and not (folder + "/").startswith(allowed + "/"):
        where = f"inside the storage root {root}, among its data"
    else:
        return ""
    return (f"staging = {staging!r} is {where}: the shards write there and the merge removes them; use a folder "
            f"under {join(root, STAGING)} (where the DAG's builds stage) or outside the storage root")


def _problem(error: Any) -> str:
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown key {where!r} (the keys: {', '.join(BuildSpec.model_fields)})"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where} = {error.get('input')!r}: {message}" if where else message
