"""Compute backends: each turns a backend-agnostic ``JobSpec`` into its native request (a pure dry run),
then submits, reports status, fetches logs and cancels.

The backends are an extension point (``core.registry``: the built-in ``local``, ``batch`` and ``kubernetes``, and
any an installed package registers); each is a class with the :class:`Backend` protocol, made by its
``from_config``. Their modules import their provider hooks and clients, so they are imported only when used, and so
is ``operators.backends.base`` (its names are this package's all the same): a DAG file that lists the backends
stays cheap to parse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core import registry

if TYPE_CHECKING:
    from core.config import PlatformConfig
    from operators.backends.base import Backend, JobSpec, JobState, JobStatus, launch_command, validate_for

_FROM_BASE = frozenset({"Backend", "JobSpec", "JobState", "JobStatus", "launch_command", "validate_for"})


def __getattr__(name: str) -> Any:
    """``operators.backends.JobSpec`` and the other names of ``operators.backends.base``, imported at first use."""
    if name in _FROM_BASE:
        from operators.backends import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend_names() -> tuple[str, ...]:
    """The backends a job may name: the built-in ones and those installed packages register (``core.registry``)."""
    return registry.names(registry.BACKENDS)


def get_backend(name: str, cfg: PlatformConfig | None = None, home: str | None = None) -> Backend:
    """The backend called ``name``, set up from the platform configuration (default: this process's).

    ``home`` is where the local backend keeps its job folders (default: the configuration's home).
    """
    backend_class = registry.load(registry.target(registry.BACKENDS, name, hint=" (param backend)"))
    if cfg is None:
        from core import config

        cfg = config.load()
    return backend_class.from_config(cfg, home=home)  # type: ignore[no-any-return]


__all__ = ["Backend", "JobSpec", "JobState", "JobStatus", "backend_names", "get_backend", "launch_command",
           "validate_for"]
