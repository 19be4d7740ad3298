"""Compute backends: each turns a backend-agnostic ``JobSpec`` into its native request (a pure dry run),
then submits, reports status, fetches logs and cancels.

The backend modules import their provider hooks and clients, so they are imported here lazily, and so is
``operators.backends.base`` (its names are this package's all the same): a DAG file that names ``BACKENDS``
stays cheap to parse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.failures import ConfigError

if TYPE_CHECKING:
    from core.config import PlatformConfig
    from operators.backends.base import Backend, JobSpec, JobState, JobStatus, launch_command, validate_for

BACKENDS = ("local", "batch", "kubernetes")
_FROM_BASE = frozenset({"Backend", "JobSpec", "JobState", "JobStatus", "launch_command", "validate_for"})


def __getattr__(name: str) -> Any:
    """``operators.backends.JobSpec`` and the other names of ``operators.backends.base``, imported at first use."""
    if name in _FROM_BASE:
        from operators.backends import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_backend(name: str, cfg: PlatformConfig | None = None, home: str | None = None) -> Backend:
    """The backend called ``name``, set up from the platform configuration (default: this process's).

    ``home`` is where the local backend keeps its job folders (default: the configuration's home).
    """
    if name not in BACKENDS:
        raise ConfigError(f"unknown compute backend {name!r}: choose one of {', '.join(BACKENDS)} (param backend)")
    if cfg is None:
        from core import config

        cfg = config.load()
    if name == "local":
        from operators.backends.local import LocalBackend

        return LocalBackend(home or cfg.home)
    from operators.backends.resources import Catalog

    if name == "batch":
        from operators.backends.batch import BatchBackend

        return BatchBackend(cfg.batch, cfg.teams, Catalog.from_config(cfg))
    from operators.backends.kubernetes import KubernetesBackend

    return KubernetesBackend(cfg.kubernetes, cfg.teams, Catalog.from_config(cfg), ray_version=cfg.inference.ray_version)


__all__ = ["BACKENDS", "Backend", "JobSpec", "JobState", "JobStatus", "get_backend", "launch_command", "validate_for"]
