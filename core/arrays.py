"""Array jobs: which of a job's shards this process runs (the local backend's, AWS Batch's and a Kubernetes
Indexed Job's array index), and the ``0,3,5-7`` notation shard lists travel in on a command line."""

from __future__ import annotations

import os
from collections.abc import Sequence

from core.failures import UserError

# The platform's own array index variable: the local backend sets it, and so does any backend (``core.registry``)
# whose service has no index variable of its own.
ARRAY_INDEX_VARIABLE = "PINFLOW_ARRAY_INDEX"
# The array index of this process in an array job: the platform's, AWS Batch's, a Kubernetes Indexed Job's.
ARRAY_INDEX_VARIABLES = (ARRAY_INDEX_VARIABLE, "AWS_BATCH_JOB_ARRAY_INDEX", "JOB_COMPLETION_INDEX")


def array_index(environ: dict[str, str] | None = None) -> int | None:
    """This process's index in an array job, from the first of ``ARRAY_INDEX_VARIABLES`` that is set."""
    env = os.environ if environ is None else environ
    for name in ARRAY_INDEX_VARIABLES:
        value = env.get(name, "")
        if value != "":
            if not value.strip().isdigit():
                raise UserError(f"{name}={value!r} is not an array index (a whole number from 0): unset it, or set it "
                                "to this process's shard position")
            return int(value)
    return None


def parse_shards(text: str) -> list[int]:
    """``0,3,5-7`` → [0, 3, 5, 6, 7]; anything else is a ValueError naming the item (a USER error to the CLIs)."""
    shards: list[int] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        first, _, last = item.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
            raise ValueError(f"shard list {text!r}: {item!r} is not a shard number or a range like 5-7")
        shards.extend(range(int(first), int(last or first) + 1))
    return shards


def format_shards(shards: Sequence[int]) -> str:
    """The inverse of :func:`parse_shards`, with runs folded: [0, 3, 5, 6, 7] → ``0,3,5-7``."""
    out: list[str] = []
    items = sorted(shards)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def shards_of_this_process(shards: list[int], environ: dict[str, str] | None = None) -> list[int]:
    """The shards this process runs: one of ``shards`` in an array job (its index picks it), else all of them."""
    index = array_index(environ)
    if index is None:
        return shards
    if not 0 <= index < len(shards):
        raise UserError(f"array index {index} is outside the {len(shards)} shard(s) given with --shards")
    return [shards[index]]
