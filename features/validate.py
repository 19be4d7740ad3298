"""The data validation gate for the raw datasets, as a command (docs/architecture.md §2, §3).

Command line::

    python -m features.validate events --root /data/pinflow --ds 2024-05-01
    python -m features.validate events --root s3://bucket/pinflow --ds 2024-05-01 --quarantine

validates one raw partition (``features.validation.partition.validate_partition``: storage and schema, the
Great Expectations suite, the history checks), writes its report to
``<root>/reports/validation/<dataset>/ds=<ds>/result.json``, exits 0 when the partition passes, 2 when it
fails validation, 75 (``ExitCode.INFRA``: try again) when the storage is full or does not answer, 1 when the
tool itself fails (a bad argument, an invalid platform configuration, a bug), and prints the report location
as its last line.

The thresholds are the ``validation:`` section of the platform configuration (``core.config``, with its
``PINFLOW_VALIDATION__*`` overrides), the same as the DAG's validation tasks use, so the command and the
task judge a partition alike. ``--root`` defaults to the configuration's ``storage_root``. The command moves
a failed partition to quarantine only when asked (``--quarantine``); the DAG's tasks follow
``validation.quarantine``.

The gate's parts live in ``features.validation``; the names other code uses are importable from here too.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from core import config as platform_config
from core import contracts, storage
from core.failures import ConfigError, ExitCode, FailureClass, classify, disk_full
from features.validation.checks import Check, dataset_name, day_bounds
from features.validation.partition import check_names, validate_partition
from features.validation.report import ValidationReport, report_dir
from features.validation.suite import build_suite, suite_check_names

__all__ = [
    "EXIT_ERROR",
    "EXIT_FAILED",
    "EXIT_OK",
    "Check",
    "ValidationReport",
    "build_suite",
    "check_names",
    "dataset_name",
    "day_bounds",
    "main",
    "report_dir",
    "suite_check_names",
    "validate_partition",
]

# Exit codes of the command line.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_FAILED = 2
EXIT_RETRY = int(ExitCode.INFRA)  # the storage is full or does not answer: the same command succeeds later


class _ArgumentParser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; here 2 means "the data failed", so a usage error exits 1."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="python -m features.validate",
        description=(
            "Validate one raw partition <root>/raw/<dataset>/ds=<ds> against its contract, GX suite and history, "
            "and write the report to <root>/reports/validation/<dataset>/ds=<ds>/result.json. Thresholds come "
            "from the validation: section of the platform configuration (PINFLOW_VALIDATION__* overrides). "
            "Exit status: 0 passed, 2 failed validation, 75 storage full or not answering (retry), 1 error of the tool. "
            "The last line printed is the report location."
        ),
    )
    parser.add_argument("dataset", choices=sorted(contracts.RAW_DATASETS), help="the raw dataset")
    parser.add_argument(
        "--root",
        default=None,
        help="storage root: a local path, file:// URL or s3://bucket/prefix (default: storage_root of the "
        "platform configuration)",
    )
    parser.add_argument("--ds", required=True, help="the partition day, YYYY-MM-DD")
    parser.add_argument(
        "--no-data-docs",
        action="store_true",
        help="skip rendering the GX Data Docs HTML site (also skipped when validation.data_docs is false)",
    )
    parser.add_argument(
        "--quarantine",
        action="store_true",
        help="move a failed, complete partition to <root>/quarantine/<dataset>/ds=<ds>/<UTC time>/ with its report",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    where = f"{contracts.RAW_DATASETS[args.dataset]} ds={args.ds}"
    try:
        day = storage.ds_str(args.ds)
        cfg = platform_config.load()
        storage.check_root(args.root or cfg.storage_root)
        report = validate_partition(
            args.root or cfg.storage_root,
            args.dataset,
            day,
            config=cfg.validation,
            data_docs=cfg.validation.data_docs and not args.no_data_docs,
            quarantine=args.quarantine,
            event_buckets=cfg.features.event_buckets if cfg.features.shards > 1 else 0,
        )
    except Exception as err:  # noqa: BLE001 - the CLI turns any tool error into an exit status
        message = f"error: validating {where}: {type(err).__name__}: {err}"
        if isinstance(err, ValueError | ConfigError):  # a bad argument or setting: the message says which
            print(message, file=sys.stderr)
            return EXIT_ERROR
        if classify(err) is FailureClass.INFRA:  # the world, not the command: the same command succeeds later
            hint = (f"the disk is full: free space under {args.root or 'the storage root'} or in the temp folder"
                    if disk_full(err) else "the storage did not answer")
            print(f"{message} ({hint}; run the same command again)", file=sys.stderr)
            return EXIT_RETRY
        traceback.print_exc(file=sys.stderr)  # a bug: the traceback says where
        print(message, file=sys.stderr)
        return EXIT_ERROR
    if report.success:
        print(
            f"{contracts.RAW_DATASETS[report.dataset]} ds={report.ds}: passed {len(report.checks)} checks on {report.rows} rows in {report.duration_s} s"
            + "".join(f"\n{warning}" for warning in report.warnings)
        )
    else:
        print(report.failure_message(again="run this command again to validate it again"))
    print(report.report_path, flush=True)
    return EXIT_OK if report.success else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
