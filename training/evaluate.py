"""Offline evaluation metrics, shared by every model family: AUC (tie-aware), average precision, log loss,
calibration, HIT@k per group, macro one-vs-rest AUC and macro F1 for multi-class heads, and the share of the
oracle's lift over chance. A family's ``evaluate`` (``training.sdk``) computes its report with these.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


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


def finite(value: float) -> float | None:
    """A metric for a report: None where it is undefined (NaN, infinite)."""
    return None if value is None or not math.isfinite(value) else float(value)


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the precision-recall curve (average precision; ties in score ordered by row). NaN without a positive."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    if n_pos == 0:
        return math.nan
    order = np.argsort(-scores, kind="mergesort")
    hits = labels[order]
    precision = np.cumsum(hits) / np.arange(1, hits.size + 1)
    return float(precision[hits].sum() / n_pos)


def macro_ovr_auc(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean one-vs-rest AUC over the classes present in ``labels`` (probs: [n, classes])."""
    classes = [k for k in range(probs.shape[1]) if 0 < int((labels == k).sum()) < labels.size]
    aucs = [auc(probs[:, k], labels == k) for k in classes]
    return float(np.mean(aucs)) if aucs else math.nan


def macro_f1(predicted: np.ndarray, labels: np.ndarray, classes: int) -> float:
    """Mean F1 over the classes that occur in ``labels`` or ``predicted``."""
    scores = []
    for k in range(classes):
        tp = int(((predicted == k) & (labels == k)).sum())
        fp = int(((predicted == k) & (labels != k)).sum())
        fn = int(((predicted != k) & (labels == k)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else math.nan


def oracle_ratio(model_auc: float | None, oracle_auc: float | None) -> float | None:
    """The model's share of the oracle's lift over chance, (auc - 0.5) / (oracle - 0.5)."""
    if model_auc is None or oracle_auc is None or oracle_auc <= 0.5:
        return None
    return (model_auc - 0.5) / (oracle_auc - 0.5)


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
