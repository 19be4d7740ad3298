"""The platform's extension points, discovered in one place: compute backends and model families.

Each is a group of Python entry points, as torchx discovers its schedulers. The built-in ones are listed here; an
installed package adds its own by declaring them in its ``pyproject.toml``::

    [project.entry-points."pinflow.backends"]
    slurm = "my_platform.slurm:SlurmBackend"        # a class with the Backend protocol and from_config()

    [project.entry-points."pinflow.families"]
    pin_video = "my_models.pin_video"               # a module defining one training.sdk.ModelFamily subclass

An installed entry point with a built-in's name replaces it (installing it says so). A family can also be named by
its module in the configuration (``families.<name>.module``), which wins over both. Nothing is imported until it is
used: :func:`names` reads the installed packages' metadata once (a DAG file's parse lists the backends): kept in
``PINFLOW_HOME/cache/extensions.json`` until a folder on ``sys.path`` changes (a package installed or removed).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
from typing import Any

from core.failures import ConfigError

BACKENDS = "pinflow.backends"
FAMILIES = "pinflow.families"
BUILTIN: dict[str, dict[str, str]] = {
    BACKENDS: {
        "local": "operators.backends.local:LocalBackend",
        "batch": "operators.backends.batch:BatchBackend",
        "kubernetes": "operators.backends.kubernetes:KubernetesBackend",
    },
    FAMILIES: {
        "pin_ranker": "training.models.pin_ranker",
        "pin_content": "training.models.pin_content",
    },
}
_WHAT = {BACKENDS: "compute backend", FAMILIES: "model family"}


CACHE_NAME = "extensions.json"


def _installed_key() -> str:
    """What installing or removing a package changes: the folders on ``sys.path`` (its metadata folder comes or
    goes)."""
    digest = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        try:
            stamp = os.stat(entry or ".").st_mtime_ns
        except OSError:
            stamp = -1
        digest.update(f"\0{entry}\0{stamp}".encode())
    return digest.hexdigest()


@functools.cache
def _installed() -> dict[str, dict[str, str]]:
    """Every group's entry points of the installed packages (the scan of their metadata takes tens of ms: cached)."""
    from core.config_view import cache_dir, write_cache

    key, path = _installed_key(), cache_dir() / CACHE_NAME
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = None  # none yet, or unreadable: scanned again and rewritten
    if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("config"), dict):
        return dict(cached["config"])
    from importlib.metadata import entry_points

    found = {group: {ep.name: ep.value for ep in entry_points(group=group)} for group in BUILTIN}
    write_cache(path, key, found)
    return found


def entries(group: str) -> dict[str, str]:
    """Name -> ``module[:attribute]`` of every extension of ``group``: the built-in ones, then the installed ones."""
    return {**BUILTIN[group], **_installed().get(group, {})}


def names(group: str) -> tuple[str, ...]:
    return tuple(entries(group))


def target(group: str, name: str, *, hint: str = "") -> str:
    """Where the extension ``name`` of ``group`` is (``module[:attribute]``); a ConfigError naming the choices."""
    found = entries(group).get(name)
    if found is None:
        raise ConfigError(f"unknown {_WHAT[group]} {name!r}: choose one of {', '.join(entries(group))}{hint}")
    return found


def load(path: str) -> Any:
    """The object ``module[:attribute]`` names (the module itself without an attribute)."""
    module, _, attribute = path.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded
