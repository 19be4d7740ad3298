"""Platform configuration: ``config/platform.yaml`` overlaid by environment variables, read once.

``PINFLOW_HOME`` (default: ``.pinflow/`` in the clone) holds everything the embedded default writes;
relative paths in the YAML are taken relative to it. Any key can be overridden by
``PINFLOW_<SECTION>__<KEY>`` (``PINFLOW_TRAINING__EPOCHS=3``) or, for top-level keys, ``PINFLOW_<KEY>``
(``PINFLOW_STORAGE_ROOT=/data/pinflow``). Values from the environment are parsed as YAML scalars.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_FILE = REPO_ROOT / "config" / "platform.yaml"


def pinflow_home() -> Path:
    return Path(os.environ.get("PINFLOW_HOME") or REPO_ROOT / ".pinflow").resolve()


def _overlay_env(config: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    merged = copy.deepcopy(config)
    for name, raw in environ.items():
        if not name.startswith("PINFLOW_") or name == "PINFLOW_HOME":
            continue
        path = name[len("PINFLOW_") :].lower().split("__")
        node = merged
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{name}: {'.'.join(path[:-1])} is not a section of {CONFIG_FILE}")
        node[path[-1]] = yaml.safe_load(raw) if raw else raw
    return merged


@functools.cache
def load() -> dict[str, Any]:
    """The merged platform config, with paths resolved. Cached: read once per process."""
    with CONFIG_FILE.open() as f:
        config = _overlay_env(yaml.safe_load(f), dict(os.environ))
    home = pinflow_home()

    def resolve(value: str) -> str:
        return value if "://" in value or Path(value).is_absolute() else str(home / value)

    config["home"] = str(home)
    config["storage_root"] = resolve(str(config["storage_root"]))
    mlflow = config["mlflow"]
    mlflow["artifact_root"] = resolve(str(mlflow["artifact_root"]))
    if not mlflow.get("tracking_uri"):
        mlflow["tracking_uri"] = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    return config


def storage_root() -> str:
    return str(load()["storage_root"])


def section(name: str) -> dict[str, Any]:
    return dict(load()[name])
