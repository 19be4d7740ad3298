"""Checkpoints are verified before load: a file that is not the one the save wrote is refused, unread.

DCP unpickles a checkpoint's ``.metadata`` (``pickle.load``) and its non-tensor items (``torch.load`` with
``weights_only=False``), so a crafted file under ``models/`` would run code in the training job. The save
records every file's SHA-256 in ``COMPLETE.json``; ``checkpoint.load`` checks them first.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from core import storage
from core.failures import DataError, ExitCode, FailureClass, exit_code_for
from training import checkpoint

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP in one process
]


class RunsCode:
    """What an attacker puts in a crafted file: unpickling it calls ``Path.touch`` on the sentinel."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.sentinel,))


def _parts(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": (model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))}


def _saved(base: Path) -> tuple[str, dict[str, Any]]:
    parts = _parts(0)
    model, opt, sched = parts["model"]
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    path = checkpoint.save(base, step=2, epoch=0, examples_seen=6, parts=parts, data={"batches": 2}, is_main=True)
    return path, parts


def test_the_marker_records_every_file_and_an_untouched_checkpoint_loads(tmp_path: Path):
    path, parts = _saved(tmp_path)
    marker = json.loads(storage.read_text(storage.join(path, checkpoint.MARKER)))
    names = checkpoint.checkpoint_files(path)
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    assert sorted(marker["files"]) == names
    assert all(len(digest) == 64 for digest in marker["files"].values())
    assert checkpoint.verification_problems(path) == []

    fresh = _parts(1)
    position = checkpoint.load(path, parts=fresh)
    assert position["step"] == 2
    assert torch.equal(fresh["model"][0].weight, parts["model"][0].weight)


def test_a_crafted_metadata_file_is_refused_before_it_is_unpickled(tmp_path: Path):
    path, _ = _saved(tmp_path)
    metadata = Path(path) / ".metadata"
    sentinel = tmp_path / "code-ran"
    metadata.write_bytes(pickle.dumps(RunsCode(sentinel)))

    # The threat is real: DCP's own reader runs the crafted file's code (then fails on what it returned).
    with pytest.raises(AttributeError):
        dcp.FileSystemReader(path).read_metadata()
    assert sentinel.exists()
    sentinel.unlink()

    with pytest.raises(DataError, match=r"checkpoint .* refused: .*\.metadata: SHA-256 .* differs") as refused:
        checkpoint.load(path, parts=_parts(1))
    assert not sentinel.exists()
    assert "Delete that folder" in str(refused.value)
    # DATA: the job fails at once with exit code 65, no retry resumes from this checkpoint.
    assert refused.value.failure_class is FailureClass.DATA and exit_code_for(refused.value) is ExitCode.DATA


def test_a_changed_data_file_a_missing_one_an_extra_one_and_a_marker_without_checksums_are_refused(tmp_path: Path):
    path, _ = _saved(tmp_path)
    data_file = Path(path) / next(n for n in checkpoint.checkpoint_files(path) if n.endswith(".distcp"))
    original = data_file.read_bytes()

    data_file.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert any("differs" in p for p in checkpoint.verification_problems(path))

    data_file.unlink()
    assert checkpoint.verification_problems(path) == [f"{data_file.name}: missing"]

    data_file.write_bytes(original)
    (Path(path) / "__9_0.distcp").write_bytes(pickle.dumps(RunsCode(tmp_path / "code-ran")))
    assert checkpoint.verification_problems(path) == ["__9_0.distcp: not written by the save (not in COMPLETE.json)"]
    os.remove(Path(path) / "__9_0.distcp")
    assert checkpoint.verification_problems(path) == []

    marker_file = storage.join(path, checkpoint.MARKER)
    marker = json.loads(storage.read_text(marker_file))
    del marker["files"]
    storage.write_json(marker_file, marker)
    with pytest.raises(DataError, match="records no checksums"):
        checkpoint.load(path, parts=_parts(1))


def test_checksums_on_a_url_root(tmp_path: Path):
    """The same on an fsspec URL (the in-memory filesystem stands for S3 here; moto in tests/integration)."""
    import fsspec

    url = f"memory://pinflow-{tmp_path.name}/checkpoints"
    fs = fsspec.filesystem("memory")
    try:
        path, _ = _saved(url)  # type: ignore[arg-type]
        assert storage.is_remote(path)
        assert checkpoint.verification_problems(path) == []
        key = fs._strip_protocol(storage.join(path, ".metadata"))
        fs.pipe_file(key, pickle.dumps(RunsCode(tmp_path / "code-ran")))
        with pytest.raises(DataError, match=r"\.metadata: SHA-256"):
            checkpoint.load(path, parts=_parts(1))
        assert not (tmp_path / "code-ran").exists()
    finally:
        fs.rm(fs._strip_protocol(url), recursive=True)


@pytest.mark.parametrize(("every", "total", "expected"), [
    (500, 273, 28),  # the demo's ranker: ten checkpoints, not none before its end (a retry would start at step 0)
    (500, 100_000, 500),
    (4, 76, 4),
    (0, 273, 0),  # only at the end, as asked
    (500, 5, 1),
])
def test_a_run_shorter_than_checkpoint_every_still_checkpoints_ten_times(every, total, expected):
    from training.checkpoint_manager import checkpoint_interval

    assert checkpoint_interval(every, total) == expected


def test_a_forged_marker_with_matching_checksums_is_refused_when_checkpoints_are_signed(tmp_path: Path, monkeypatch):
    """Issue 37: whoever can write the folder can rewrite COMPLETE.json's checksums too. With the platform's key in
    the job's environment the marker is signed, and a forged one is refused before anything is unpickled."""
    monkeypatch.setenv(checkpoint.KEY_ENV, "the platform's secret")
    path, _ = _saved(tmp_path)
    marker_file = storage.join(path, checkpoint.MARKER)
    assert json.loads(storage.read_text(marker_file))["signature"]
    assert checkpoint.verification_problems(path) == []
    sentinel = tmp_path / "code-ran"
    (Path(path) / ".metadata").write_bytes(pickle.dumps(RunsCode(sentinel)))
    marker = json.loads(storage.read_text(marker_file))
    marker["files"] = checkpoint.checksums(path)  # the forger recomputes the checksums, but has no key
    storage.write_json(marker_file, marker)

    with pytest.raises(DataError, match="signature does not match: it was not written with this platform's "
                                        "checkpoint key"):
        checkpoint.load(path, parts=_parts(1))
    assert not sentinel.exists()
    del marker["signature"]
    storage.write_json(marker_file, marker)
    with pytest.raises(DataError, match=r"COMPLETE.json is not signed, and checkpoints are signed here"):
        checkpoint.load(path, parts=_parts(1))
    signed, _ = _saved(tmp_path / "other")
    monkeypatch.setenv(checkpoint.KEY_ENV, "another key")  # another platform's key: its checkpoints are not ours
    assert "signature does not match" in checkpoint.verification_problems(signed)[0]


def test_the_local_backend_gives_its_jobs_one_key_kept_outside_the_storage_root(tmp_path: Path, monkeypatch):
    from operators.backends.local import LocalBackend

    monkeypatch.delenv(checkpoint.KEY_ENV, raising=False)
    backend = LocalBackend(tmp_path / "home")
    key = backend.checkpoint_key()
    assert len(key) == 64 and backend.checkpoint_key() == key == LocalBackend(tmp_path / "home").checkpoint_key()
    secret = tmp_path / "home" / "secrets" / "checkpoint.key"
    assert secret.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv(checkpoint.KEY_ENV, "from the secret store")
    assert backend.checkpoint_key() == "from the secret store"


# Claims a run's folders (checkpoint_dir, output_dir) as a training job does, says so, and waits to be killed.
_CLAIMER = ("import sys, time; from training.runtime import hold_run_folders; hold_run_folders(sys.argv[1], sys.argv[2]); "
            "print('held', flush=True); time.sleep(600)")


def test_a_second_job_given_one_of_a_runs_folders_stops_before_writing_and_a_killed_jobs_claim_is_gone(tmp_path: Path):
    import subprocess
    import sys

    from core.failures import InfraError
    from training import train
    from training.runtime import hold_run_folders

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", _CLAIMER, str(ckpt), str(out)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parents[2])

    def config(name: str, **folders: Path) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"root": str(tmp_path / "data"), "train_days": ["2026-01-01"], "eval_ds": "2026-01-02",
                                    "mlflow_tracking_uri": f"sqlite:///{tmp_path}/m.db",
                                    **{k: str(v) for k, v in folders.items()}}))
        return path

    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        same = config("same", checkpoint_dir=ckpt, output_dir=tmp_path / "out2")
        assert train.main(["--config", str(same)]) == ExitCode.INFRA
        # Under training.launch (every backend's entry point) the node-0 agent claims them before any worker starts.
        launched = subprocess.run([sys.executable, "-m", "training.launch", "--nproc-per-node", "2", "--preflight", "--",
                                   "-m", "training.train", "--config", str(same)], capture_output=True, text=True,
                                  cwd=Path(__file__).parents[2], timeout=120)
        assert launched.returncode == ExitCode.INFRA and f"checkpoint_dir {ckpt} is in use by another training job" in launched.stderr
        assert not (tmp_path / "out2").exists()  # no heartbeat, failure file or preflight of the second job
        # Its own checkpoint_dir, the first's output_dir: the first's heartbeats and result would be overwritten.
        with pytest.raises(InfraError, match=rf"output_dir {out} is in use by another training job \(.* pid {first.pid}, since .*overwrite each other's heartbeats"):
            hold_run_folders(tmp_path / "ckpt2", out)
        assert not list(out.glob("heartbeat-*"))
    finally:
        first.kill()
        first.wait(timeout=30)
    for fd in hold_run_folders(ckpt, out):  # the kernel dropped the killed job's claims with its process
        os.close(fd)
    assert hold_run_folders(f"s3://bucket/{ckpt.name}", f"s3://bucket/{out.name}") == []  # the operators' one-job rule


