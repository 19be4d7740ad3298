"""Sharded embedding tables with TorchRec: strategy ``torchrec`` of ``training.train``.

A family declares which of its ``nn.Embedding`` tables are sparse features (``ModelFamily.sparse_features``);
:func:`to_torchrec` swaps each for a :class:`TableLookup` (a one-table ``EmbeddingBagCollection`` with the same
weights and the same call: rows in, vectors out), :func:`shard` wraps the model in ``DistributedModelParallel``
with a sharding plan (the tables model-parallel with all-to-all lookups and a sparse optimizer fused into the
backward pass; every other parameter data-parallel under DDP), and :func:`gather_full` turns the sharded model
back into the family's plain module (the serving export, loadable without any process group).

Sharding types: ``table_wise`` and ``column_wise`` come from TorchRec's planner (``EmbeddingShardingPlanner``
with a ``Topology`` of this node: world size, device, memory per rank); ``row_wise`` is built by hand with
``construct_module_sharding_plan(..., row_wise())``, because on CPU the planner does not offer it (it does on
CUDA, where it is planned too).

``padding_idx``: TorchRec tables have none. Row 0 means "absent" in a table with ``padding_idx=0``; a lookup of
row 0 is then a bag of length 0, whose (sum-pooled) vector is zero and which never receives a gradient: the same forward and
backward as ``nn.Embedding(padding_idx=0)`` with row 0 zero. The export sets row 0 to zero again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from core.failures import ConfigError

ShardingType = Literal["table_wise", "column_wise", "row_wise"]
SHARDING_TYPES: tuple[str, ...] = ("table_wise", "column_wise", "row_wise")
PLANNED: tuple[str, ...] = ("table_wise", "column_wise")  # what the planner offers on CPU; row_wise is by hand


class _LibraryInfo(logging.Filter):
    """Drops INFO and DEBUG records of fbgemm and TorchRec (fbgemm logs through the root logger itself)."""

    def filter(self, record: logging.LogRecord) -> bool:
        noisy = "fbgemm_gpu" in record.pathname or record.name.startswith("torchrec")
        return record.levelno >= logging.WARNING or not noisy


def quiet_library_logs() -> None:
    """Keep the job's log readable: fbgemm and TorchRec log a few hundred INFO lines and deprecation warnings
    per rank while they shard (a job's stderr is read by the operator and the tests; a pipe that fills stalls it)."""
    logging.getLogger("torchrec").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _LibraryInfo) for f in handler.filters):
            handler.addFilter(_LibraryInfo())
    for module in (r"torchrec\..*", r"torch\.distributed\..*", r"training\.torchrec_sharding"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
    warnings.filterwarnings("ignore", message=".*TopologyFactory.*")
    warnings.filterwarnings("ignore", message=".*dense_tensor_estimate.*")


class TableLookup(nn.Module):
    """One embedding table as a TorchRec ``EmbeddingBagCollection``, called like ``nn.Embedding``.

    ``forward(rows)``: rows of any shape (int64) → vectors of shape ``rows.shape + (dim,)``. Each row is a bag
    of one id, so the collection's sum pooling returns the row itself; with ``padded`` (the table had
    ``padding_idx=0``) row 0 is absent: a bag of none, a zero vector without gradient.
    """

    def __init__(
        self, name: str, num_embeddings: int, embedding_dim: int, device: Any = None, padded: bool = True
    ) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        self.name = name
        self.padded = padded
        self.embedding_dim = embedding_dim
        self.num_embeddings = num_embeddings
        config = EmbeddingBagConfig(
            name=name, embedding_dim=embedding_dim, num_embeddings=num_embeddings, feature_names=[name],
            pooling=PoolingType.SUM,
        )
        self.ebc = EmbeddingBagCollection(tables=[config], device=device)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        flat = rows.reshape(-1)
        if self.padded:
            present = flat != 0
            values, lengths = flat[present], present.to(torch.int32)
        else:
            values, lengths = flat, torch.ones_like(flat, dtype=torch.int32)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[self.name], values=values, lengths=lengths)
        pooled = self.ebc(kjt)[self.name]
        return pooled.reshape(*rows.shape, self.embedding_dim)


def table_config(module: nn.Module, name: str) -> Any:
    """The TorchRec ``EmbeddingBagConfig`` of the ``nn.Embedding`` named ``name`` (a dotted path) in ``module``."""
    from torchrec import EmbeddingBagConfig, PoolingType

    table = module.get_submodule(name)
    if not isinstance(table, nn.Embedding):
        raise ConfigError(f"sparse feature {name!r} is a {type(table).__name__}, not an nn.Embedding")
    if table.padding_idx not in (None, 0):
        raise ConfigError(f"sparse feature {name!r} has padding_idx={table.padding_idx}; TorchRec supports 0 only")
    return EmbeddingBagConfig(
        name=_table_name(name), embedding_dim=table.embedding_dim, num_embeddings=table.num_embeddings,
        feature_names=[_table_name(name)], pooling=PoolingType.SUM,
    )


