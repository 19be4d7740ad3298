"""Pinned inputs: a run's frozen view of the partitions it reads (:class:`Pin`, :func:`pin_partition`), and the
explicit value readers are given to honour it (:class:`InputPins`)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.storage.days import ds_str, partition
from core.storage.paths import LINK_FALLBACK_ERRNOS, Location, exists, filesystem, is_remote, join, local_path, name_of
from core.storage.publishing import (
    _ATTEMPTS,
    MARKER,
    SUPERSEDED_GRACE_SECONDS,
    _in_place,
    _marker_state,
    _version_folder,
    resolve,
)

PINS_FILE = "PINS.json"


@dataclass(frozen=True)
class Pin:
    """One input partition as a run pinned it: the version it reads, wherever it reads it.

    ``version`` identifies what was published (a digest of the marker's content, its publish time, and the
    files' names, sizes and, on an object store, ETags). ``location`` is where readers read it: on a local root a
    folder of hard links to the files of that version (``source`` is the live partition), which stays as it is
    whatever is published at ``source`` later, because published files are never modified in place; on an object
    store, the version folder ``<source>/_v=<version>/`` of a versioned partition (:func:`publish`), never changed
    once published, and readable until a later publish removes it (then a read is a DataError naming the
    partition); for a partition landed with a plain marker, the partition itself (``location == source``),
    checked against ``files`` and ``marker`` when it is read.
    """

    dataset: str
    ds: str
    version: str
    location: str
    source: str
    marker: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"size": int, "etag": str | None}

    @property
    def frozen(self) -> bool:
        """Whether ``location`` holds the pinned version only (True: a local copy, or an object store's version
        folder), or is the live partition, checked on read (False)."""
        return self.location != self.source

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "location": self.location, "source": self.source, "marker": self.marker,
                "files": {name: dict(info) for name, info in self.files.items()}}

    @classmethod
    def from_dict(cls, dataset: str, ds: str, data: dict[str, Any]) -> Pin:
        """A pin from its entry in a pin manifest (RUN.json ``inputs``); ValueError naming what is wrong."""
        missing = [k for k in ("version", "location", "source", "marker", "files") if k not in data]
        if missing:
            raise ValueError(f"pinned input {dataset} ds={ds} lacks {', '.join(missing)}")
        return cls(dataset, ds_str(ds), str(data["version"]), str(data["location"]), str(data["source"]),
                   str(data["marker"]), {str(k): dict(v) for k, v in dict(data["files"]).items()})


def _version(marker: str, files: dict[str, dict[str, Any]]) -> str:
    payload = json.dumps({"marker": marker, "files": files}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class _Replaced(Exception):
    """The folder being pinned was replaced by a publish while its files were linked: pin it again."""


def _link_or_copy(dir_fd: int, name: str, target: Path) -> None:
    """A hard link of ``name`` (in the open folder ``dir_fd``) at ``target``; a copy where links fail (another
    filesystem). _Replaced if the file is gone (the folder was replaced and is being removed)."""
    try:
        os.link(name, target, src_dir_fd=dir_fd, follow_symlinks=False)
        return
    except FileNotFoundError:
        raise _Replaced from None
    except OSError as err:
        if err.errno not in LINK_FALLBACK_ERRNOS:
            raise
    try:
        source = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _Replaced from None
    with os.fdopen(source, "rb") as fin, target.open("wb") as fout:
        shutil.copyfileobj(fin, fout, 8 << 20)


def _pin_local(source: Path, target: Path, what: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """Hard-link the files of one published version of the folder ``source`` into ``target``; (marker, files).

    The folder is opened once and its files are linked through that handle, so they all come from one version. That
    version is taken only if the folder is still the one at ``source`` once every file is linked: a published folder
    is never changed while it is in place, whereas one that a publish exchanged meanwhile is being deleted (some of
    its files may be gone already), so the pin starts over on the new version.
    """

    for _ in range(_ATTEMPTS):
        shutil.rmtree(target, ignore_errors=True)
        try:
            fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{what} is missing: no folder {source}") from None
        try:
            names = sorted(n for n in os.listdir(fd) if not n.startswith("."))
            if MARKER not in names:
                if not _in_place(fd, source):
                    continue
                raise FileNotFoundError(f"{what} is incomplete: no {MARKER} marker in {source}")
            target.mkdir(parents=True)
            files = {}
            for name in names:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    continue  # readers read the files directly in the partition only
                _link_or_copy(fd, name, target / name)
                files[name] = {"size": info.st_size, "etag": None}
            if _in_place(fd, source):
                return (target / MARKER).read_text(), files
        except (_Replaced, FileNotFoundError) as err:  # a file of a replaced version deleted under us
            if _in_place(fd, source):
                if isinstance(err, _Replaced):
                    raise FileNotFoundError(f"{what}: a file vanished from {source} while it was pinned") from None
                raise
        finally:
            os.close(fd)
    shutil.rmtree(target, ignore_errors=True)
    raise OSError(f"{what} was republished {_ATTEMPTS} times while it was being pinned: pin it again later")


def _remote_files(folder: str) -> dict[str, dict[str, Any]]:
    """The files directly in a folder on an object store, with their sizes and ETags ({} if there are none)."""
    fs, key = filesystem(folder)
    try:
        entries = fs.ls(key, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {name_of(e["name"]): {"size": int(e.get("size") or 0), "etag": e.get("ETag") or e.get("etag")}
            for e in entries if e.get("type") == "file" and not name_of(e["name"]).startswith(".")}


def _remote_state(folder: str, what: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """(marker content, files with sizes and ETags) of a published folder on an object store, read consistently
    (the listing is read again after the marker; a publish in between is retried)."""
    fs, key = filesystem(folder)
    for _ in range(_ATTEMPTS):
        files = _remote_files(folder)
        if MARKER not in files:
            raise FileNotFoundError(f"{what} is missing or incomplete: no {MARKER} marker in {folder}")
        try:
            marker = bytes(fs.cat_file(f"{key.rstrip('/')}/{MARKER}")).decode()
        except FileNotFoundError:
            continue
        if _remote_files(folder) == files:
            return marker, files
    raise OSError(f"{what} was republished {_ATTEMPTS} times while it was being pinned: pin it again later")


def pin_partition(root: Location, dataset: str, ds: str | dt.date, pins_root: Location) -> Pin:
    """Pin the version of one complete partition that is published now (see :class:`Pin`).

    Local: its files are hard-linked (copied where links fail) into ``<pins_root>/<dataset>/ds=<day>/``, the
    layout of a storage root; an object store: its version is recorded, nothing copied (the location is the
    version folder its marker names, or the partition itself for a plain marker). FileNotFoundError naming
    the partition when it is missing or incomplete.
    """
    day = ds_str(ds)
    source = partition(root, dataset, day)
    what = f"{dataset} partition ds={day}"
    if is_remote(root):
        for _ in range(_ATTEMPTS):
            complete, version = _marker_state(source)
            if not complete:
                raise FileNotFoundError(f"{what} is missing or incomplete: no {MARKER} marker in {source}")
            location = _version_folder(source, version) if version else source
            try:
                marker, files = _remote_state(location, what)
            except FileNotFoundError:
                if version is None or _marker_state(source)[1] == version:
                    raise
                continue  # the version was removed by later publishes meanwhile: pin the current one
            return Pin(dataset, day, _version(marker, files), location, source, marker, files)
        raise OSError(f"{what} was republished {_ATTEMPTS} times while it was being pinned: pin it again later")
    target = partition(pins_root, dataset, day)
    marker, files = _pin_local(local_path(source), local_path(target), what)
    return Pin(dataset, day, _version(marker, files), target, source, marker, files)


def pins_intact(inputs: dict[str, dict[str, dict[str, Any]]]) -> bool:
    """Whether every frozen local copy of a pin manifest (``dataset -> day -> Pin.to_dict()``) is still complete
    (an object store's version folder that is gone is the run's DataError when read, as a changed partition)."""
    for dataset, days in inputs.items():
        for ds, entry in days.items():
            pin = Pin.from_dict(dataset, ds, entry)
            if pin.frozen and not is_remote(pin.location) and not all(exists(join(pin.location, name)) for name in pin.files):
                return False
    return True


def check_pin(pin: Pin) -> None:
    """DataError unless an object store still holds the pinned version: the version folder of a versioned
    partition still holds the pinned files, an unversioned partition still the pinned marker and files."""
    if not is_remote(pin.location):
        return
    from core.failures import DataError

    what = f"{pin.dataset} partition ds={pin.ds}"
    if pin.frozen:  # a version folder: never changed, but removed by the publishes after the one that replaced it
        if _remote_files(pin.location) != pin.files:
            raise DataError(_rebuilt(pin, f"its version folder was removed by later publishes (a publish keeps the "
                                          f"version it replaced, older ones for {SUPERSEDED_GRACE_SECONDS:.0f} s after"
                                          f" they were replaced); the partition now holds {resolve(pin.source)}"))
        return
    try:
        marker, files = _remote_state(pin.location, what)
    except (FileNotFoundError, OSError) as err:
        raise DataError(_rebuilt(pin, f"it is being rebuilt or was removed ({err})")) from None
    if marker != pin.marker or files != pin.files:
        raise DataError(_rebuilt(pin, f"it now holds version {_version(marker, files)}"))


def _rebuilt(pin: Pin, now: str) -> str:
    kept = ("An object store keeps a replaced version only until the publishes after it" if pin.frozen else
            "An object store keeps no copy of a pinned version")
    return (
        f"{pin.dataset} partition ds={pin.ds} ({pin.location}) changed during this run: the run pinned version "
        f"{pin.version} when it was planned and {now}. {kept}, so the run "
        "stops rather than mix versions: start a new run of the training (the tries of one run share its pins, "
        f"in {PINS_FILE} beside its checkpoints)"
    )


@dataclass(frozen=True)
class InputPins:
    """A storage root as a training run reads it: the root, and the partitions the run pinned there.

    Readers honour the pins only when they are given this value where they take a root (it is a path-like of the
    root): :func:`is_complete`, :func:`data_files`, :func:`partition_folder`, :func:`read_metadata`,
    :func:`read_table` and :func:`read_snapshot` resolve a pinned day to its pin's location (on an object store
    they check its version, a DataError when it changed), :func:`complete_days` of a pinned dataset lists its
    pinned days only (the view the run was planned on, e.g. of a snapshot dataset), and :func:`parquet_file`
    checks a pinned object given ``pins``. Given the plain root, they read the live partitions. Writers are not
    affected. Build it with :meth:`of`.
    """

    root: str
    pins: dict[tuple[str, str], Pin] = field(default_factory=dict)  # (dataset, day) -> its pin

    @classmethod
    def of(cls, root: Location, inputs: dict[str, dict[str, dict[str, Any]]]) -> InputPins:
        """The view of ``root`` with the pins of a manifest (``dataset -> day -> Pin.to_dict()``, RUN.json
        ``inputs``; ValueError naming a bad entry). A pin of a partition under another root (a RUN.json copied to
        another root) does not describe this root's partitions: it is left out, with a warning, and read live."""
        pins = {}
        for dataset, days in inputs.items():
            for ds, entry in days.items():
                pin = Pin.from_dict(dataset, ds, entry)
                if _root_key(pin.source) != _root_key(partition(root, dataset, pin.ds)):
                    import logging

                    logging.getLogger(__name__).warning(
                        "pinned input %s ds=%s comes from %s, not from root %s: its live partition is read",
                        dataset, pin.ds, pin.source, root)
                    continue
                pins[dataset, pin.ds] = pin
        return cls(os.fspath(root), pins)

    def __fspath__(self) -> str:
        return self.root

    def __str__(self) -> str:
        return self.root

    def pin(self, dataset: str, ds: str | dt.date) -> Pin | None:
        return self.pins.get((dataset, ds_str(ds)))

    def days(self, dataset: str) -> list[str] | None:
        """The pinned days of ``dataset``, None if none is pinned."""
        return sorted(day for name, day in self.pins if name == dataset) or None

    def pinned_object(self, location: Location) -> tuple[Pin, str] | None:
        """(its pin, its name) for a file of a pinned version on an object store."""
        url = os.fspath(location)
        for pin in self.pins.values():
            if is_remote(pin.location) and url.startswith(pin.location.rstrip("/") + "/"):
                name = url[len(pin.location.rstrip("/")) + 1:]
                if name in pin.files:
                    return pin, name
        return None


def _root_key(root: Location) -> str:
    return os.fspath(root).rstrip("/") if is_remote(root) else os.path.realpath(local_path(root))


def pins_of(root: Location) -> InputPins | None:
    """The pins a reader honours: those of ``root`` if it is an :class:`InputPins`."""
    return root if isinstance(root, InputPins) else None


def pinned(root: Location, dataset: str, ds: str | dt.date) -> Pin | None:
    """The pin a reader given ``root`` reads a partition at, None if it is not pinned."""
    return root.pin(dataset, ds) if isinstance(root, InputPins) else None


def _pinned_files(pin: Pin) -> list[str]:
    if pin.frozen and not is_remote(pin.location):
        if not exists(join(pin.location, MARKER)):
            raise FileNotFoundError(
                f"the pinned copy of {pin.dataset} partition ds={pin.ds} is missing: no {MARKER} in {pin.location} "
                f"(removed by hand?); rerun the training task, which pins its inputs again"
            )
        return sorted(join(pin.location, name) for name in pin.files if name.endswith(".parquet"))
    check_pin(pin)
    return sorted(join(pin.location, name) for name in pin.files if name.endswith(".parquet"))
