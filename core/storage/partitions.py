"""Partitions: whether one is complete, the complete days of a dataset, the files of one (of the pinned version
where the root given is an :class:`~core.storage.pins.InputPins`), and writing one."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from contextlib import contextmanager

from core.storage.days import ds_str, partition
from core.storage.paths import Location, exists, glob, is_remote, join
from core.storage.pins import InputPins, _pinned_files, pinned
from core.storage.publishing import _ATTEMPTS, MARKER, _marker_state, _version_folder, publish, resolve

DATA_FILE = "part-00000.parquet"
METADATA_FILE = "_metadata.json"


def is_complete(root: Location, dataset: str, ds: str | dt.date) -> bool:
    pin = pinned(root, dataset, ds)
    return exists(join(pin.location if pin else partition(root, dataset, ds), MARKER))


def complete_days(root: Location, dataset: str) -> list[str]:
    """The days of ``dataset`` whose partition is complete (has its marker), sorted (a dataset ``root`` pins, an
    :class:`InputPins`: its pinned days)."""
    days = root.days(dataset) if isinstance(root, InputPins) else None
    if days is not None:
        return days
    markers = glob(join(root, *dataset.split("/")), f"ds=*/{MARKER}")
    return sorted(marker.replace(os.sep, "/").rsplit("/", 2)[-2].removeprefix("ds=") for marker in markers)


def partition_folder(root: Location, dataset: str, ds: str | dt.date) -> str:
    """The folder that holds the files of the partition's published version (:func:`resolve`; a partition this
    pinned: its pin's location, :class:`InputPins`). No check that the partition is complete."""
    pin = pinned(root, dataset, ds)
    return pin.location if pin is not None else resolve(partition(root, dataset, ds))


def data_files(root: Location, dataset: str, ds: str | dt.date) -> list[str]:
    """The Parquet files of a complete partition; FileNotFoundError naming the partition if it is incomplete.

    On an object store, those of the version folder its marker names (:func:`resolve`). A partition pinned in
    ``root`` (:class:`InputPins`): the files of the pinned version (a DataError if it is gone, or if an object store's
    unversioned partition holds another one now).
    """
    pin = pinned(root, dataset, ds)
    if pin is not None:
        return _pinned_files(pin)
    return _data_files(root, dataset, ds)[1]


def _data_files(root: Location, dataset: str, ds: str | dt.date) -> tuple[str | None, list[str]]:
    """(the version read, None if unversioned; the Parquet files of the complete partition)."""
    path = partition(root, dataset, ds)
    missing = f"{dataset} partition ds={ds_str(ds)} is missing or incomplete: no {MARKER} marker in {path}"
    if not is_remote(path):
        if not exists(join(path, MARKER)):
            raise FileNotFoundError(missing)
        return None, glob(path, "*.parquet")
    for _ in range(_ATTEMPTS):
        complete, version = _marker_state(path)
        if not complete:
            raise FileNotFoundError(missing)
        if version is None:
            return None, glob(path, "*.parquet")
        files = glob(_version_folder(path, version), "*.parquet")
        if files or _marker_state(path)[1] == version:  # none: removed by later publishes meanwhile, or empty
            return version, files
    raise OSError(f"{dataset} partition ds={ds_str(ds)} was republished {_ATTEMPTS} times while it was listed")


@contextmanager
def write_partition(root: Location, dataset: str, ds: str | dt.date) -> Iterator[str]:
    """Yield a folder to fill with the partition's files; on success it becomes the partition (see :func:`publish`)."""
    with publish(partition(root, dataset, ds)) as staging:
        yield staging
