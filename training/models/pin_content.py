"""The ``pin_content`` model family: content understanding of a pin — is it safe, what is it about.

Trains on ``raw/pin_labels`` (the daily human review of a sample of pins: a policy label and a topic), joined
with each pin's content in the ``raw/pins`` snapshot: a 64-d image embedding, a bag of text tokens and the
category. A small encoder maps the content to a content embedding (usable for retrieval); a safety head
(``p_unsafe``) and a topic head (a distribution over ``TOPICS``) read it. Evaluated on the review day after
the training days: AUC and PR-AUC of safety, accuracy, macro F1 and macro one-vs-rest AUC of topic, next to
the synthetic world's oracle (``truth_pins``) when it exists. Scores the whole corpus: ``p_unsafe``, the topic
distribution and its argmax, and the content embedding of every pin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from core import storage
from core.contracts import IMAGE_DIM, RAW_PIN_LABELS, RAW_PINS, TEXT_VOCAB, TOPICS, TRUTH_PINS
from core.failures import ConfigError, DataError
from core.storage import Location
from training.data import ExampleStream, fixed_width, snapshot
from training.evaluate import auc, average_precision, finite, macro_f1, macro_ovr_auc, oracle_ratio
from training.sdk import ModelFamily

LABEL_COLUMNS: tuple[str, ...] = ("review_id", "pin_id", "is_unsafe", "topic")
SERVING_INPUTS: tuple[str, ...] = ("image", "tokens", "token_mask", "category")


@dataclass(frozen=True)
class ContentParams:
    """The content model's hyperparameters (RUN.json ``params``; ``families.pin_content.params``)."""

    width: int = 64  # hidden width of the encoder
    embedding_dim: int = 32  # the content embedding
    max_tokens: int = 16  # text tokens read per pin (the first ones)
    category_buckets: int = 257
    dropout: float = 0.0
    safety_weight: float = 1.0  # weight of the safety head's BCE in the loss
    topic_weight: float = 1.0  # weight of the topic head's cross-entropy
    image_dim: int | None = None  # width of the image embedding: None reads it from the pin snapshot

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)} must be positive" for name in (
            "width", "embedding_dim", "max_tokens", "category_buckets") if getattr(self, name) <= 0]
        problems += [f"{name}={getattr(self, name)} must not be negative" for name in (
            "dropout", "safety_weight", "topic_weight") if getattr(self, name) < 0]
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if problems:
            raise ConfigError("pin_content params are invalid: " + "; ".join(problems))


