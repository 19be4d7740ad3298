"""Offline evaluation of a PinRanker on one day of examples.

Per head: AUC (tie-aware), HIT@3 (per user), log loss and calibration of the model; the AUC and HIT@3 of
the popularity baseline (the example's own pin rate feature); when the synthetic world's ``truth``
partition of that day exists, the AUC of the true probabilities (the oracle: the best any model can do on
these labels) and the model's share of the oracle's lift over chance, ``(auc - 0.5) / (oracle - 0.5)``;
and, given the ablation model trained without the action sequence, its AUC and the sequence's lift.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from core.contracts import DENSE_FEATURES, LABELS, TRUTH
from core.storage import data_files, is_complete, read_parquet
from training.data import ExampleStream, PinEmbeddings

# The popularity baseline of each head: the candidate pin's own smoothed rate.
BASELINE_FEATURE = {"click": "p_ctr", "repin": "p_repin_rate", "hide": "p_hide_rate"}


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve; tied scores count one half (Mann-Whitney U with mid-ranks).

    NaN when the labels hold only one class.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Mid-rank of each run of equal scores: ranks are 1-based, a run [i, j) gets (i + 1 + j) / 2.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.size]
    mid = (starts + 1 + ends) / 2.0
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.repeat(mid, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(probs: np.ndarray, labels: np.ndarray, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), eps, 1 - eps)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))) if y.size else math.nan


def calibration(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean predicted / mean observed: 1.0 is calibrated, above 1 over-predicts."""
    observed = float(np.mean(labels)) if np.size(labels) else 0.0
    return float(np.mean(probs)) / observed if observed > 0 else math.nan


def hit_at_k(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, k: int = 3) -> float:
    """Share of the groups (users) with a positive whose ``k`` best-scored rows hold at least one positive.

    Ties are broken by row order, the same for every scorer. NaN when no group has a positive.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    groups = np.asarray(groups)
    if scores.size == 0:
        return math.nan
    order = np.lexsort((np.arange(scores.size), -scores, groups))  # by group, then best score first
    g = groups[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    rank = np.arange(g.size) - np.repeat(starts, np.diff(np.r_[starts, g.size]))
    has_pos = np.zeros(starts.size, dtype=bool)
    hit = np.zeros(starts.size, dtype=bool)
    group_index = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, g.size]))
    np.logical_or.at(has_pos, group_index, labels[order])
    np.logical_or.at(hit, group_index, labels[order] & (rank < k))
    return float(hit[has_pos].mean()) if has_pos.any() else math.nan


def _finite(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def load_truth(root: str | os.PathLike[str], ds: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Sorted impression ids and their true probabilities [n, len(LABELS)], or None without truth."""
    if not is_complete(root, TRUTH, ds):
        return None
    ids, probs = [], []
    for path in data_files(root, TRUTH, ds):
        table = read_parquet(path, columns=["impression_id", *(f"p_{label}" for label in LABELS)])
        ids.append(table.column("impression_id").to_numpy())
        probs.append(np.stack([table.column(f"p_{label}").to_numpy() for label in LABELS], axis=1))
    if not ids:
        return None
    all_ids = np.concatenate(ids)
    order = np.argsort(all_ids, kind="stable")
    return all_ids[order], np.concatenate(probs)[order]


@torch.no_grad()
def predict(
    model: nn.Module,
    stream: ExampleStream,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
    ablation: nn.Module | None = None,
) -> dict[str, np.ndarray]:
    """Probabilities, labels, baseline features, user and impression ids of every example of ``stream``.

    With ``ablation``, its probabilities too (``ablation_probs``), from the same pass over the data.
    """
    was_training = model.training
    model.eval()
    if ablation is not None:
        ablation.eval()
    probs: list[np.ndarray] = []
    ablation_probs: list[np.ndarray] = []
    users: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    dense: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    try:
        for i, batch in enumerate(stream):
            inputs = {k: v.to(device) for k, v in batch.items()}
            logits = model(inputs)
            probs.append(torch.stack([torch.sigmoid(logits[lb].float()) for lb in LABELS], 1).cpu().numpy())
            if ablation is not None:
                other = ablation(inputs)
                ablation_probs.append(torch.stack([torch.sigmoid(other[lb].float()) for lb in LABELS], 1).cpu().numpy())
            users.append(batch["user_id"].numpy())
            labels.append(batch["labels"].numpy())
            dense.append(batch["dense"].numpy())
            ids.append(batch["impression_id"].numpy())
            if on_batch is not None:
                on_batch(i)
    finally:
        model.train(was_training)
    width = len(LABELS)
    out = {
        "probs": np.concatenate(probs) if probs else np.zeros((0, width)),
        "user_id": np.concatenate(users) if users else np.zeros(0, dtype=np.int64),
        "labels": np.concatenate(labels) if labels else np.zeros((0, width)),
        "dense": np.concatenate(dense) if dense else np.zeros((0, len(DENSE_FEATURES))),
        "impression_id": np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64),
    }
    if ablation is not None:
        out["ablation_probs"] = np.concatenate(ablation_probs) if ablation_probs else np.zeros((0, width))
    return out


