"""A third model family, written the way docs/training.md ("Add a model family") says: one file against ``training.sdk``.

``tiny_click`` predicts a click from the impression's dense features alone (a logistic regression over the
log-transformed counts and the rates of ``examples``). The platform supplies the rest: the input pipeline,
DDP, checkpoints, MLflow, registration, the promotion gate. It is configured by

    families:
      tiny_click: {module: tiny_click, params: {hidden: 8}}

with this folder on ``PYTHONPATH`` (``tests/integration/test_model_sdk.py`` does both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from core.contracts import DENSE_FEATURES, EXAMPLES
from training.data import ExampleStream
from training.evaluate import auc, finite
from training.sdk import ModelFamily


@dataclass(frozen=True)
class Params:
    hidden: int = 8


class ClickModel(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(len(DENSE_FEATURES), hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(torch.log1p(batch["dense"].clamp(min=0))).squeeze(-1)


class Serving(nn.Module):
    def __init__(self, model: ClickModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"p_click": torch.sigmoid(self.model({"dense": dense}))}


class TinyClick(ModelFamily):
    name = "tiny_click"
    Params = Params
    dataset = EXAMPLES
    columns = ("impression_id", *DENSE_FEATURES, "click")
    serving_inputs = ("dense",)
    outputs = ("p_click",)

    def encode(self, table: pa.Table, context: Any) -> dict[str, torch.Tensor]:
        dense = np.stack([table.column(c).to_numpy().astype(np.float32) for c in DENSE_FEATURES], axis=1)
        return {
            "dense": torch.from_numpy(dense),
            "click": torch.from_numpy(table.column("click").to_numpy().astype(np.float32)),
            "row_id": torch.from_numpy(table.column("impression_id").to_numpy().astype(np.int64)),
        }

    def build_model(self, variant: str = "model") -> nn.Module:
        return ClickModel(self.params.hidden)

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = F.binary_cross_entropy_with_logits(outputs.float(), batch["click"])
        return loss, {"click": loss}

    @torch.no_grad()
    def evaluate(self, models: dict[str, nn.Module], root: str, eval_ds: str, context: Any, *, device: Any,
                 batch_size: int, on_batch: Callable[[int], None] | None = None) -> dict[str, Any]:
        stream = ExampleStream(root, [eval_ds], lambda t: self.encode(t, context), batch_size=batch_size,
                               columns=self.columns, shuffle=False)
        scores, labels = [], []
        for batch in stream:
            scores.append(models["model"]({k: v.to(device) for k, v in batch.items()}).cpu().numpy())
            labels.append(batch["click"].numpy())
        click_auc = finite(auc(np.concatenate(scores), np.concatenate(labels)))
        return {"auc": {"click": click_auc}, "mean_auc": click_auc}

    def serving(self, model: nn.Module) -> nn.Module:
        return Serving(model)  # type: ignore[arg-type]

    def example_inputs(self) -> dict[str, np.ndarray]:
        return {"dense": np.zeros((2, len(DENSE_FEATURES)), dtype=np.float32)}
