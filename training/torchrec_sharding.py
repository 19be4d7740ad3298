"""Sharded embedding tables with TorchRec: strategy ``torchrec`` of ``training.train``.

A family declares which of its ``nn.Embedding`` tables are sparse features (``ModelFamily.sparse_features``);
:func:`to_torchrec` swaps each for a :class:`TableLookup` (a one-table ``EmbeddingBagCollection`` with the same
weights and the same call: rows in, vectors out), :func:`shard` wraps the model in ``DistributedModelParallel``
with a sharding plan (the tables model-parallel with all-to-all lookups and a sparse optimizer fused into the
backward pass; every other parameter data-parallel under DDP), and :func:`gather_full` turns the sharded model
back into the family's plain module (the serving export, loadable without any process group); tables too large to
gather are exported shard by shard instead (``training.sharded_export``).

Built sharded: the trainer builds the model with :func:`build_meta` (the sparse features on the meta device, the
dense part as the family builds it), so no process holds a whole table; :func:`shard` allocates each rank's shards
and fills them with :func:`row_values`, a function of (seed, table, global row, column) alone: the same values at
any world size and sharding. Checkpoints (``training.checkpoint``) save the shards and load them resharded.

Sharding types: ``table_wise`` and ``column_wise`` come from TorchRec's planner (``EmbeddingShardingPlanner``
with a ``Topology`` of this node: world size, device, memory per rank); ``row_wise`` is built by hand with
``construct_module_sharding_plan(..., row_wise())``, because on CPU the planner does not offer it (it does on
CUDA, where it is planned too).

``padding_idx``: TorchRec tables have none. Row 0 means "absent" in a table with ``padding_idx=0``; a lookup of
row 0 is then a bag of length 0, whose (sum-pooled) vector is zero and which never receives a gradient: the same forward and
backward as ``nn.Embedding(padding_idx=0)`` with row 0 zero. The export sets row 0 to zero again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
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


# --- built sharded: the tables on the meta device, each rank initialising its own rows -----------------------
@dataclasses.dataclass(frozen=True)
class RowInit:
    """How a table built on the meta device gets its values: :func:`row_values` with this seed and scale."""

    seed: int
    std: float = 1.0


_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 18  # values hashed at a time: bounds the temporaries (a few MiB) whatever the shard's size


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic): a bijective, well-mixed hash."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def table_key(seed: int, table: str) -> int:
    """The 64-bit key of ``table``'s values under ``seed`` (stable across processes, unlike ``hash``)."""
    mixed = _splitmix64(np.array([(seed * 0x100000001B3 + zlib.crc32(table.encode())) & _M64], dtype=np.uint64))
    return int(mixed[0])


