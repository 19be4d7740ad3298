"""What one node of a job gets, from a named instance type (as torchx's named resources).

``instance_types:`` in the platform configuration maps a name (``p5.48xlarge``) to the node's GPUs, vCPUs,
nominal memory and EFA interfaces. A job names its type (``JobSpec.instance_type``, the operator's
``instance_type``), or takes its team's (``teams.<team>.instance_type``), or ``training.instance_type``.
From the type, pure functions derive:

- limits: every vCPU and GPU of the node; memory = nominal x ``resources.memory_tax`` (0.96, torchx's
  ``MEM_TAX``: the OS, the ECS agent or the kubelet keep the rest; a Batch job asking for the nominal memory
  stays RUNNABLE forever);
- Kubernetes requests slightly below the limits (x ``resources.request_fraction``), so a whole-node pod
  still fits beside the node's DaemonSets and kube-reserved;
- ``/dev/shm`` inside the memory limit: ``min(resources.shm_max_gib, shm_fraction x limit)`` (48 GiB on a p5
  as AWS's Batch reference; a memory-backed ``emptyDir`` is charged to the container's memory);
- EFA: the interfaces (Batch devices ``/dev/infiniband/uverbsN``, pod resource ``vpc.amazonaws.com/efa``),
  hugepages for a pod, and the libfabric / NCCL environment of AWS's references.

A job may ask for less than a whole node (``cpus_per_node``, ``memory_gb_per_node``, ``gpus_per_node``); more
than the type has is an error that names the setting.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.config import ImagesConfig, InstanceTypeConfig, ResourcesConfig, TeamConfig, TrainingConfig
from core.failures import ConfigError

if TYPE_CHECKING:
    from core.config import PlatformConfig
    from operators.backends.base import JobSpec

K8S_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Catalog:
    """The instance types and the rules that turn one into a node's requests and limits."""

    instance_types: Mapping[str, InstanceTypeConfig]
    images: ImagesConfig = ImagesConfig()
    resources: ResourcesConfig = ResourcesConfig()
    default_instance_type: str = TrainingConfig().instance_type
    image: str = ""  # training.image: when set, every job's image

    @classmethod
    def from_config(cls, cfg: PlatformConfig) -> Catalog:
        return cls(
            instance_types=dict(cfg.instance_types), images=cfg.images, resources=cfg.resources,
            default_instance_type=cfg.training.instance_type, image=cfg.training.image,
        )

    @classmethod
    def default(cls) -> Catalog:
        from core.config import PlatformConfig

        return cls.from_config(PlatformConfig())


@dataclass(frozen=True)
class NodeResources:
    """Requests and limits of one node (a Batch node container or a pod) of a job."""

    instance_type: str
    image: str
    gpus: int
    cpu_limit: int  # vCPUs
    cpu_request_milli: int  # Kubernetes request, below the limit
    memory_limit_mib: int
    memory_request_mib: int  # Kubernetes request, below the limit
    shm_mib: int
    efa: int
    efa_rdma: bool
    hugepages_2mi_mib: int  # a pod with EFA; 0 otherwise
    whole_node: bool  # the job takes every vCPU of the node




