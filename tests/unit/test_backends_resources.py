"""A node's requests and limits from its named instance type (operators/backends/resources.py)."""

from __future__ import annotations

import pytest

from core.config import PlatformConfig, TeamConfig
from core.failures import ConfigError
from operators.backends import JobSpec
from operators.backends.resources import Catalog, NodeResources, efa_environment, node_resources, resolve

pytestmark = pytest.mark.unit

TEAMS = {
    "ranking": TeamConfig(queue="ranking", share="ranking", instance_type="p5.48xlarge"),
    "search": TeamConfig(queue="search", share="search"),
}
CATALOG = Catalog.from_config(PlatformConfig(teams=TEAMS))


def spec(**change) -> JobSpec:
    base = dict(name="train-x", command=["-m", "training.train"], team="ranking", distributed=True, nodes=2,
                procs_per_node=8)
    return JobSpec(**{**base, **change})


def test_a_p5_node_is_the_whole_node_less_the_memory_tax_with_requests_below_the_limits():
    assert node_resources(spec(), TEAMS, CATALOG) == NodeResources(
        instance_type="p5.48xlarge",
        image="pinflow-training:latest",
        gpus=8,
        cpu_limit=192,
        cpu_request_milli=182400,  # 0.95 x 192 cores: room for DaemonSets and kube-reserved
        memory_limit_mib=2013265,  # 2048 GiB x 0.96 (torchx's MEM_TAX): what a container can really get
        memory_request_mib=1912601,
        shm_mib=49152,  # 48 GiB, as AWS's p5 Batch reference; far inside the limit
        efa=32,
        efa_rdma=True,
        hugepages_2mi_mib=5120,
        whole_node=True,
    )


def test_the_type_is_the_jobs_then_the_teams_then_the_platform_default():
    assert node_resources(spec(), TEAMS, CATALOG).instance_type == "p5.48xlarge"  # the team's
    assert node_resources(spec(instance_type="p4d.24xlarge"), TEAMS, CATALOG).efa == 4  # the job's
    cpu = node_resources(spec(team="search", procs_per_node=1), TEAMS, CATALOG)  # training.instance_type
    assert (cpu.instance_type, cpu.gpus, cpu.efa, cpu.hugepages_2mi_mib, cpu.image) == (
        "m5.2xlarge", 0, 0, 0, "pinflow-training-cpu:latest")
    # /dev/shm stays a quarter of a small node's memory limit.
    assert cpu.shm_mib == int(cpu.memory_limit_mib * 0.25)


def test_a_partial_node_and_explicit_image_and_the_training_image_override():
    res = node_resources(spec(cpus_per_node=4, memory_gb_per_node=16, gpus_per_node=1, procs_per_node=1,
                              image="r.example.com/x:1"), TEAMS, CATALOG)
    assert (res.cpu_limit, res.memory_limit_mib, res.gpus, res.whole_node, res.image) == (4, 16384, 1, False,
                                                                                         "r.example.com/x:1")
    overriding = Catalog.from_config(PlatformConfig(teams=TEAMS, training={"image": "r.example.com/all:2"}))
    assert node_resources(spec(), TEAMS, overriding).image == "r.example.com/all:2"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"instance_type": "p9.huge"}, "instance type 'p9.huge' is not under instance_types:"),
        ({"gpus_per_node": 16}, "gpus_per_node=16, but a p5.48xlarge node has 8"),
        ({"cpus_per_node": 400}, "cpus_per_node=400, but a p5.48xlarge node has 192 vCPUs"),
        ({"memory_gb_per_node": 2048}, "can give a container at most 1966 GiB"),
        ({"procs_per_node": 9}, "procs_per_node=9 > gpus_per_node=8"),
    ],
)
def test_what_does_not_fit_names_the_setting(change, says):
    with pytest.raises(ConfigError) as err:
        resolve(spec(**change), TEAMS, CATALOG)
    assert says in str(err.value)


def test_resolve_fills_the_spec():
    resolved, res = resolve(spec(), TEAMS, CATALOG)
    assert (resolved.instance_type, resolved.image, resolved.gpus_per_node, resolved.cpus_per_node) == (
        "p5.48xlarge", "pinflow-training:latest", 8, 192)
    assert resolved.memory_gb_per_node == res.memory_limit_mib / 1024


def test_efa_environment_as_aws_documents_it():
    p5 = node_resources(spec(), TEAMS, CATALOG)
    assert efa_environment(p5, "^lo,docker,ecs") == {
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "NCCL_SOCKET_IFNAME": "^lo,docker,ecs"}
    g5 = node_resources(spec(instance_type="g5.12xlarge", procs_per_node=4), TEAMS, CATALOG)
    assert "FI_EFA_USE_DEVICE_RDMA" not in efa_environment(g5, "^lo")  # no GPUDirect RDMA on g5
    cpu = node_resources(spec(team="search", procs_per_node=1), TEAMS, CATALOG)
    assert efa_environment(cpu, "^lo") == {"NCCL_SOCKET_IFNAME": "^lo"}


def test_config_refuses_an_unknown_instance_type_naming_the_key():
    with pytest.raises(ValueError, match="teams.ranking.instance_type='p9' is not under instance_types:"):
        PlatformConfig(teams={"ranking": TeamConfig(queue="q", share="s", instance_type="p9")})
