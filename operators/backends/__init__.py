"""Compute backends: each turns a backend-agnostic ``JobSpec`` into its native request (a pure dry run),
then submits, reports status, fetches logs and cancels."""

from __future__ import annotations

from operators.backends.base import Backend, JobSpec, JobState, JobStatus

BACKENDS = ("local",)


def get_backend(name: str, home: str) -> Backend:
    """The backend called ``name``; ``home`` is where a backend keeps its local state."""
    if name == "local":
        from operators.backends.local import LocalBackend

        return LocalBackend(home)
    raise ValueError(f"unknown compute backend {name!r}: choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "JobSpec", "JobState", "JobStatus", "get_backend"]
