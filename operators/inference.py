"""Corpus inference stage: plan the shards from the work, score them as one job, publish.

- :func:`plan_inference` resolves the model version (any family's registry entry; an alias or a number) and the
  corpus snapshot, sizes the shards from the work (:func:`size_shards`: the snapshot's pins, the throughput
  measured by earlier runs of the model, a target time per shard, a cap; a form value overrides) and writes the
  plan (``training.inference.make_plan``) beside the output.
- :class:`CorpusScoringOperator` submits **one job** for the shards that have no part yet and defers to the
  triggerer while it runs (no worker slot held): an array job of scoring processes (local parallel processes,
  an AWS Batch array job, a Kubernetes Indexed Job), or a Ray Data job (``engine: ray``: a local Ray cluster, or a
  KubeRay RayJob). A failed child fails the job only once the others have ended; its class decides the retry
  (a killed process is INFRA), and a retry scores only the shards still missing.
- :func:`publish` checks that every pin of the snapshot is in exactly one part and writes the manifest last,
  and records the throughput the run measured for the next plan.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import Context

from core.failures import ConfigError, DataError, InfraError
from operators.compute_job import ComputeJobOperator, JobRef, Submission, Watch

if TYPE_CHECKING:
    from core.config import PlatformConfig
    from training.inference import ScoringPlan

THROUGHPUT_FILE = "_THROUGHPUT.json"  # inference/<model>/: the last runs' measured pins/s per scoring process
ENGINES = ("processes", "ray")


def size_shards(
    pins: int, *, pins_per_s: float, target_seconds: float, max_shards: int, min_pins_per_shard: int,
    parallelism: int = 1,
) -> tuple[int, str]:
    """How many shards the work needs, and why (pure).

    Enough that each takes about ``target_seconds`` at ``pins_per_s`` per scoring process; at least
    ``parallelism`` (processes that can run at once) as long as shards keep ``min_pins_per_shard``; at most
    ``max_shards`` and never more shards than pins.
    """
    by_time = math.ceil(pins / (pins_per_s * target_seconds)) if pins else 1
    by_parallelism = min(max(parallelism, 1), math.ceil(pins / min_pins_per_shard)) if pins else 1
    shards = max(1, min(max_shards, max(by_time, by_parallelism), max(pins, 1)))
    why = (f"{pins} pins at {pins_per_s:.0f} pins/s per process, {target_seconds:.0f}s per shard: {by_time}; "
           f"{parallelism} at once (shards of at least {min_pins_per_shard} pins): {by_parallelism}; "
           f"at most {max_shards}")
    return shards, why


def parallelism_for(cfg: PlatformConfig, backend: str) -> int:
    """Shards that run at once: the configured ``inference.parallelism``, else on the local backend the machine's
    CPUs over the threads of a scoring process, elsewhere 1 (a cluster's capacity is not known here)."""
    if cfg.inference.parallelism:
        return int(cfg.inference.parallelism)
    if backend == "local":
        return max(1, (os.cpu_count() or 1) // cfg.inference.threads)
    return 1


def measured_throughput(root: str, model_name: str) -> float | None:
    """The median pins/s per scoring process of the last runs of ``model_name`` (None before the first)."""
    from core import storage
    from core.contracts import INFERENCE

    location = storage.join(root, INFERENCE, model_name, THROUGHPUT_FILE)
    try:
        runs = list(storage.read_json(location).get("runs", []))
    except (FileNotFoundError, ValueError):
        return None
    rates = sorted(float(r["pins_per_s_per_process"]) for r in runs if r.get("pins_per_s_per_process"))
    return rates[len(rates) // 2] if rates else None


def record_throughput(root: str, model_name: str, manifest: dict[str, Any], keep: int = 5) -> None:
    """Add a run's measurement (from its manifest) to the last ``keep`` of ``model_name``."""
    from core import storage
    from core.contracts import INFERENCE

    measured = manifest.get("throughput")
    if not measured:
        return
    location = storage.join(root, INFERENCE, model_name, THROUGHPUT_FILE)
    try:
        runs = list(storage.read_json(location).get("runs", []))
    except (FileNotFoundError, ValueError):
        runs = []
    runs.append({"pins_per_s_per_process": measured["pins_per_s_per_process"], "model_uri": manifest["model_uri"],
                 "ds": manifest["ds"], "plan_id": manifest["plan_id"], "parts": measured["parts"],
                 "measured_at": manifest["created"]})
    storage.write_json(location, {"runs": runs[-keep:]})


def plan_inference(
    model: str, model_version: str, ds: str | None, shards: int | None = None, *, engine: str | None = None,
    backend: str | None = None,
) -> dict[str, Any]:
    """Plan scoring the corpus snapshot of ``ds`` (default: the newest) with a version of ``model``'s model.

    ``shards`` (the form's) fixes the shard count; empty, the work sizes it (:func:`size_shards`). The plan file
    goes beside the output; the returned summary (XCom) names it. An unknown family, version or alias is a USER
    error; a registry that does not answer is INFRA (retried); a missing snapshot is DATA.
    """
    from core import config, storage
    from core.contracts import INFERENCE, RAW_PINS
    from core.model_versions import model_version as find_version
    from services import model_registry as registry
    from training.inference import SHARDED_ROWS_TAG, make_plan, snapshot, views_dir, write_plan

    cfg = config.load()
    if model not in cfg.families:
        raise ConfigError(f"unknown model family {model!r} (param model): configured are {', '.join(sorted(cfg.families))}")
    engine = engine or cfg.inference.engine
    backend = backend or cfg.training.backend
    if engine not in ENGINES:
        raise ConfigError(f"unknown scoring engine {engine!r} (param engine): choose one of {', '.join(ENGINES)}")
    name = cfg.families[model].model_name or model
    mv = find_version(registry.client(cfg.mlflow), name, model_version)
    days = storage.complete_days(cfg.storage_root, RAW_PINS)
    ds = ds or (days[-1] if days else None)
    if ds is None or ds not in days:
        raise DataError(f"pin corpus snapshot {RAW_PINS} ds={ds} is missing or incomplete under {cfg.storage_root}")
    out_dir = storage.partition(cfg.storage_root, f"{INFERENCE}/{name}/{mv.version}", ds)
    inf = cfg.inference
    snap = snapshot(cfg.storage_root, ds, views_dir(out_dir))  # an incremental snapshot: merged once, here
    pins = int(snap["pins"])
    if shards:
        num_shards, why = int(shards), "the run's shards param"
    else:
        measured = measured_throughput(cfg.storage_root, name)
        num_shards, why = size_shards(
            pins, pins_per_s=measured or inf.assumed_pins_per_s, target_seconds=inf.target_shard_seconds,
            max_shards=inf.max_shards, min_pins_per_shard=inf.min_pins_per_shard,
            parallelism=parallelism_for(cfg, backend),
        )
        why += " (throughput measured by earlier runs)" if measured else " (throughput assumed: no run measured it yet)"
    model_uri = f"models:/{name}/{mv.version}"
    # A model exported sharded: each shard scores the pins of a range of its pin table's rows (PIN_ROWS).
    table_rows = int((getattr(mv, "tags", None) or {}).get(SHARDED_ROWS_TAG) or 0)
    plan = make_plan(model_uri=model_uri, tracking_uri=cfg.mlflow.tracking_uri,
                     root=cfg.storage_root, ds=ds, out_dir=out_dir, num_shards=num_shards,
                     batch_size=inf.batch_size, threads=inf.threads, snap=snap, table_rows=table_rows)
    location = write_plan(plan)
    return {
        "model": model,
        "model_name": name,
        "model_version": str(mv.version),
        "model_uri": plan.model_uri,
        "ds": ds,
        "pins": pins,
        "shards": num_shards,
        "sizing": why,
        "plan_id": plan.plan_id,
        "plan_file": location,
        "batch_size": plan.batch_size,
        "threads": plan.threads,
        "table_rows": table_rows,
        "out_dir": out_dir,
        "engine": engine,
        "backend": backend,
    }


def load_plan(summary: dict[str, Any]) -> ScoringPlan:
    """The plan a summary of :func:`plan_inference` names: its file, or (once a publish removed it) the same plan
    made again from the summary, which finds the parts already published under it."""
    from core import config
    from training.inference import MissingPartsError, make_plan, read_plan

    try:
        return read_plan(summary["plan_file"])
    except MissingPartsError:
        cfg = config.load()
        plan = make_plan(model_uri=summary["model_uri"], tracking_uri=cfg.mlflow.tracking_uri, root=cfg.storage_root,
                         ds=summary["ds"], out_dir=summary["out_dir"], num_shards=int(summary["shards"]),
                         batch_size=int(summary["batch_size"]), threads=int(summary.get("threads", 1)),
                         table_rows=int(summary.get("table_rows") or 0))
        if plan.plan_id != summary["plan_id"]:
            raise DataError(
                f"plan {summary['plan_id']} cannot be made again (the snapshot or settings changed since; now "
                f"{plan.plan_id}): run the DAG again to plan anew"
            ) from None
        return plan


def scoring_job_spec(plan: dict[str, Any], shards: Sequence[int], *, name: str, engine: str, backend: str,
                     cfg: PlatformConfig) -> Any:
    """The job that scores ``shards`` of the plan (summary from :func:`plan_inference`): pure.

    ``processes``: an array job of ``python -m training.inference --plan ... --shards ...``, one child per shard
    (its array index picks it), each child a share of a node (``inference.threads`` CPUs); ``ray``: one
    ``python -m training.ray_inference`` driver on a whole node (a KubeRay cluster of ``ray_workers`` workers on
    kubernetes).
    """
    import dataclasses

    from core.arrays import format_shards
    from operators.backends import JobSpec

    inf = cfg.inference
    listed = format_shards(shards)
    env = {"OMP_NUM_THREADS": str(inf.threads)}
    if engine == "ray":
        command = ["-m", "training.ray_inference", "--plan", plan["plan_file"], "--shards", listed,
                   "--cpus", str(inf.ray_cpus), "--actors", str(inf.ray_actors), "--actor-cpus", str(inf.ray_actor_cpus),
                   "--reader-cpus", str(inf.ray_reader_cpus), "--threads", str(inf.threads)]
        if inf.ray_temp_dir:  # else the node's own <system temp>/pinflow-ray
            command += ["--temp-dir", inf.ray_temp_dir]
    else:
        command = ["-m", "training.inference", "--plan", plan["plan_file"], "--shards", listed,
                   "--threads", str(inf.threads)]
    spec = JobSpec(name=name, command=command, team=cfg.training.team, image=cfg.training.image,
                   instance_type=inf.instance_type, env=env, timeout_s=int(inf.timeout_seconds))
    if engine == "ray":
        return dataclasses.replace(spec, engine="ray", ray_workers=inf.ray_workers if backend == "kubernetes" else 0)
    spec = dataclasses.replace(spec, array_size=len(shards), array_parallelism=parallelism_for(cfg, backend))
    itype = cfg.instance_types.get(inf.instance_type)
    if itype is not None and inf.threads < itype.vcpus:  # a slice of the node per shard, memory in proportion
        memory = round(itype.memory_gib * cfg.resources.memory_tax * inf.threads / itype.vcpus, 2)
        spec = dataclasses.replace(spec, cpus_per_node=inf.threads, memory_gb_per_node=memory)
    return spec


class CorpusScoringOperator(ComputeJobOperator):
    """Score the shards of a corpus-inference plan that have no part yet, as one job on a compute backend.

    The job's lifecycle is :class:`~operators.compute_job.ComputeJobOperator`'s: submit (or reattach to the job this
    task recorded while it still runs) and defer to :class:`~operators.triggers.ComputeJobTrigger` until the job
    ends, no worker slot held while it runs. The job's outcome is re-checked through the backend and classified
    (``core.failures``): INFRA (a killed or lost process, a node taken away) is retried by the task's retry policy,
    and the retry submits a job for the shards still missing only; USER, DATA and OOM fail now. ``on_kill`` cancels
    the job.

    :param plan: the summary :func:`plan_inference` returned (templated: an XCom).
    :param backend: ``local``, ``batch`` or ``kubernetes`` (templated; default: the plan's, else
        ``training.backend``).
    :param engine: ``processes`` or ``ray`` (templated; default: the plan's, else ``inference.engine``).
    :param deferrable: wait in the triggerer (default); False polls on the worker.
    :param poll_seconds: between status checks (default: ``inference.poll_seconds``).
    """

    template_fields: Sequence[str] = ("plan", "backend", "engine")
    ui_color = "#e4f0d0"
    external_id_key = "scoring_job"
    what = "scoring job"

    def __init__(self, *, plan: Any, backend: str | None = None, engine: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plan = plan
        self.backend = backend
        self.engine = engine

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the registered model and the raw/pins snapshot in, the output partition out."""
        from operators.lineage import inference_lineage

        return inference_lineage(self.plan)

    def _names(self, cfg: PlatformConfig) -> tuple[str, str]:
        backend = str(self.backend or self.plan.get("backend") or cfg.training.backend)
        engine = str(self.engine or self.plan.get("engine") or cfg.inference.engine)
        return backend, engine

    def _summary(self, plan: ScoringPlan, scored: Sequence[int], job: JobRef | None) -> dict[str, Any]:
        return {**self.plan, "scored_shards": len(scored), "job_id": job.job_id if job else None,
                "backend": job.backend if job else self.plan.get("backend"), "num_shards": plan.num_shards}

    # -- ComputeJobOperator --------------------------------------------------------------------------------------
    def name_parts(self, context: Context) -> tuple[str, ...]:
        ti = context["ti"]
        return ("score", ti.dag_id, ti.run_id)

    def watch(self) -> Watch:
        from core import config
        cfg = config.load()
        return Watch(poll_s=float(self.poll_seconds or cfg.inference.poll_seconds),
                     stall_s=float(cfg.inference.timeout_seconds),
                     queue_timeout_s=float(cfg.training.queue_timeout_seconds))

    def todo(self, context: Context) -> tuple[ScoringPlan, list[int]]:
        """The plan and its shards that have no part yet."""
        from training.inference import missing_shards

        plan = load_plan(self.plan)
        return plan, missing_shards(plan)

    def result_without_job(self, context: Context, todo: tuple[ScoringPlan, list[int]]) -> Any:
        plan, missing = todo
        if missing:
            return None
        self.log.info("every shard of plan %s has its part: nothing to score", plan.plan_id)
        return self._summary(plan, [], None)

    def prepare(self, context: Context, name: str, todo: tuple[ScoringPlan, list[int]] | None = None) -> Submission:
        from core import config
        cfg = config.load()
        backend_name, engine = self._names(cfg)
        plan, missing = todo or self.todo(context)
        spec = scoring_job_spec(self.plan, missing, name=name, engine=engine, backend=backend_name, cfg=cfg)
        summary = (f"{len(missing)} of {plan.num_shards} shard(s) of plan {plan.plan_id}, {plan.pins} pins, "
                   f"{engine} engine; {self.plan.get('sizing', '')}")
        return Submission(backend_name, spec, shards=tuple(missing), summary=summary, settings=plan)

    def before_submit(self, context: Context, backend: Any, submission: Submission) -> None:
        from core import storage
        from training.inference import write_plan

        if not storage.exists(self.plan["plan_file"]):
            write_plan(submission.settings)  # the jobs read it

    def finish(self, context: Context, job: JobRef) -> dict[str, Any]:
        from training.inference import missing_shards

        plan = load_plan(self.plan)
        missing = missing_shards(plan)
        if missing:
            raise InfraError(
                f"scoring job {job.job_id} succeeded but shard(s) {missing[:20]} of plan {plan.plan_id} have no "
                "part: retrying scores them"
            )
        self.log.info("scoring job %s finished: every shard of plan %s has its part", job.job_id, plan.plan_id)
        return self._summary(plan, job.shards, job)


def publish(plan: dict[str, Any]) -> dict[str, Any]:
    """Check every part and write the manifest last (only then do readers see the output); record the measured
    throughput for the next plan of this model."""
    from core import config
    from core.storage import join
    from training.inference import MANIFEST, publish_plan

    cfg = config.load()
    manifest = publish_plan(load_plan(plan))
    record_throughput(cfg.storage_root, plan["model_name"], manifest)
    summary = {k: v for k, v in manifest.items() if k != "parts"}
    return {**summary, "manifest": join(plan["out_dir"], MANIFEST), "sizing": plan.get("sizing", "")}
