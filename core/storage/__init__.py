"""The storage root and everything under it (docs/architecture.md §2), on a local folder or any fsspec URL (``s3://...``).

This package is the one storage API: the rest of the code calls ``storage.<name>`` on the names imported below.
Its modules, each one job: :mod:`~core.storage.paths` (locations, local paths vs fsspec URLs, one file or folder
at a location), :mod:`~core.storage.publishing` (the publishing rule below, and how readers find the published
version), :mod:`~core.storage.days` (partition days, the folder of one day), :mod:`~core.storage.pins` (pinned
inputs), :mod:`~core.storage.partitions` (completeness, listing, writing a partition), :mod:`~core.storage.parquet`
(Parquet tables, partition metadata, snapshot views).

A partition is the folder ``<root>/<dataset>/ds=YYYY-MM-DD/``. It exists for readers only once its completion
marker ``_SUCCESS`` is there. **One publishing rule** makes every write atomic and idempotent:

* a folder (a partition, a report, a quarantine record) is written through :func:`publish`: on a local root
  into a hidden temporary sibling that is swapped into place with its marker (an atomic exchange on Linux, so
  a reader never finds the folder missing; writers of one folder take turns on its lock file), so a crash
  never leaves partial output and a rerun replaces exactly that folder; on an object store, which has no rename, the
  data goes into a fresh version folder ``<folder>/_v=<version>/`` (ids sort by time) and the marker, written last as
  one conditional PUT (only if the marker is still the one read: concurrent writers never move it back to an older
  version), names that version (``{"published": ..., "version": ...}``), so readers switch from the whole old version
  to the whole new one; the older versions are then removed once the one replaced had been published for
  ``publishing.SUPERSEDED_GRACE_SECONDS`` (readers that resolved them have had that long to finish), never the one
  replaced (kept for readers that had just resolved it) nor a newer one (a concurrent writer's); a failure removes
  its own version folder only;
* a single file (JSON, a report page) through :func:`write_bytes` / :func:`write_json`: locally a temporary
  sibling and a rename, on an object store one PUT, which S3 makes visible whole or not at all.

Readers find a folder's files through :func:`resolve` (:func:`partition_folder` for a partition): on an object
store the version folder its marker names (:func:`read_table` on a local root opens the folder once and its files
through that handle: one version, whatever a publish does meanwhile); a plain marker (not JSON naming a version: a
partition an upstream producer landed, or one written by older code) means the files directly in the folder, as on
a local root.

Names used inside a module are looked up there: a test that replaces one (``_exchange``, ``write_bytes`` under
``write_json``, ``SUPERSEDED_GRACE_SECONDS``) patches that module, not this package.
"""

from core.storage.days import day_range, day_spans, ds_str, parse_ds, partition, shift_ds
from core.storage.parquet import (
    parquet_file,
    read_metadata,
    read_parquet,
    read_snapshot,
    read_table,
    snapshot_days,
    write_table,
)
from core.storage.partitions import (
    DATA_FILE,
    METADATA_FILE,
    complete_days,
    data_files,
    is_complete,
    partition_folder,
    write_partition,
)
from core.storage.paths import (
    Location,
    as_uri,
    check_root,
    copy_file,
    copy_tree,
    exists,
    filesystem,
    glob,
    is_dir,
    is_remote,
    join,
    last_modified,
    list_names,
    local_path,
    make_dirs,
    modified,
    move_tree,
    name_of,
    open_output,
    read_bytes,
    read_json,
    read_settings,
    read_text,
    remove,
    remove_tree,
    write_bytes,
    write_json,
    write_text,
)
from core.storage.pins import PINS_FILE, InputPins, Pin, check_pin, pin_partition, pinned, pins_intact, pins_of
from core.storage.publishing import MARKER, VERSION_PREFIX, marker_version, new_version, publish, read_version, resolve

__all__ = [
    "DATA_FILE", "MARKER", "METADATA_FILE", "PINS_FILE", "VERSION_PREFIX", "InputPins", "Location", "Pin", "as_uri",
    "check_pin", "check_root", "complete_days", "copy_file", "copy_tree", "data_files", "day_range", "day_spans", "ds_str",
    "exists", "filesystem", "glob", "is_complete", "is_dir", "is_remote", "join", "last_modified", "list_names",
    "local_path", "make_dirs", "marker_version", "modified", "move_tree", "name_of", "new_version", "open_output",
    "parquet_file", "parse_ds", "partition", "partition_folder", "pin_partition", "pinned", "pins_intact",
    "pins_of", "publish", "read_bytes", "read_json", "read_metadata", "read_parquet", "read_settings", "read_snapshot",
    "read_table", "read_text", "read_version", "remove", "remove_tree", "resolve", "shift_ds", "snapshot_days",
    "write_bytes", "write_json", "write_partition", "write_table", "write_text",
]
