"""How the ranker's raw ids become rows of its embedding tables: a fixed hash (``id_tables: hashed``), or a row
per frequent id and a hashed tail for the rest (``id_tables: managed``). Both run inside the model (and its
exported program), so a serving caller needs no hashing code."""

from __future__ import annotations

import numpy as np
import torch

# A universal hash h(x) = ((x mod P) * A + C) mod P, then mod (buckets - 1) + 1. P = 2^31 - 1 keeps every
# product below 2^62, so nothing overflows int64 (in eager mode, under torch.export and on CUDA alike).
_HASH_P = 2_147_483_647
_HASH_A = 48_271
_HASH_C = 12_345


def hash_ids(ids: torch.Tensor, buckets: int) -> torch.Tensor:
    """Map raw int64 ids to rows 1..buckets-1 of an embedding table; negative ids (absent) map to row 0."""
    h = torch.remainder(torch.remainder(ids, _HASH_P) * _HASH_A + _HASH_C, _HASH_P)
    rows = torch.remainder(h, buckets - 1) + 1
    return torch.where(ids < 0, torch.zeros_like(rows), rows)


# --- managed id tables (``id_tables: managed``) ------------------------------------------------------------
ID_TABLES: tuple[str, ...] = ("hashed", "managed")  # the values of RankerParams.id_tables
# The raw id features whose tables a managed model manages (user_taste shares user_emb's rows, seq_category_emb
# category_emb's).
MANAGED_FEATURES: tuple[str, ...] = ("pin_id", "user_id", "creator_id", "category")
MANAGED_EMPTY = torch.iinfo(torch.int64).max  # an unused slot of a managed-id buffer (sorts last, never an id)


def managed_layout(buckets: int, tail_share: float) -> tuple[int, int]:
    """(own rows, shared tail rows) of a managed table of ``buckets`` rows: row 0 is absent, rows 1..own are each
    one managed id's, the last ``tail`` rows are shared by every other id (hashed)."""
    tail = min(buckets - 1, max(1, round(tail_share * (buckets - 1))))
    return buckets - 1 - tail, tail


def managed_rows(ids: torch.Tensor, managed: torch.Tensor, tail: int) -> torch.Tensor:
    """Rows of raw ids in a managed table: a managed id (one of the sorted ``managed[:-1]``) gets row 1 + its
    index, any other id one of the ``tail`` rows after them by :func:`hash_ids`, a negative id row 0 (absent).

    The same remap as TorchRec's ``MCHManagedCollisionModule`` (a searchsorted into the sorted managed ids), with
    the misses hashed over a band of rows instead of one; it exports with ``torch.export``. ``managed`` always ends
    with one unused slot, so the search never runs past it.
    """
    own = managed.shape[0] - 1
    pos = torch.searchsorted(managed, ids).clamp(max=own)
    found = (managed[pos] == ids) & (pos < own) & (ids != MANAGED_EMPTY)
    tail_rows = own + hash_ids(ids, tail + 1)  # hash_ids: 1..tail
    rows = torch.where(found, pos + 1, tail_rows)
    return torch.where(ids < 0, torch.zeros_like(rows), rows)


def select_managed(ids: np.ndarray, counts: np.ndarray, own: int) -> np.ndarray:
    """The ``own`` most frequent ids (ties: the smaller id first), sorted by id: the ids a managed table gives a
    row each. Negative (absent) ids never get one."""
    keep = ids >= 0
    ids, counts = ids[keep].astype(np.int64), counts[keep]
    order = np.lexsort((ids, -counts))[:own]
    return np.sort(ids[order])

