"""Compute backends: each turns a backend-agnostic ``JobSpec`` into its native request (a pure dry run),
then submits, reports status, fetches logs and cancels.

The backend modules import their provider hooks and clients, so they are imported here lazily: a DAG
file that names ``BACKENDS`` stays cheap to parse.
"""

from __future__ import annotations

from typing import Any

from operators.backends.base import Backend, JobSpec, JobState, JobStatus, validate_for

BACKENDS = ("local", "batch", "kubernetes")


def get_backend(name: str, home: str | None = None, cfg: dict[str, Any] | None = None) -> Backend:
    """The backend called ``name``, set up from the platform config (``cfg``, default: config/platform.yaml).

    ``home`` is where the local backend keeps its job folders (default: the config's home).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown compute backend {name!r}: choose one of {', '.join(BACKENDS)} (param backend)")
    if cfg is None:
        from operators import config

        cfg = config.load()
    teams = dict(cfg.get("teams") or {})
    if name == "local":
        from operators.backends.local import LocalBackend

        return LocalBackend(home or cfg["home"])
    if name == "batch":
        from operators.backends.batch import BatchBackend

        return BatchBackend(cfg.get("batch") or {}, teams)  # type: ignore[arg-type]
    from operators.backends.kubernetes import KubernetesBackend

    return KubernetesBackend(cfg.get("kubernetes") or {}, teams)  # type: ignore[arg-type]


__all__ = ["BACKENDS", "Backend", "JobSpec", "JobState", "JobStatus", "get_backend", "validate_for"]