def test_a_checkpoint_of_a_run_with_other_settings_is_not_resumed_silently(tmp_path: Path):
    """A rerun into a run's checkpoint_dir with another lr or dropout would restore that run's optimizer and schedule
    (the new lr ignored) and report its model: refused, naming each setting. Longer runs and moved roots resume."""
    from core.failures import ConfigError
    from training.checkpoint_manager import CheckpointManager, resume_settings
    from training.config import RunConfig

    base = RunConfig.checked("RUN.json", root=str(tmp_path), train_days=["2026-01-01"], eval_ds="2026-01-02",
                             output_dir=str(tmp_path / "out"), checkpoint_dir=str(tmp_path / "ckpt"),
                             mlflow_tracking_uri="sqlite:///m.db", lr=0.003, params={"dropout": 0.1})
    marker = {"path": str(tmp_path / "ckpt" / "step-00000108"), "settings": resume_settings(base)}

    def check(config: RunConfig) -> None:
        CheckpointManager(config, None, None, parts={}, stream=None, examples_seen=lambda: 0,  # type: ignore[arg-type]
                          extra={})._check_settings(marker)

    check(base.replace("RUN.json", epochs=base.epochs + 2, max_steps=500, root=str(tmp_path / "moved"), num_workers=2))
    with pytest.raises(ConfigError, match=r"is of a run trained with other settings than this RUN.json's \(lr: saved "
                       r"0.003, now 0.03; params: saved \{'dropout': 0.1\}, now \{'dropout': 0.3\}\): resuming it would "
                       r"continue that run and ignore them.*checkpoint_dir of its own"):
        check(base.replace("RUN.json", lr=0.03, params={"dropout": 0.3}))
    marker.pop("settings")  # a checkpoint of older code records none: resumed as before
    check(base.replace("RUN.json", lr=0.03))