def evaluate(
    model: nn.Module,
    root: str | os.PathLike[str],
    eval_ds: str,
    *,
    sequence_length: int,
    batch_size: int = 1024,
    pins: PinEmbeddings | None = None,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
    ablation: nn.Module | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (a PinRanker, not DDP-wrapped) on the examples of ``eval_ds``.

    Returns ``{"auc", "hit3", "baseline_auc", "baseline_hit3", "oracle_auc", "oracle_ratio", "logloss",
    "calibration": {label: float | None}, "examples": n}``, plus ``"ablation_auc"``, ``"ablation_hit3"``
    and ``"sequence_lift"`` (auc - ablation_auc) given ``ablation``; a metric that is undefined (one
    class only, no truth) is None. ``oracle_auc`` and ``oracle_ratio`` are ``{}`` without a ``truth``
    partition for ``eval_ds``.
    """
    pins = pins or PinEmbeddings.from_snapshot(root, eval_ds)
    stream = ExampleStream(root, [eval_ds], pins, batch_size=batch_size, sequence_length=sequence_length, shuffle=False)
    out = predict(model, stream, device=device, on_batch=on_batch, ablation=ablation)
    probs, labels, dense, users = out["probs"], out["labels"], out["dense"], out["user_id"]
    result: dict[str, Any] = {
        "auc": {},
        "hit3": {},
        "baseline_auc": {},
        "baseline_hit3": {},
        "oracle_auc": {},
        "oracle_ratio": {},
        "logloss": {},
        "calibration": {},
        "examples": int(labels.shape[0]),
    }
    for i, label in enumerate(LABELS):
        y = labels[:, i]
        result["auc"][label] = _finite(auc(probs[:, i], y))
        result["logloss"][label] = _finite(log_loss(probs[:, i], y))
        result["calibration"][label] = _finite(calibration(probs[:, i], y))
        baseline = dense[:, DENSE_FEATURES.index(BASELINE_FEATURE[label])]
        result["baseline_auc"][label] = _finite(auc(baseline, y))
        result["hit3"][label] = _finite(hit_at_k(probs[:, i], y, users))
        result["baseline_hit3"][label] = _finite(hit_at_k(baseline, y, users))
    if "ablation_probs" in out:
        result["ablation_auc"], result["ablation_hit3"], result["sequence_lift"] = {}, {}, {}
        for i, label in enumerate(LABELS):
            y = labels[:, i]
            result["ablation_auc"][label] = _finite(auc(out["ablation_probs"][:, i], y))
            result["ablation_hit3"][label] = _finite(hit_at_k(out["ablation_probs"][:, i], y, users))
            a, b = result["auc"][label], result["ablation_auc"][label]
            result["sequence_lift"][label] = None if a is None or b is None else a - b

    truth = load_truth(root, eval_ds)
    if truth is not None:
        truth_ids, truth_probs = truth
        ids = out["impression_id"]
        pos = np.minimum(np.searchsorted(truth_ids, ids), max(len(truth_ids) - 1, 0))
        found = truth_ids[pos] == ids if len(truth_ids) else np.zeros(len(ids), dtype=bool)
        result["oracle_coverage"] = float(found.mean()) if len(ids) else 0.0
        for i, label in enumerate(LABELS):
            oracle = _finite(auc(truth_probs[pos[found], i], labels[found, i]))
            result["oracle_auc"][label] = oracle
            model_auc = result["auc"][label]
            if oracle is not None and model_auc is not None and oracle > 0.5:
                result["oracle_ratio"][label] = (model_auc - 0.5) / (oracle - 0.5)
    return result


def flat_metrics(result: dict[str, Any], prefix: str = "eval_") -> dict[str, float]:
    """``{"auc": {"click": x}}`` → ``{"eval_auc_click": x}``, dropping undefined values (for MLflow)."""
    flat: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, dict):
            for label, v in value.items():
                if v is not None:
                    flat[f"{prefix}{key}_{label}"] = float(v)
        elif value is not None:
            flat[f"{prefix}{key}"] = float(value)
    return flat
