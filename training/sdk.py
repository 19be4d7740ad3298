"""The model SDK: what a team owns in one file, and the small interface the platform drives.

A **model family** is one Python module (or package) with a :class:`ModelFamily` subclass and a section in the platform
configuration (``families:``). The family declares

- ``Params``: a frozen dataclass of its hyperparameters, with defaults (RUN.json's ``params`` overrides them;
  an unknown key or a wrong type is a USER error naming it);
- its input: ``dataset`` (the partitioned dataset whose rows are its training examples, e.g. ``examples`` or
  ``raw/pin_labels``) and ``columns`` (what it reads of them); ``prepare`` reads what it joins them with
  (e.g. the pin snapshot) once per process; ``encode`` turns a table of rows into a batch of tensors with
  a ``labels`` entry (optionally ``encode_into``: the same, each tensor written where the platform says);
- its model: ``build_model(variant)`` (``variants()`` lists models trained in lockstep on the same batches,
  e.g. an ablation), its heads and ``loss``;
- ``evaluate``: its metrics on the evaluation day; ``mean_auc`` is the one the promotion gate compares;
- its serving signature: ``serving(model)`` (positional tensors in ``serving_inputs`` order → named outputs),
  ``example_inputs()`` and ``feature_spec``;
- optionally ``score_corpus``: how it scores a slice of the pin corpus (``corpus_schema`` the columns), best
  as its two halves ``corpus_inputs`` (rows → input arrays, CPU only) and ``score_inputs`` (the forward pass
  → rows), which corpus inference can run on different workers (Ray Data: readers and an actor pool).

Optionally it declares ``sparse_features``: its embedding tables that strategy ``torchrec`` shards (TorchRec
``EmbeddingBagConfig`` s, see :func:`embedding_configs`).

The platform supplies everything else, the same for every family: the input pipeline with exact resume
(``training.data.ExampleStream``), DDP, TorchRec sharding (FSDP2 as a fallback), checkpoints, preflight,
heartbeats, MLflow logging and
registration (one registered model per family), the promotion gate, the backends and corpus inference.
``docs/training.md`` ("Add a model family") walks through writing one.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from core.failures import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import torch
    from torch import nn

    from core.storage import Location
    from training.data import Alloc



class ModelFamily:
    """Base class of a model family (see the module docstring). Subclasses set the class attributes."""

    name: ClassVar[str]
    Params: ClassVar[type]  # a frozen dataclass of hyperparameters with defaults
    dataset: ClassVar[str]  # the partitioned dataset of training rows
    columns: ClassVar[tuple[str, ...]]  # the columns of it that encode() reads
    serving_inputs: ClassVar[tuple[str, ...]]
    outputs: ClassVar[tuple[str, ...]]
    corpus_schema: ClassVar[pa.Schema | None] = None  # set by a family that scores the corpus
    # The sparse feature a corpus item looks up by its own id (the ranker's pin table): a sharded model's corpus
    # plan gives each scorer the items of a range of its rows (``corpus_rows``), so it reads only those rows.
    corpus_table: ClassVar[str] = ""
    # The flat names of what evaluate() reports (``auc_click`` for ``{"auc": {"click": ...}}``); optional: where a
    # family declares them, a search's metric is checked against them before any trial trains.
    metrics: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: Any) -> None:
        self.params = params

    # --- data -----------------------------------------------------------------------------------
    def prepare(self, root: Location, train_days: list[str], eval_ds: str) -> Any:
        """What ``encode`` needs besides the rows (read once per process, e.g. a snapshot); None by default."""
        return None

    def encode(self, table: pa.Table, context: Any) -> dict[str, torch.Tensor]:
        """Rows of ``dataset`` → the model's input tensors, with ``labels`` (and ``row_id``, a row's key).

        Row-wise: a row's tensors depend on that row only (the input engines encode a batch in pieces, and a
        batch encoded in pieces and joined must equal the batch encoded whole). Runs in the input workers (local
        engine) or on Ray's CPU workers (ray engine); :meth:`finish` completes the batch in the trainer."""
        raise NotImplementedError

    def encode_into(self, table: pa.Table, context: Any, alloc: Alloc) -> dict[str, torch.Tensor]:
        """:meth:`encode`, making each tensor with ``alloc(shape, dtype)`` and writing it there: an input worker's
        ``alloc`` gives views of the shared buffer its batch crosses to the trainer in, where a tensor made any
        other way is copied (about a tenth of a worker's time for the ranker). Optional: by default :meth:`encode`."""
        return self.encode(table, context)

    def finish(self, batch: dict[str, torch.Tensor], context: Any) -> dict[str, torch.Tensor]:
        """The trainer's end of ``encode``, on each batch as it arrives from the input workers, already on the
        training device, as the first part of the step: what multiplies a batch's size (a dense lookup by ids) is
        cheaper done here, on the device, than shipped between processes and copied to it. Must work on any device
        (the batch's tensors say which). Nothing by default."""
        return batch

    # --- model ----------------------------------------------------------------------------------
    def variants(self) -> tuple[str, ...]:
        """Models trained in lockstep on the same batches; ``model`` (always first) is the one registered."""
        return ("model",)

    def build_model(self, variant: str = "model") -> nn.Module:
        raise NotImplementedError

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The total loss to minimise and its parts per head (logged)."""
        raise NotImplementedError

    def sparse_features(self, variant: str = "model") -> tuple[str, ...]:
        """The sparse features of ``build_model(variant)``: names (dotted paths) of its ``nn.Embedding`` tables.

        Under strategy ``torchrec`` each becomes a TorchRec ``EmbeddingBagConfig`` (:func:`embedding_configs`:
        name, rows, width, one feature of the same name, sum pooling) sharded across the ranks, its lookups
        all-to-all, its optimizer fused into the backward pass; the model calls it as before (rows in, vectors
        out). ``padding_idx`` may be None or 0 (row 0: absent, a zero vector that never trains). The default,
        none, leaves every table to DDP; ``strategy: torchrec`` then refuses the run.
        """
        return ()

    def sparse_init_std(self, variant: str = "model") -> dict[str, float]:
        """The standard deviation each sparse feature's rows start with under strategy ``torchrec`` (default 1.0,
        ``nn.Embedding``'s own N(0, 1)).

        Under ``torchrec`` the tables are built on the meta device and each rank initialises only its own rows,
        from a hash of (seed, table, global row, column) (``training.torchrec_sharding.row_values``): the same values
        at any world size and sharding. The family's own init of those tables is not run, so a family that draws
        its tables with another scale says it here. Row 0 of a table with ``padding_idx=0`` stays zero.
        """
        return {}

    # --- evaluation -----------------------------------------------------------------------------
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
        """Metrics on ``eval_ds`` (nested dicts of floats, None where undefined); include ``mean_auc``."""
        raise NotImplementedError

    def evaluate_part(
        self, models: dict[str, nn.Module], root: Location, eval_ds: str, context: Any, *, device: Any, batch_size: int,
        rank: int, world_size: int, on_batch: Callable[[int], None] | None = None,
    ) -> Any:
        """Optional, with ``evaluate_parts``: this rank's share of what ``evaluate`` computes before its metrics
        (picklable, e.g. predictions and labels), so that a model whose tables are too large to gather is evaluated
        by every rank of the training world; ``evaluate_parts`` (rank 0) turns the ranks' parts into ``evaluate``'s
        metrics. ``models`` are the trained TorchRec-sharded models themselves (each rank holds only its shards):
        their forward is a collective, so every rank must call each model the same number of times with batches of
        the same size (``training.data.lockstep`` gives a rank's batches so)."""
        raise NotImplementedError(f"model family {self.name} does not split its evaluation")

    def evaluate_parts(self, parts: list[Any], root: Location, eval_ds: str, context: Any) -> dict[str, Any]:
        raise NotImplementedError(f"model family {self.name} does not split its evaluation")

    @property
    def splits_evaluation(self) -> bool:
        cls = type(self)
        return cls.evaluate_part is not ModelFamily.evaluate_part and cls.evaluate_parts is not ModelFamily.evaluate_parts

    # --- serving --------------------------------------------------------------------------------
    def serving(self, model: nn.Module) -> nn.Module:
        """The exported form: positional tensors in ``serving_inputs`` order → a dict of ``outputs``."""
        raise NotImplementedError

    def example_inputs(self) -> dict[str, np.ndarray]:
        """A small serving batch, one array per name of ``serving_inputs`` (the MLflow signature's example)."""
        raise NotImplementedError

    def model_from_serving(self, module: nn.Module) -> nn.Module:
        """The trainable ``model`` (what ``evaluate`` takes) holding the weights of a registered serving module: how
        the promotion gate evaluates the champion on a new model's day (``training.champion``).

        By default the serving form wraps the model as its one child (``serving`` returns ``Wrapper(model)``): the
        module's state dict, without that child's name, is loaded into ``build_model("model")``, strictly. A family
        whose serving form changes the weights overrides this.
        """
        state = module.state_dict()
        prefixes = {key.split(".", 1)[0] for key in state}
        if len(prefixes) == 1 and all("." in key for key in state):
            prefix = f"{next(iter(prefixes))}."
            state = {key.removeprefix(prefix): value for key, value in state.items()}
        model = self.build_model("model")
        model.load_state_dict(state, strict=True)
        return model

    def feature_spec(self, root: Location, train_days: list[str], eval_ds: str, context: Any) -> dict[str, Any]:
        """What a serving caller needs to build the inputs (stored with the registered model)."""
        return {}

    # --- corpus scoring -------------------------------------------------------------------------
    def score_corpus(self, module: Any, pins: pa.Table, spec: dict[str, Any], root: str, ds: str) -> pa.Table:
        """Score a slice of the ``raw/pins`` snapshot of ``ds`` with the exported ``module``: ``corpus_schema`` rows.

        By default ``score_inputs(module, corpus_inputs(...))``; a family may override it instead of the halves.
        """
        return self.score_inputs(module, self.corpus_inputs(pins, spec, root, ds), spec)

    def corpus_inputs(self, pins: pa.Table, spec: dict[str, Any], root: str, ds: str) -> dict[str, np.ndarray]:
        """The CPU half of ``score_corpus``: a slice of the snapshot → named arrays (one row per pin, ``pin_id``
        among them) holding everything ``score_inputs`` needs. No model here: it may run on another worker."""
        raise NotImplementedError(f"model family {self.name} does not split corpus scoring (corpus_inputs)")

    def score_inputs(self, module: Any, inputs: dict[str, np.ndarray], spec: dict[str, Any]) -> pa.Table:
        """The model half of ``score_corpus``: ``corpus_inputs``' arrays → ``corpus_schema`` rows, in their order."""
        raise NotImplementedError(f"model family {self.name} does not score the corpus")

    def corpus_rows(self, module: Any, pins: pa.Table) -> np.ndarray:
        """The rows of ``corpus_table`` that the serving ``module`` looks up for each of ``pins``."""
        raise NotImplementedError(f"model family {self.name} has no corpus_table")

    @property
    def splits_corpus_scoring(self) -> bool:
        """Whether the family implements ``corpus_inputs`` and ``score_inputs`` (else only ``score_corpus``)."""
        cls = type(self)
        return cls.corpus_inputs is not ModelFamily.corpus_inputs and cls.score_inputs is not ModelFamily.score_inputs


def embedding_configs(family: ModelFamily, variant: str = "model", model: nn.Module | None = None) -> list[Any]:
    """The family's ``sparse_features`` of ``variant`` as TorchRec ``EmbeddingBagConfig`` s (imports torchrec)."""
    from training.torchrec_sharding import table_config

    model = model if model is not None else family.build_model(variant)
    return [table_config(model, name) for name in family.sparse_features(variant)]


def load_family(name: str, module: str = "", params: dict[str, Any] | None = None) -> ModelFamily:
    """The family ``name`` (from ``module``, default the built-in one of that name) with ``params`` applied.

    Raises ConfigError (USER) naming what is wrong: an unknown family, a module without it, a bad param.
    """
    from core import registry

    path = module or registry.target(
        registry.FAMILIES, name, hint=" (built in, or registered by an installed package under the entry-point group "
        "pinflow.families); or give families.<name>.module in the platform configuration"
    )
    try:
        loaded = registry.load(path)  # a module, or module:Class
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model family {name!r}: cannot import {path!r}: {err}") from err
    found = [
        value for value in (vars(loaded).values() if isinstance(loaded, types.ModuleType) else [loaded])
        if isinstance(value, type) and issubclass(value, ModelFamily) and getattr(value, "name", None) == name
    ]
    if not found:
        raise ConfigError(f"module {path!r} defines no ModelFamily subclass with name = {name!r}")
    family_cls = found[0]
    return family_cls(build_params(family_cls.Params, params or {}, f"params of model family {name}"))


def build_params(params_cls: type, values: dict[str, Any], source: str) -> Any:
    """A family's ``Params`` from a JSON object: unknown keys and wrong types are ConfigErrors naming them."""
    from training.config import dataclass_from_dict

    if not dataclasses.is_dataclass(params_cls):
        raise ConfigError(f"{source}: Params must be a dataclass")
    return dataclass_from_dict(params_cls, values, source)