@pytest.mark.parametrize(("saved_step", "epochs", "expected_step", "past", "cap"), [
    (20, 4, 40, False, None),  # a finished 4-epoch run on 2 ranks, on 1 rank: finished, not trained again
    (10, 4, 20, False, None),  # half-way: the same half of the run
    (7, 4, 14, False, None),  # 2 of epoch 2's 5 steps: 4 of its 10
    (20, 1, 10, True, None),  # 4 epochs trained, 1 asked now: nothing to train, and said
    (15, 4, 25, True, 25),  # 3 epochs trained, the run now capped at 25 steps (max_steps): past it, and said
    (10, 4, 20, False, 25),  # 2 epochs trained, within the cap: trained on to it
])
def test_a_resume_on_another_world_size_continues_as_far_into_the_same_epoch(saved_step, epochs, expected_step, past,
                                                                             cap):
    """2 ranks took 5 steps an epoch, 1 rank takes 10: the saved step counted in the new world's steps trained epochs
    again (a finished run a second time). The LR schedule moves to the new step."""
    import torch

    from training.checkpoint_manager import Resumed
    from training.train import Trainer, lr_lambda

    trainer = Trainer.__new__(Trainer)
    trainer.step = saved_step  # as resume() sets it before
    trainer.epochs, trainer.steps_per_epoch = epochs, [10] * epochs
    trainer.epoch_start = [10 * e for e in range(epochs)]
    trainer.total_steps = min(10 * epochs, cap or 10 * epochs)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=0.01)
    schedule = lr_lambda(trainer.total_steps, 2, 0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    trainer.parts = {"model": (torch.nn.Identity(), optimizer, scheduler)}
    saved = Resumed(path="/c/step-x", step=saved_step, epoch=0, examples_seen=0, exact=False, saved_world_size=2,
                    world_size=1, reason="saved by 2 rank(s), resumed on 1", saved_steps_per_epoch=(5, 5, 5, 5))
    resumed = trainer.continue_at_same_share(saved)
    assert trainer.step == expected_step and trainer.checkpoint_past_run is past
    assert scheduler.last_epoch == expected_step
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * schedule(expected_step))
    assert f"saved at step {saved_step} of its 20" in resumed.reason and f"continued at step {expected_step}" in (
        resumed.reason)


def test_a_save_supersedes_the_checkpoints_an_earlier_larger_step_count_left(tmp_path: Path):
    """Resumed on more ranks, a run counts fewer steps an epoch: its first save (step 75) is newer than the earlier
    world's steps 180 and 200, which stayed the newest (its own saves were pruned at once and a retry went back)."""
    base = tmp_path / "ckpt"

    def save_tiny(base: Path, step: int) -> None:
        checkpoint.save(base, step=step, epoch=0, examples_seen=step, parts=_parts(0), data={"batches": 1},
                        is_main=True)

    for step in (180, 200):
        save_tiny(base, step)
    save_tiny(base, 75)
    assert [step for step, _ in checkpoint.complete_checkpoints(base)] == [75]
    assert checkpoint.latest_checkpoint(base)["step"] == 75
    save_tiny(base, 100)
    assert [step for step, _ in checkpoint.complete_checkpoints(base)] == [75, 100]  # kept as before