def row_values(
    table: str, init: RowInit, rows: tuple[int, int], cols: tuple[int, int], dim: int, padded: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The initial values of ``table``'s global rows ``rows`` [start, stop) and columns ``cols`` (float32).

    Counter-based: value (r, c) is a function of (seed, table, r, c) alone (``dim`` is the table's full width,
    so a column-wise shard gets the columns the whole table has), so any shard of any sharding at any world size
    holds the same values for the same rows, bit for bit, and no rank needs anything but its own rows. Each value
    is the sum of four 32-bit uniforms of one 128-bit hash, centred and scaled to ``init.std`` (Irwin-Hall: close
    to normal, bounded by 3.5 std): integer arithmetic and exact float sums, so no libm and no vector width can
    change a bit. Row 0 of a ``padded`` table is zero (absent). ``out``: written in place (a contiguous float32
    CPU tensor of that shape, e.g. a rank's shard), else a new tensor."""
    (r0, r1), (c0, c1) = rows, cols
    shape = (max(r1 - r0, 0), max(c1 - c0, 0))
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"row_values: out is {out.dtype} {tuple(out.shape)} on {out.device}, not float32 {shape}")
    if out.numel() == 0:
        return out
    key = np.uint64(table_key(init.seed, table))
    width = c1 - c0
    scale = np.float64(3.0) ** 0.5 * init.std / 2.0**32
    step = max(1, _CHUNK // width)
    flat = out.numpy()
    for start in range(r0, r1, step):
        stop = min(r1, start + step)
        r = np.arange(start, stop, dtype=np.uint64)[:, None]
        c = np.arange(c0, c1, dtype=np.uint64)[None, :]
        counter = (r * np.uint64(dim) + c) * np.uint64(2) + key
        a, b = _splitmix64(counter), _splitmix64(counter + np.uint64(1))
        lo = np.uint64(0xFFFFFFFF)
        total = ((a & lo).astype(np.float64) + (a >> np.uint64(32)).astype(np.float64)
                 + (b & lo).astype(np.float64) + (b >> np.uint64(32)).astype(np.float64))
        # Each uniform is (k + 0.5) / 2^32 in (0, 1); four of them sum to (total + 2) / 2^32, mean 2, var 1/3.
        flat[start - r0:stop - r0] = ((total + 2.0 - 2.0**33) * scale).astype(np.float32)
    if padded and r0 == 0:
        out[0].zero_()
    return out


@contextlib.contextmanager
def _embeddings_on_meta(which: Callable[[int], bool], made: list[nn.Module]) -> Iterator[None]:
    """While open, the ``i``-th ``nn.Embedding`` constructed (``made`` collects them) is built on the meta device
    where ``which(i)``: no storage, no values (and no draw from the RNG: a meta tensor's init draws nothing)."""
    original = nn.Embedding.__init__

    def init(self: nn.Embedding, *args: Any, **kwargs: Any) -> None:
        ordinal = len(made)
        made.append(self)
        if which(ordinal):
            if kwargs.get("_weight") is not None:
                raise ConfigError(
                    "strategy torchrec: a sparse feature is built from given weights (nn.Embedding(_weight=...), "
                    "from_pretrained): the tables must be built empty so that each rank makes only its own rows"
                )
            kwargs["device"] = torch.device("meta")
        original(self, *args, **kwargs)

    nn.Embedding.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Embedding.__init__ = original  # type: ignore[method-assign]


def build_meta(build: Callable[[], nn.Module], names: tuple[str, ...] | list[str]) -> nn.Module:
    """``build()`` with the ``nn.Embedding`` tables named in ``names`` on the meta device, the rest as usual.

    No process ever allocates those tables: a first build puts every ``nn.Embedding`` on the meta device to learn
    which construction makes which named table (the family's code is not changed; the RNG state is put back),
    the second builds only those on the meta device. The dense part is the family's own, drawn from the RNG as
    its code draws it (the same on every rank from the same seed; the tables draw nothing from it)."""
    if not names:
        raise ConfigError(
            "strategy torchrec: the model family declares no sparse_features (its nn.Embedding tables to shard)"
        )
    rng = torch.get_rng_state()
    probed: list[nn.Module] = []
    with _embeddings_on_meta(lambda _: True, probed):
        probe = build()
    torch.set_rng_state(rng)
    ordinal = {id(m): i for i, m in enumerate(probed)}
    wanted: set[int] = set()
    for name in names:
        table = probe.get_submodule(name)
        if not isinstance(table, nn.Embedding) or id(table) not in ordinal:
            raise ConfigError(f"sparse feature {name!r} is a {type(table).__name__}, not an nn.Embedding")
        wanted.add(ordinal[id(table)])
    del probe, probed
    made: list[nn.Module] = []
    with _embeddings_on_meta(wanted.__contains__, made):
        model = build()
    meta = {name for name, p in model.named_parameters() if p.is_meta}
    expected = {f"{name}.weight" for name in names}
    if meta != expected:  # a build that does not make its modules in the same order twice
        raise ConfigError(
            f"strategy torchrec: building the sparse features on the meta device put {sorted(meta)} there, not "
            f"{sorted(expected)}: the family's build_model must construct its modules in the same order every time"
        )
    return model


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` for everything not on the meta device (the tables there are sharded, not moved)."""
    return model._apply(lambda t: t if t.is_meta else t.to(device))


class TableLookup(nn.Module):
    """One embedding table as a TorchRec ``EmbeddingBagCollection``, called like ``nn.Embedding``.

    ``forward(rows)``: rows of any shape (int64) → vectors of shape ``rows.shape + (dim,)``. Each row is a bag
    of one id, so the collection's sum pooling returns the row itself; with ``padded`` (the table had
    ``padding_idx=0``) row 0 is absent: a bag of none, a zero vector without gradient.
    """

    def __init__(
        self, name: str, num_embeddings: int, embedding_dim: int, device: Any = None, padded: bool = True,
        init: RowInit | None = None,
    ) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        self.name = name
        self.padded = padded
        self.embedding_dim = embedding_dim
        self.num_embeddings = num_embeddings
        self.init = init  # a table on the meta device: how shard() initialises each rank's rows of it
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


def to_torchrec(
    model: nn.Module, names: tuple[str, ...] | list[str], *, seed: int = 0, init_std: dict[str, float] | None = None
) -> nn.Module:
    """Replace each ``nn.Embedding`` named in ``names`` by a :class:`TableLookup` (in place).

    A table with weights keeps them; a table on the meta device (:func:`build_meta`) becomes a lookup on the
    meta device whose rows :func:`shard` initialises on each rank, its own rows only (:func:`row_values` with
    ``seed`` and the table's ``init_std``, default 1.0)."""
    if not names:
        raise ConfigError(
            "strategy torchrec: the model family declares no sparse_features (its nn.Embedding tables to shard)"
        )
    for name in names:
        config = table_config(model, name)
        table = model.get_submodule(name)
        padded = bool(table.padding_idx == 0)
        if table.weight.is_meta:
            std = (init_std or {}).get(name, 1.0)
            lookup = TableLookup(config.name, config.num_embeddings, config.embedding_dim, padded=padded,
                                 device=torch.device("meta"), init=RowInit(seed=seed, std=std))
        else:
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
    With ``process_group``, rank 0 plans and every rank gets its plan, or the same ConfigError.
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
    # Rank 0 plans and every rank gets its plan, or its error (TorchRec's collective_plan would leave the other
    # ranks waiting for a plan that never comes when rank 0's planning fails).
    outcome: list[Any] = [None]
    if process_group is None or dist.get_rank(process_group) == 0:
        try:
            outcome[0] = planner.plan(model, sharders())
        except PlannerError as e:
            outcome[0] = str(e).splitlines()[0]
    if process_group is not None:
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(process_group, 0), group=process_group)
    if isinstance(outcome[0], str):
        sizes = ", ".join(f"{t.name} {t.num_embeddings}x{t.embedding_dim}" for t in tables.values())
        budget = f"{memory_per_rank / 2**20:.0f} MiB" if memory_per_rank else "the default"
        raise ConfigError(
            f"TorchRec's planner found no {sharding} plan for the tables ({sizes}) on {world_size} {device_type} "
            f"rank(s) with {budget} per rank: use row_wise (or more ranks). Planner: {outcome[0]}"
        )
    return outcome[0]


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
    and row-wise Adagrad, not Adam). A table with weights (every rank built it from the same seed) starts from
    them, loaded shard by shard; a table on the meta device (:func:`build_meta`, strategy torchrec's build) is
    allocated by DMP only as this rank's shards, which :func:`init_local_rows` fills per global row. The rest is
    wrapped in DDP by DMP.
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
    # The sharded tables start from the model's weights (DMP leaves CPU tables as they are); those built on the
    # meta device from their rows' values, each rank its own rows.
    dmp.load_state_dict(full, strict=len(full) == len(model.state_dict()))
    del full
    init_local_rows(dmp)
    # TorchRec keeps references to the unsharded tables (its sharding infos, the in-backward optimizer's hook):
    # free their storage, or every rank would hold each whole table next to its shard for the whole run.
    for param in unsharded:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return dmp


def local_shards(value: Any) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """This rank's pieces of a (sharded) table: ((first row, first column), tensor) each, views of its storage."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return [((s.metadata.shard_offsets[0], s.metadata.shard_offsets[1]), s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = value.to_local()
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return [((int(offset[0]), int(offset[1])), local)] if local.numel() else []
    return [((0, 0), value)]


def init_local_rows(dmp: Any) -> None:
    """Give every table built on the meta device its initial values, on each rank only for the rows it holds."""
    tables = {m.name: m for m in dmp.modules() if isinstance(m, TableLookup) and m.init is not None}
    if not tables:
        return
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            _, sep, tail = key.rpartition(".ebc.embedding_bags.")
            lookup = tables.get(tail.removesuffix(".weight")) if sep and tail.endswith(".weight") else None
            if lookup is None or lookup.init is None:
                continue
            for (row, col), tensor in local_shards(value):
                rows, cols = tensor.shape
                span = (row, row + rows), (col, col + cols)
                if tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous():
                    row_values(lookup.name, lookup.init, *span, lookup.embedding_dim, lookup.padded, out=tensor)
                else:  # e.g. on CUDA: made on the CPU (one shard's size), then copied
                    tensor.copy_(row_values(lookup.name, lookup.init, *span, lookup.embedding_dim, lookup.padded))


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