def local_gpus() -> int:
    """GPUs a local job sees on this machine: CUDA_VISIBLE_DEVICES's if set, else the NVIDIA devices present (no
    torch import: the scheduler's and the triggerer's processes call this)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()]) if os.path.isdir("/dev") else 0


def instance_type_of(spec: JobSpec, teams: Mapping[str, TeamConfig], catalog: Catalog) -> str:
    """The job's instance type: its own, else its team's, else ``training.instance_type``."""
    team = teams.get(spec.team)
    name = spec.instance_type or (team.instance_type if team else "") or catalog.default_instance_type
    if name not in catalog.instance_types:
        raise ConfigError(
            f"job spec {spec.name!r}: instance type {name!r} is not under instance_types: in config/platform.yaml "
            f"(known: {', '.join(sorted(catalog.instance_types))}); set the operator's instance_type or add the type"
        )
    return name


def node_resources(spec: JobSpec, teams: Mapping[str, TeamConfig], catalog: Catalog) -> NodeResources:
    """The node's requests and limits for ``spec`` on its instance type (pure)."""
    name = instance_type_of(spec, teams, catalog)
    itype = catalog.instance_types[name]
    rules = catalog.resources
    capacity_mib = int(itype.memory_gib * 1024 * rules.memory_tax)
    problems = []
    gpus = itype.gpus if spec.gpus_per_node is None else spec.gpus_per_node
    if gpus > itype.gpus:
        problems.append(f"gpus_per_node={gpus}, but a {name} node has {itype.gpus} (training.gpus_per_node)")
    cpus = itype.vcpus if spec.cpus_per_node is None else spec.cpus_per_node
    if cpus > itype.vcpus:
        problems.append(f"cpus_per_node={cpus}, but a {name} node has {itype.vcpus} vCPUs")
    memory_mib = capacity_mib if spec.memory_gb_per_node is None else int(spec.memory_gb_per_node * 1024)
    if memory_mib > capacity_mib:
        problems.append(
            f"memory_gb_per_node={spec.memory_gb_per_node}, but a {name} node can give a container at most "
            f"{capacity_mib / 1024:.0f} GiB ({itype.memory_gib:g} GiB x resources.memory_tax {rules.memory_tax})"
        )
    if problems:
        raise ConfigError(f"job spec {spec.name!r} does not fit its instance type: " + "; ".join(problems))
    image = spec.image or catalog.image or itype.image or (catalog.images.gpu if itype.gpus else catalog.images.cpu)
    return NodeResources(
        instance_type=name,
        image=image,
        gpus=gpus,
        cpu_limit=cpus,
        cpu_request_milli=int(cpus * 1000 * rules.request_fraction),
        memory_limit_mib=memory_mib,
        memory_request_mib=int(memory_mib * rules.request_fraction),
        shm_mib=int(min(rules.shm_max_gib * 1024, memory_mib * rules.shm_fraction)),
        efa=itype.efa,
        efa_rdma=itype.efa_rdma,
        hugepages_2mi_mib=rules.hugepages_2mi_mib if itype.efa else 0,
        whole_node=cpus == itype.vcpus,
    )


def resolve(spec: JobSpec, teams: Mapping[str, TeamConfig], catalog: Catalog) -> tuple[JobSpec, NodeResources]:
    """``spec`` with its instance type, image and per-node resources filled in, checked; and the node's resources."""
    res = node_resources(spec, teams, catalog)
    resolved = dataclasses.replace(
        spec, instance_type=res.instance_type, image=res.image, gpus_per_node=res.gpus, cpus_per_node=res.cpu_limit,
        memory_gb_per_node=res.memory_limit_mib / 1024,
    )
    resolved.validate()
    return resolved, res


def efa_environment(res: NodeResources, socket_ifname: str) -> dict[str, str]:
    """libfabric and NCCL variables for EFA, as AWS's Batch and EKS references set them.

    ``NCCL_PROTO`` is not forced: current aws-ofi-nccl plugins choose the protocol themselves. Without EFA, only
    the interfaces NCCL's bootstrap may use.
    """
    env = {"NCCL_SOCKET_IFNAME": socket_ifname}
    if res.efa:
        env.update({"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"})
        if res.efa_rdma:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def mib_quantity(mib: int) -> str:
    """A Kubernetes quantity for ``mib`` MiB (``2013265Mi``; whole GiB as ``Gi``)."""
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def milli_quantity(milli: int) -> str:
    """A Kubernetes CPU quantity (``182400m``; whole cores as a number)."""
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def input_workers(cpus: int, procs: int, gpus: int, num_workers: int | None = None, num_threads: int | None = None,
                  *, where: str = "") -> tuple[int, int]:
    """Input worker processes (``num_workers``) and torch threads (``num_threads``) per training process on a node
    of ``cpus`` CPUs running ``procs`` processes; a value given is kept, a missing one derived.

    On a GPU node the model runs on the GPU and a process's CPUs feed it: 2 trainer threads, the rest but one (the
    process's own loop and its pinned-memory thread) input workers, at most 16. On a CPU node the model runs on the
    same CPUs: a quarter of a process's CPUs read, the rest compute (one CPU each: no input worker). More input
    workers than the node's CPUs is a USER error naming the setting.
    """
    per = max(1, cpus // max(1, procs))
    if gpus:
        threads = num_threads or (2 if per >= 4 else 1)
        workers = num_workers if num_workers is not None else max(0, min(16, per - threads - 1))
    else:
        workers = num_workers if num_workers is not None else per // 4
        threads = num_threads or max(1, per - workers)
    if procs * workers > cpus:
        raise ConfigError(
            f"num_workers={workers} x {procs} training process(es) per node is {procs * workers} input workers on a "
            f"node of {cpus} CPUs{f' ({where})' if where else ''}: give at most {cpus // max(1, procs)} "
            "(training.num_workers or the form's num_workers), or fewer processes per node"
        )
    return workers, threads
