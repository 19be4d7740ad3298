"""The platform configuration for the DAG files: the values ``core.config.load()`` returns, read from a cache of
the validated configuration so that parsing a DAG file does not build the typed models (building them was most of
a DAG file's parse time).

A DAG file reads a few values (its params' defaults, schedules, the HPO rounds). :func:`load` returns them as a
read-only view: sections as attributes, dicts of sections as dicts, every value as ``core.config.load()`` has it.
The cache is one JSON file under ``PINFLOW_HOME/cache/`` keyed by everything ``core.config.read()`` depends on:
the configuration file's path and bytes, every ``PINFLOW_*`` environment variable, ``PINFLOW_HOME``, the source of
``core/config.py``, Python's, pydantic's and PyYAML's versions. On any other key (a change of one of them, or no
cache yet) it calls ``core.config.load()``, which raises :class:`~core.failures.ConfigError` for an invalid
configuration exactly as before (the DAG's import error names the key and its source), and caches the result.
An invalid configuration is never cached; a configuration holding a value JSON cannot keep exactly (a date, a
dict with non-string keys under ``params:``) is not cached either: every parse then builds the models.

The view has no model methods (``model_copy``, ``model_dump``): DAG files only read values and hand them to
helpers that read values (``operators.deadlines.alerts``, ``operators.params.team_param``). Tasks and operators
call ``core.config.load()`` at run time, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from core.config import PlatformConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_SOURCE = Path(__file__).resolve().parent / "config.py"
CACHE_NAME = "platform-config.json"
_SECTION = "__section__"


class Section:
    """A read-only section of the configuration: ``view.training.model``."""

    __slots__ = ("_name", "_values")

    def __init__(self, name: str, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"{self._name} has no setting {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{self._name} is read-only (the configuration as parsed)")

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


def _home() -> Path:
    # As core.config.pinflow_home().
    return Path(os.environ.get("PINFLOW_HOME") or REPO_ROOT / ".pinflow").resolve()


def cache_dir() -> Path:
    """Where what a DAG file's parse reads is cached (this configuration, ``core.registry``'s extensions)."""
    return _home() / "cache"


def cache_key() -> str | None:
    """A digest of everything ``core.config.read()`` reads; None when the file cannot be read here (then
    ``core.config.load()`` decides, and says what is wrong)."""
    named = os.environ.get("PINFLOW_CONFIG")
    loaded = sys.modules.get("core.config")  # its CONFIG_FILE, should a test have moved it
    file = Path(named).absolute() if named else getattr(loaded, "CONFIG_FILE", REPO_ROOT / "config" / "platform.yaml")
    try:
        text = file.read_bytes()
    except FileNotFoundError:
        if named:
            return None
        text = b"\0(no file)"  # read() takes the defaults
    except OSError:
        return None
    import yaml  # both loaded already where Airflow is
    from pydantic.version import VERSION

    digest = hashlib.sha256()
    for part in (
        sys.version, VERSION, yaml.__version__,
        str(file), str(_home()),
        json.dumps(sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("PINFLOW_"))),
    ):
        digest.update(part.encode() + b"\0")
    digest.update(CONFIG_SOURCE.read_bytes() + b"\0")
    digest.update(text)
    return digest.hexdigest()


def _encode(value: Any) -> Any:
    """JSON of a validated configuration with sections marked; ValueError for a value JSON does not keep exactly."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        return {_SECTION: type(value).__name__, "values": {name: _encode(getattr(value, name)) for name in fields}}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or _SECTION in value:
            raise ValueError("a dict with keys JSON does not keep")
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if value is None or type(value) in (str, int, float, bool):
        return value
    raise ValueError(f"a {type(value).__name__} value")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if _SECTION in value:
            return Section(value[_SECTION], {k: _decode(v) for k, v in value["values"].items()})
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _read(path: Path, key: str) -> Any | None:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("key") != key:
        return None
    encoded = cached.get("config")
    return encoded if isinstance(encoded, dict) and _SECTION in encoded else None  # else a damaged file: read anew


def write_cache(path: Path, key: str, encoded: Any) -> None:
    """Atomically, as another DAG file's parse may write it at the same time; a home not writable: no cache."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "config": encoded}))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def load() -> PlatformConfig:
    """The configuration ``core.config.load()`` returns, as a read-only view (typed as the model so that mypy
    checks the names a DAG file reads). Raises ConfigError for an invalid configuration."""
    key = cache_key()
    path = cache_dir() / CACHE_NAME
    encoded = _read(path, key) if key else None
    if encoded is None:
        from core import config
        from core.failures import ConfigError

        cfg = config.load()  # raises ConfigError for an invalid configuration, naming the key
        try:
            # Cached only as read now: a long-lived process's load() keeps an earlier configuration while the
            # file is invalid, which is not what this key reads.
            fresh = config.read()
            encoded = _encode(fresh)
        except (ConfigError, ValueError):
            return cfg
        if fresh != cfg:
            return cfg
        if key and cache_key() == key:  # nothing changed while it was read
            write_cache(path, key, encoded)
    return cast("PlatformConfig", _decode(encoded))