def _table_name(path: str) -> str:
    return path.replace(".", "__")


def to_torchrec(model: nn.Module, names: tuple[str, ...] | list[str]) -> nn.Module:
    """Replace each ``nn.Embedding`` named in ``names`` by a :class:`TableLookup` with its weights (in place)."""
    if not names:
        raise ConfigError(
            "strategy torchrec: the model family declares no sparse_features (its nn.Embedding tables to shard)"
        )
    for name in names:
        config = table_config(model, name)
        table = model.get_submodule(name)
        padded = bool(table.padding_idx == 0)
        lookup = TableLookup(config.name, config.num_embeddings, config.embedding_dim, padded=padded)
        with torch.no_grad():
            lookup.ebc.embedding_bags[config.name].weight.copy_(table.weight)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, lookup)
    return model


def lookup_key_map(names: tuple[str, ...] | list[str]) -> dict[str, str]:
    """State-dict key of each table in the TorchRec model → its key in the family's plain model."""
    return {f"{name}.ebc.embedding_bags.{_table_name(name)}.weight": f"{name}.weight" for name in names}


# --- plans --------------------------------------------------------------------------------------------
def sharders() -> list[Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [EmbeddingBagCollectionSharder()]


def lookups(model: nn.Module) -> dict[str, TableLookup]:
    return {name: m for name, m in model.named_modules() if isinstance(m, TableLookup)}


def build_plan(
    model: nn.Module,
    sharding: str,
    *,
    world_size: int,
    device_type: str,
    memory_per_rank: int | None = None,
    process_group: Any = None,
) -> Any:
    """The ``ShardingPlan`` that shards every :class:`TableLookup` of ``model`` ``sharding``-wise.

    ``table_wise`` / ``column_wise`` (and every type on CUDA): TorchRec's planner, with a ``Topology`` of
    ``world_size`` ranks of ``device_type`` and ``memory_per_rank`` bytes (``hbm_cap`` on CUDA, ``ddr_cap`` on
    CPU; None: TorchRec's default); a plan that does not fit raises ConfigError naming the tables and budget.
    ``row_wise`` on CPU: by hand (``construct_module_sharding_plan``), checked against ``memory_per_rank``.
    With ``process_group``, rank 0 plans and every rank gets its plan (``collective_plan``).
    """
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    if sharding not in SHARDING_TYPES:
        raise ConfigError(f"sharding {sharding!r} is not one of {', '.join(SHARDING_TYPES)}")
    tables = lookups(model)
    # Ranks per node (torchrun's LOCAL_WORLD_SIZE): the planner prices intra- against inter-node all-to-alls.
    local = min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if sharding == "row_wise" and device_type == "cpu":
        bytes_per_rank = sum(rows_bytes(t.num_embeddings, t.embedding_dim) for t in tables.values()) / world_size
        if memory_per_rank is not None and bytes_per_rank > memory_per_rank:
            raise ConfigError(
                f"row_wise: the tables' shards need {bytes_per_rank / 2**20:.0f} MiB per rank (weights and optimizer "
                f"state) over {world_size} ranks, more than the budget of {memory_per_rank / 2**20:.0f} MiB"
            )
        plan = {
            path: construct_module_sharding_plan(
                t.ebc, {t.name: row_wise()}, local_size=local, world_size=world_size, device_type=device_type
            )
            for path, t in tables.items()
        }
        return ShardingPlan({f"{path}.ebc": p for path, p in plan.items()})
    caps: dict[str, Any] = {}
    if memory_per_rank is not None:
        caps = {"hbm_cap": memory_per_rank} if device_type == "cuda" else {"ddr_cap": memory_per_rank}
    topology = Topology(world_size=world_size, compute_device=device_type, local_world_size=local, **caps)
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding]) for t in tables.values()}
    # The budget is for the tables and their optimizer state alone (the dense part is DDP's, outside it); without
    # a budget the planner's default reservation for dense tensors and batches stays.
    reservation = FixedPercentageStorageReservation(0.0) if memory_per_rank is not None else None
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, storage_reservation=reservation)
    try:
        if process_group is not None:
            return planner.collective_plan(model, sharders(), process_group)
        return planner.plan(model, sharders())
    except PlannerError as e:
        sizes = ", ".join(f"{t.name} {t.num_embeddings}x{t.embedding_dim}" for t in tables.values())
        budget = f"{memory_per_rank / 2**20:.0f} MiB" if memory_per_rank else "the default"
        raise ConfigError(
            f"TorchRec's planner found no {sharding} plan for the tables ({sizes}) on {world_size} {device_type} "
            f"rank(s) with {budget} per rank: use row_wise (or more ranks). Planner: {str(e).splitlines()[0]}"
        ) from e


def rows_bytes(rows: int, dim: int) -> int:
    """Bytes of a float32 table of ``rows`` x ``dim`` and its row-wise Adagrad state (one float per row)."""
    return rows * (dim + 1) * 4


