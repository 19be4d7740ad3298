"""What ``deploy/`` ships, checked without a Docker engine or a cluster: the training images' Dockerfiles are
well-formed and copy files that exist (and that their .dockerignore lets through), both start from the AWS
PyTorch Deep Learning Container and install pinflow with the constraints; the Kueue example names the
default team's queue and priority class."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest
import yaml

from core.config import ImagesConfig, PlatformConfig
from core.config import read as read_config

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "RUN", "LABEL", "USER", "ENTRYPOINT", "CMD", "EXPOSE"}
DLC = re.compile(r"^public\.ecr\.aws/deep-learning-containers/pytorch:2\.13-(cu\d+|cpu)-amzn2023$")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word, rest.strip()))
    assert not pending, f"{path.name}: a continuation line runs off the end"
    return out


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins, '!' re-includes."""
    verdict = False
    for pattern in patterns:
        negate, pat = pattern.startswith("!"), pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/") or fnmatch.fnmatch(path, pat.replace("**/", "")):
            verdict = not negate
    return verdict


@pytest.mark.parametrize(("name", "flavour"), [("training.Dockerfile", "cu"), ("training-cpu.Dockerfile", "cpu")])
def test_dockerfile_is_well_formed_and_copies_what_exists(name, flavour):
    path = DEPLOY / name
    steps = instructions(path)
    assert path.read_text().startswith("# syntax=docker/dockerfile:1")
    assert all(word in INSTRUCTIONS for word, _ in steps), [w for w, _ in steps if w not in INSTRUCTIONS]
    # ARG DLC_IMAGE=<the DLC> then FROM ${DLC_IMAGE}: the base image is an AWS PyTorch 2.13 DLC.
    args = dict(a.split("=", 1) for word, a in steps if word == "ARG" and "=" in a)
    froms = [a for word, a in steps if word == "FROM"]
    assert len(froms) == 1 and froms[0] == "${DLC_IMAGE}" and steps.index(("FROM", froms[0])) == 1
    assert DLC.match(args["DLC_IMAGE"]) and flavour in args["DLC_IMAGE"]
    patterns = [p.strip() for p in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for word, rest in steps:
        if word == "COPY":
            *sources, target = shlex.split(rest)
            assert sources and target
            for source in sources:
                assert (REPO / source).exists(), f"{name}: COPY {source}: no such file in the repository"
                assert not ignored(source, patterns), f"{name}: COPY {source} is excluded by its .dockerignore"
        if word == "RUN":
            assert rest and not rest.endswith("&&"), f"{name}: empty or dangling RUN: {rest!r}"
        if word in ("ENV", "LABEL"):
            assert all("=" in kv for kv in shlex.split(rest)), f"{name}: {word} {rest}"
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    # pinflow with its inference extra (Ray, for RayJobs on this image), with the pinned versions
    assert "pip install" in runs and '-c constraints.txt ".[inference]"' in runs
    # Everything the package holds is copied (pyproject's packages), and no secret or local state can be.
    copied = {shlex.split(rest)[0] for word, rest in steps if word == "COPY"}
    assert {"core", "operators", "features", "training"} <= copied
    assert ignored(".pinflow/storage/x", patterns) and ignored(".env", patterns) and ignored(".venv/bin/python", patterns)


def test_default_images_are_the_ones_the_dockerfiles_build():
    text = (DEPLOY / "training.Dockerfile").read_text() + (DEPLOY / "training-cpu.Dockerfile").read_text()
    assert f"/{ImagesConfig().gpu.split(':')[0]}:" in text and f"/{ImagesConfig().cpu.split(':')[0]}:" in text


def test_kueue_example_names_the_default_teams_queue_and_priority():
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all((DEPLOY / "kubernetes" / "kueue.yaml")
                                                                                .read_text())}
    cfg: PlatformConfig = read_config(REPO / "config" / "platform.yaml", {})
    team = cfg.teams["ranking"]
    assert objects[("LocalQueue", team.queue)]["metadata"]["namespace"] == cfg.kubernetes.namespace
    assert objects[("WorkloadPriorityClass", team.priority_class)]["value"] == team.priority
    flavour = objects[("ResourceFlavor", "p5-48xlarge")]
    assert flavour["spec"]["nodeLabels"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
