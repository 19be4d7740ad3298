"""The ranker's evaluation on a day of ``examples``: its predictions (all of them, or a rank's share) and their
metrics per head, against the popularity baseline, the ablation and the world's true probabilities."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from core.contracts import DENSE_FEATURES, EXAMPLES, LABELS, SURFACES, TRUTH
from core.storage import Location, data_files, is_complete, read_parquet
from training.data import ExampleStream, PinEmbeddings, lockstep
from training.evaluate import auc, calibration, finite, hit_at_k, log_loss, oracle_ratio
from training.models.pin_ranker.inputs import EXAMPLE_COLUMNS, encode_batch

# The popularity baseline of each head: the candidate pin's own smoothed rate.
BASELINE_FEATURE = {"click": "p_ctr", "repin": "p_repin_rate", "hide": "p_hide_rate"}


def with_mean_auc(metrics: dict[str, Any]) -> dict[str, Any]:
    aucs = [v for v in metrics["auc"].values() if v is not None]
    metrics["mean_auc"] = sum(aucs) / len(aucs) if aucs else None
    return metrics


def load_truth(root: Location, ds: str) -> tuple[np.ndarray, np.ndarray] | None:
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
    sharded: bool = False,
) -> dict[str, np.ndarray]:
    """Probabilities, labels, baseline features, user and impression ids of every example of ``stream``.

    With ``ablation``, its probabilities too (``ablation_probs``), from the same pass over the data. ``sharded``:
    the models are the training world's TorchRec-sharded ones, whose forward is a collective: the batches come in
    lockstep with the other ranks (:func:`training.data.lockstep`: padded, the padding's outputs dropped).
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
    batches = lockstep(stream) if sharded else ((batch, len(batch["impression_id"])) for batch in stream)
    try:
        for i, (batch, rows) in enumerate(batches):
            inputs = {k: v.to(device) for k, v in batch.items()}
            logits = model(inputs)
            probs.append(torch.stack([torch.sigmoid(logits[lb].float()) for lb in LABELS], 1)[:rows].cpu().numpy())
            if ablation is not None:
                other = ablation(inputs)
                ablation_probs.append(
                    torch.stack([torch.sigmoid(other[lb].float()) for lb in LABELS], 1)[:rows].cpu().numpy())
            users.append(batch["user_id"][:rows].numpy())
            labels.append(batch["labels"][:rows].numpy())
            dense.append(batch["dense"][:rows].numpy())
            ids.append(batch["impression_id"][:rows].numpy())
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
    root: Location,
    eval_ds: str,
    *,
    sequence_length: int,
    batch_size: int = 1024,
    pins: PinEmbeddings | None = None,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
    ablation: nn.Module | None = None,
    surfaces: tuple[str, ...] = SURFACES,
) -> dict[str, Any]:
    """Evaluate ``model`` (a PinRanker, not DDP-wrapped) on the examples of ``eval_ds``.

    Returns ``{"auc", "hit3", "baseline_auc", "baseline_hit3", "oracle_auc", "oracle_ratio", "logloss",
    "calibration": {label: float | None}, "examples": n}``, plus ``"ablation_auc"``, ``"ablation_hit3"``
    and ``"sequence_lift"`` (auc - ablation_auc) given ``ablation``; a metric that is undefined (one
    class only, no truth) is None. ``oracle_auc`` and ``oracle_ratio`` are ``{}`` without a ``truth``
    partition for ``eval_ds``.
    """
    out = predict_day(model, root, eval_ds, sequence_length=sequence_length, batch_size=batch_size, pins=pins,
                      device=device, on_batch=on_batch, ablation=ablation, surfaces=surfaces)
    return metrics_of(out, root, eval_ds)


def predict_day(
    model: nn.Module,
    root: Location,
    eval_ds: str,
    *,
    sequence_length: int,
    batch_size: int = 1024,
    pins: PinEmbeddings | None = None,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
    ablation: nn.Module | None = None,
    surfaces: tuple[str, ...] = SURFACES,
    rank: int = 0,
    world_size: int = 1,
    sharded: bool = False,
) -> dict[str, np.ndarray]:
    """:func:`predict` over the examples of ``eval_ds``: this rank's share of its row groups (all with one rank);
    ``sharded``: :func:`predict`'s."""
    pins = pins or PinEmbeddings.from_snapshot(root, eval_ds)
    stream = ExampleStream(
        root, [eval_ds], lambda table: encode_batch(table, pins, sequence_length, surfaces), batch_size=batch_size,
        dataset=EXAMPLES, columns=EXAMPLE_COLUMNS, shuffle=False, rank=rank, world_size=world_size,
    )
    return predict(model, stream, device=device, on_batch=on_batch, ablation=ablation, sharded=sharded)


def metrics_of(out: dict[str, np.ndarray], root: Location, eval_ds: str) -> dict[str, Any]:
    """:func:`evaluate`'s metrics of :func:`predict`'s output."""
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
        result["auc"][label] = finite(auc(probs[:, i], y))
        result["logloss"][label] = finite(log_loss(probs[:, i], y))
        result["calibration"][label] = finite(calibration(probs[:, i], y))
        baseline = dense[:, DENSE_FEATURES.index(BASELINE_FEATURE[label])]
        result["baseline_auc"][label] = finite(auc(baseline, y))
        result["hit3"][label] = finite(hit_at_k(probs[:, i], y, users))
        result["baseline_hit3"][label] = finite(hit_at_k(baseline, y, users))
    if "ablation_probs" in out:
        result["ablation_auc"], result["ablation_hit3"], result["sequence_lift"] = {}, {}, {}
        for i, label in enumerate(LABELS):
            y = labels[:, i]
            result["ablation_auc"][label] = finite(auc(out["ablation_probs"][:, i], y))
            result["ablation_hit3"][label] = finite(hit_at_k(out["ablation_probs"][:, i], y, users))
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
            oracle = finite(auc(truth_probs[pos[found], i], labels[found, i]))
            result["oracle_auc"][label] = oracle
            ratio = oracle_ratio(result["auc"][label], oracle)
            if ratio is not None:
                result["oracle_ratio"][label] = ratio
    return result