# --- wrapping and the optimizer ----------------------------------------------------------------------
def shard(
    model: nn.Module,
    *,
    sharding: str,
    device: torch.device,
    lr: float,
    weight_decay: float,
    memory_per_rank: int | None = None,
) -> Any:
    """Wrap a model with TableLookups in ``DistributedModelParallel`` (collective: every rank, same model).

    The tables get a fused row-wise Adagrad (``apply_optimizer_in_backward``: each looked-up row is updated
    during the backward pass, nothing dense is all-reduced for them; fbgemm's CPU kernels offer SGD, Adagrad
    and row-wise Adagrad, not Adam); their initial weights are the model's (every rank
    built it from the same seed), loaded shard by shard. The rest is wrapped in DDP by DMP.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    quiet_library_logs()
    # The unsharded weights (DMP leaves these tensors as they are). Tables built on the meta device have none:
    # TorchRec initialises each rank's shard itself (the table config's init_fn), the full table never exists.
    full = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    tables = lookups(model)
    unsharded = [p for t in tables.values() for p in t.ebc.parameters() if not p.is_meta]
    for t in tables.values():
        apply_optimizer_in_backward(
            RowWiseAdagrad, t.ebc.parameters(), {"lr": lr, "weight_decay": weight_decay, "eps": 1e-8}
        )
    pg = dist.group.WORLD
    plan = build_plan(
        model, sharding, world_size=dist.get_world_size(), device_type=device.type, memory_per_rank=memory_per_rank,
        process_group=pg,
    )
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=device, plan=plan, sharders=sharders()
    )
    # The sharded tables start from the model's weights (DMP leaves CPU tables as they are).
    dmp.load_state_dict(full, strict=len(full) == len(model.state_dict()))
    del full
    # TorchRec keeps references to the unsharded tables (its sharding infos, the in-backward optimizer's hook):
    # free their storage, or every rank would hold each whole table next to its shard for the whole run.
    for param in unsharded:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return dmp


@dataclasses.dataclass
class TorchRecOptimizer:
    """The optimizers of a DMP model: the fused sparse one (already stepped in backward) and AdamW for the rest.

    ``optimizer`` (a TorchRec ``CombinedOptimizer``, a ``torch.optim.Optimizer``) is what the LR scheduler drives:
    its param groups are the sparse and the dense ones, so the schedule sets both learning rates.
    """

    dense: torch.optim.Optimizer
    dense_params: list[nn.Parameter]
    optimizer: Any


def make_optimizer(dmp: Any, *, lr: float, weight_decay: float) -> TorchRecOptimizer:
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    named = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense = KeyedOptimizerWrapper(named, lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay))
    combined = CombinedOptimizer([("sparse", dmp.fused_optimizer), ("dense", dense)])
    return TorchRecOptimizer(dense=dense, dense_params=list(named.values()), optimizer=combined)


def init_optimizer_state(optimizer: Any) -> None:
    """Create the lazily made state of every optimizer parameter (a step with zero gradients and lr 0), so that
    a checkpoint can be loaded into it in place. Leaves the parameters unchanged."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None and optimizer.state.get(p) is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr


# --- state and export ---------------------------------------------------------------------------------
def is_torchrec(module: Any) -> bool:
    return type(module).__name__ == "DistributedModelParallel"


def model_state(dmp: Any) -> dict[str, Any]:
    """The model's state for DCP: sharded tables as ShardedTensors (each rank its shards), the rest replicated."""
    return dict(dmp.state_dict())


def optimizer_state(opt: TorchRecOptimizer) -> dict[str, Any]:
    """The fused sparse optimizer's state (sharded like the tables) and the dense AdamW's, keyed by FQN."""
    return dict(opt.optimizer.state_dict())


def gather_full(dmp: Any, names: tuple[str, ...] | list[str], build: Any) -> nn.Module | None:
    """The family's plain model (``build()``) with every table gathered in full, on rank 0; None elsewhere.

    A collective: every rank calls it. Row 0 of each padded table (absent) is zero, as ``padding_idx=0`` keeps it.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    keys = lookup_key_map(names)
    padded = {m.name: m.padded for m in dmp.modules() if isinstance(m, TableLookup)}
    rank = dist.get_rank()
    full: dict[str, torch.Tensor] = {}
    for key, value in dmp.state_dict().items():
        if isinstance(value, ShardedTensor):
            out = torch.empty(value.size(), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=out)
            tensor = out
        elif isinstance(value, DTensor):
            tensor = value.full_tensor().cpu()
        else:
            tensor = value.detach().cpu()
        if rank == 0 and tensor is not None:
            full[keys.get(key, key)] = tensor
    if rank != 0:
        return None
    plain = build()
    for name in names:
        if padded.get(_table_name(name), True):
            full[f"{name}.weight"][0].zero_()
    plain.load_state_dict(full)
    return plain