class ContentEncoder(nn.Module):
    """Image embedding + mean of token embeddings + category → MLP → content embedding → safety and topic."""

    def __init__(self, params: ContentParams) -> None:
        super().__init__()
        w = params.width
        self.params = params
        self.image = nn.Linear(params.image_dim or IMAGE_DIM, w)
        self.tokens = nn.Embedding(TEXT_VOCAB, w)
        self.category = nn.Embedding(params.category_buckets, w)
        self.mlp = nn.Sequential(nn.ReLU(), nn.Dropout(params.dropout), nn.Linear(3 * w, w), nn.ReLU(),
                                 nn.Linear(w, params.embedding_dim))
        self.safety = nn.Linear(params.embedding_dim, 1)
        self.topic = nn.Linear(params.embedding_dim, TOPICS)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = batch["token_mask"].float().unsqueeze(-1)
        tokens = (self.tokens(batch["tokens"]) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        category = self.category(torch.remainder(batch["category"], self.params.category_buckets))
        embedding = self.mlp(torch.cat([self.image(batch["image"].float()), tokens, category], dim=1))
        return {"safety": self.safety(embedding).squeeze(-1), "topic": self.topic(embedding), "embedding": embedding}


class ContentServing(nn.Module):
    """The exported form: ``image, tokens, token_mask, category`` → ``p_unsafe``, ``topic_probs``, ``embedding``."""

    def __init__(self, encoder: ContentEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(
        self, image: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor, category: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        out = self.encoder({"image": image, "tokens": tokens, "token_mask": token_mask, "category": category})
        return {
            "p_unsafe": torch.sigmoid(out["safety"]),
            "topic_probs": torch.softmax(out["topic"], dim=1),
            "embedding": F.normalize(out["embedding"], dim=1),
        }


class PinContent:
    """The content of every pin of one ``raw/pins`` snapshot, looked up by pin id (vectorised, sorted ids)."""

    def __init__(self, table: pa.Table, max_tokens: int, ds: str | None = None) -> None:
        order = np.argsort(table.column("pin_id").to_numpy(), kind="stable")
        table = table.take(pa.array(order))
        self.ds = ds
        self.pin_ids = table.column("pin_id").to_numpy()
        inputs = content_inputs(table, max_tokens)
        self.image, self.tokens, self.token_mask = inputs["image"], inputs["tokens"], inputs["token_mask"]
        self.category = inputs["category"]

    @classmethod
    def from_snapshot(cls, root: Location, ds: str, max_tokens: int) -> PinContent:
        """The pin snapshot as of ``ds`` (a full one and any increments after it)."""
        table, day = snapshot(root, RAW_PINS, ds, "pin_id", ["image_embedding", "text_tokens", "category"])
        return cls(table, max_tokens, day)

    def rows(self, pin_ids: np.ndarray) -> np.ndarray:
        pos = np.minimum(np.searchsorted(self.pin_ids, pin_ids), max(len(self.pin_ids) - 1, 0))
        found = self.pin_ids[pos] == pin_ids if len(self.pin_ids) else np.zeros(len(pin_ids), dtype=bool)
        if not found.all():
            missing = pin_ids[~found][:5].tolist()
            raise DataError(f"reviewed pins {missing} are not in the {RAW_PINS} snapshot ds={self.ds}")
        return pos


def content_inputs(pins: pa.Table, max_tokens: int) -> dict[str, np.ndarray]:
    """The serving inputs of rows of the ``raw/pins`` schema (image, first tokens with their mask, category)."""
    image = fixed_width(pins.column("image_embedding"), f"{RAW_PINS}.image_embedding")
    lists = pins.column("text_tokens").combine_chunks()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    flat = lists.values.to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = np.minimum(np.diff(offsets), max_tokens)
    pos = np.arange(max_tokens)
    mask = pos[None, :] < lengths[:, None]
    tokens = np.where(mask, flat[np.where(mask, offsets[:-1, None] + pos[None, :], 0)] if flat.size else 0, 0)
    return {
        "image": image.astype(np.float32),
        "tokens": np.clip(tokens, 0, TEXT_VOCAB - 1).astype(np.int64),
        "token_mask": mask,
        "category": pins.column("category").to_numpy().astype(np.int64),
    }


class PinContentFamily(ModelFamily):
    """Content understanding: P(policy violation), the topic, and a content embedding of a pin."""

    name = "pin_content"
    metrics = ("mean_auc", "train_loss", "examples", "auc_safety", "auc_topic", "pr_auc_safety", "topic_accuracy",
               "topic_macro_f1", "positive_rate_safety", "oracle_auc_safety", "oracle_auc_topic", "oracle_pr_auc_safety",
               "oracle_topic_accuracy", "oracle_ratio_safety", "oracle_ratio_topic")
    Params = ContentParams
    dataset = RAW_PIN_LABELS
    columns = LABEL_COLUMNS
    serving_inputs = SERVING_INPUTS
    outputs = ("p_unsafe", "topic_probs", "embedding")
    params: ContentParams

    @property
    def corpus_schema(self) -> pa.Schema:  # type: ignore[override]
        return pa.schema([
            pa.field("pin_id", pa.int64(), nullable=False),
            pa.field("p_unsafe", pa.float32(), nullable=False),
            pa.field("topic", pa.int32(), nullable=False),
            pa.field("topic_probs", pa.list_(pa.float32(), TOPICS), nullable=False),
            pa.field("embedding", pa.list_(pa.float32(), self.params.embedding_dim), nullable=False),
        ])

    # --- data -----------------------------------------------------------------------------------
    def prepare(self, root: Location, train_days: list[str], eval_ds: str) -> PinContent:
        """The pin snapshot as of the evaluation day: a pin's content does not change, so the labels of every
        training day find their pins in it (and no label of a later day is read). The model takes the width
        of its image embeddings."""
        content = PinContent.from_snapshot(root, eval_ds, self.params.max_tokens)
        width = int(content.image.shape[1])
        if self.params.image_dim is None:
            self.params = replace(self.params, image_dim=width)
        elif self.params.image_dim != width:
            raise DataError(f"{RAW_PINS} image embeddings are {width}-d, the model's params say {self.params.image_dim}")
        return content

    def encode(self, table: pa.Table, context: PinContent) -> dict[str, torch.Tensor]:
        rows = context.rows(table.column("pin_id").to_numpy())
        arrays = {
            "image": context.image[rows],
            "tokens": context.tokens[rows],
            "token_mask": context.token_mask[rows],
            "category": context.category[rows],
            "is_unsafe": table.column("is_unsafe").to_numpy().astype(np.float32),
            "topic": table.column("topic").to_numpy().astype(np.int64),
            "pin_id": table.column("pin_id").to_numpy().astype(np.int64),
            "row_id": table.column("review_id").to_numpy().astype(np.int64),
        }
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}

    # --- model ----------------------------------------------------------------------------------
    def build_model(self, variant: str = "model") -> nn.Module:
        return ContentEncoder(self.params)

    def sparse_features(self, variant: str = "model") -> tuple[str, ...]:
        """The text-token and category tables (no padding row: every id is a row), for strategy torchrec."""
        return ("tokens", "category")

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        heads = {
            "safety": F.binary_cross_entropy_with_logits(outputs["safety"].float(), batch["is_unsafe"].float()),
            "topic": F.cross_entropy(outputs["topic"].float(), batch["topic"]),
        }
        total = self.params.safety_weight * heads["safety"] + self.params.topic_weight * heads["topic"]
        return total, heads

    # --- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(
        self,
        models: dict[str, nn.Module],
        root: Location,
        eval_ds: str,
        context: Any,
        *,
        device: Any,
        batch_size: int,
        on_batch: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        model = models["model"]
        was_training = model.training
        model.eval()
        stream = ExampleStream(root, [eval_ds], lambda t: self.encode(t, context), batch_size=batch_size,
                               dataset=self.dataset, columns=self.columns, shuffle=False)
        p_unsafe, topic_probs, unsafe, topic, pins = [], [], [], [], []
        try:
            for i, batch in enumerate(stream):
                out = model({k: v.to(device) for k, v in batch.items()})
                p_unsafe.append(torch.sigmoid(out["safety"].float()).cpu().numpy())
                topic_probs.append(torch.softmax(out["topic"].float(), dim=1).cpu().numpy())
                unsafe.append(batch["is_unsafe"].numpy())
                topic.append(batch["topic"].numpy())
                pins.append(batch["pin_id"].numpy())
                if on_batch is not None:
                    on_batch(i)
        finally:
            model.train(was_training)
        scores = _report(np.concatenate(p_unsafe), np.concatenate(topic_probs), np.concatenate(unsafe),
                         np.concatenate(topic))
        truth = _truth(root, eval_ds, np.concatenate(pins))
        if truth is not None:
            oracle = _report(*truth, np.concatenate(unsafe), np.concatenate(topic))
            scores["oracle_auc"] = oracle["auc"]
            scores["oracle_pr_auc"] = oracle["pr_auc"]
            scores["oracle_topic_accuracy"] = oracle["topic_accuracy"]
            scores["oracle_ratio"] = {
                head: r for head in ("safety", "topic")
                if (r := oracle_ratio(scores["auc"][head], oracle["auc"][head])) is not None
            }
        aucs = [v for v in scores["auc"].values() if v is not None]
        scores["mean_auc"] = sum(aucs) / len(aucs) if aucs else None
        return scores

    # --- serving --------------------------------------------------------------------------------
    def serving(self, model: nn.Module) -> nn.Module:
        return ContentServing(model)  # type: ignore[arg-type]

    def example_inputs(self) -> dict[str, np.ndarray]:
        rows, n = 2, self.params.max_tokens
        mask = np.zeros((rows, n), dtype=bool)
        mask[1:, :3] = True
        return {
            "image": np.zeros((rows, self.params.image_dim or IMAGE_DIM), dtype=np.float32),
            "tokens": np.where(mask, 1, 0).astype(np.int64),
            "token_mask": mask,
            "category": np.ones(rows, dtype=np.int64),
        }

    def feature_spec(self, root: Location, train_days: list[str], eval_ds: str, context: Any) -> dict[str, Any]:
        return {"max_tokens": self.params.max_tokens, "topics": TOPICS, "image_dim": self.params.image_dim,
                "pins_snapshot_ds": context.ds, "text_vocab": TEXT_VOCAB}

    # --- corpus scoring -------------------------------------------------------------------------
    def corpus_inputs(self, pins: pa.Table, spec: dict[str, Any], root: str, ds: str) -> dict[str, np.ndarray]:
        return {**content_inputs(pins, int(spec["max_tokens"])), "pin_id": pins.column("pin_id").to_numpy()}

    def score_inputs(self, module: Any, inputs: dict[str, np.ndarray], spec: dict[str, Any]) -> pa.Table:
        with torch.no_grad():
            out = module(*(torch.from_numpy(inputs[name]) for name in spec["serving_inputs"]))
        probs = out["topic_probs"].float().numpy()
        embedding = out["embedding"].float().numpy()
        return pa.Table.from_arrays(
            [
                pa.array(inputs["pin_id"], pa.int64()),
                pa.array(out["p_unsafe"].float().numpy(), pa.float32()),
                pa.array(probs.argmax(axis=1).astype(np.int32), pa.int32()),
                pa.FixedSizeListArray.from_arrays(pa.array(probs.ravel(), pa.float32()), TOPICS),
                pa.FixedSizeListArray.from_arrays(pa.array(embedding.ravel(), pa.float32()), embedding.shape[1]),
            ],
            schema=self.corpus_schema,
        )


def _report(p_unsafe: np.ndarray, topic_probs: np.ndarray, unsafe: np.ndarray, topic: np.ndarray) -> dict[str, Any]:
    predicted = topic_probs.argmax(axis=1)
    return {
        "auc": {"safety": finite(auc(p_unsafe, unsafe)), "topic": finite(macro_ovr_auc(topic_probs, topic))},
        "pr_auc": {"safety": finite(average_precision(p_unsafe, unsafe))},
        "topic_accuracy": finite(float((predicted == topic).mean()) if topic.size else float("nan")),
        "topic_macro_f1": finite(macro_f1(predicted, topic, TOPICS)),
        "positive_rate": {"safety": finite(float(unsafe.mean()) if unsafe.size else float("nan"))},
        "examples": int(topic.size),
    }


def _truth(root: Location, ds: str, pin_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The oracle's p_unsafe and topic distribution of each reviewed pin, from ``truth_pins`` (None without it)."""
    if not storage.is_complete(root, TRUTH_PINS, ds):
        return None
    table = storage.read_table(root, TRUTH_PINS, ds)
    ids = table.column("pin_id").to_numpy()
    order = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[order], pin_ids)
    if pos.size and (pos.max() >= len(ids) or not (ids[order][pos] == pin_ids).all()):
        return None  # a reviewed pin without truth: no oracle rather than a wrong one
    rows = order[pos]
    probs = table.column("topic_probs").combine_chunks().flatten().to_numpy().reshape(-1, TOPICS)
    return table.column("p_unsafe").to_numpy()[rows], probs[rows]
