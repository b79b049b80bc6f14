"""Which checkpoint is the newest, and which is intact.

Two classes of attack, each on real parts (real processes killed with SIGKILL, a real S3 server,
a real Lightning Trainer and Accelerator, the ``coci`` command in its own process):

- **clock skew**: a wall clock ten minutes behind or ahead, within a run, across runs (a
  restart after a crash, a fresh run beside an older one), in a local directory, on S3 as the
  primary directory and between the local and the remote tier: it never reorders checkpoints
  (they are ordered by their commit sequence; ``created_unix`` is only shown), so retention
  never deletes the newest steps and a resume takes the newest;
- **tier fallback with damage**: the newest local step with a flipped byte in its data or in
  its manifest, or deleted: restore, ``coci ls``, ``coci export`` and the Lightning and
  Accelerate resumes all take the same intact newest step, from either tier.

A clock is skewed where the engine reads it for ``created_unix`` (``time.time`` in
``coci_core.engine.save.persist``), in the child process or in this one.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager
from coci_core.commands import cli
from coci_core.engine.format.manifest import MANIFEST_NAME, step_dir_name
from coci_core.engine.save import persist
from coci_lightning import CociCheckpoint
from tests.adversarial._clock_child import SkewedClock, state
from tests.adversarial.craft import same
from tests.harness.processes import child_env, module, run
from tests.harness.s3 import S3Server
from tests.lightning.models import DigitsModel

OFFSET_S = 600.0
# (the first run's clock, the next run's clock): the next run's behind, or the first run's ahead
CLOCKS = {"behind": (0.0, -OFFSET_S), "ahead": (OFFSET_S, 0.0)}
DAMAGES = ("data-byte", "manifest-byte", "deleted")


def _skew(monkeypatch: pytest.MonkeyPatch, offset_s: float) -> None:
    """Set the wall clock that stamps ``created_unix`` (``time.time`` in the module that
    stamps it) ``offset_s`` off in this process."""
    monkeypatch.setattr(persist, "time", SkewedClock(offset_s))


def _crashed_run(target: str, offset_s: float, env: dict[str, str]) -> None:
    """A run in a child process, its clock ``offset_s`` off, that saves steps 1-3 and is
    killed with SIGKILL."""
    done = run(
        module("tests.adversarial._clock_child", target, str(offset_s), "1", "3"),
        env=child_env(env, drop_prefixes=("AWS_",)),
    )
    assert done.returncode == -signal.SIGKILL and "SAVED" in done.stdout, done.stderr[-3000:]


# --- clock skew ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("clock", sorted(CLOCKS))
def test_a_restart_whose_clock_is_off_keeps_the_newest_steps(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    clock: str,
    where: str,
) -> None:
    """Steps 1-3 (keep_last=3), a crash, a restart with the clock ten minutes off that
    restores step 3 and saves 4-6: retention keeps 4-6, and the newest is 6."""
    first_clock, next_clock = CLOCKS[clock]
    options: dict[str, Any] = {}
    env: dict[str, str] = {}
    target = str(tmp_path / "run")
    if where == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        target, options, env = (
            f"s3://{server.fresh_prefix()}/run",
            server.storage_options,
            server.env,
        )
    _crashed_run(target, first_clock, env)
    _skew(monkeypatch, next_clock)
    with CheckpointManager(target, keep_last=3, storage_options=options) as mgr:
        mgr.restore()
        assert mgr.last_restore is not None and mgr.last_restore.step == 3
        for step in (4, 5, 6):
            mgr.save(step, state(step)).wait()
    with CheckpointManager(target, storage_options=options) as reader:
        assert reader.steps() == [4, 5, 6]
        assert reader.latest_step() == 6
        assert same(reader.restore(), state(6))


@pytest.mark.parametrize("clock", sorted(CLOCKS))
def test_a_clock_that_jumps_within_a_run_reorders_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: str
) -> None:
    """The clock jumps ten minutes (back, or back from ahead) between two saves of one run:
    retention keeps the run's newest three steps and a resume takes the newest."""
    first_clock, next_clock = CLOCKS[clock]
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        _skew(monkeypatch, first_clock)
        for step in (1, 2):
            mgr.save(step, state(step)).wait()
        _skew(monkeypatch, next_clock)
        for step in (3, 4, 5):
            mgr.save(step, state(step)).wait()
    with CheckpointManager(tmp_path) as reader:  # after close: retention is done
        assert reader.runs() == {mgr.run_id: [3, 4, 5]}
        assert reader.latest_step() == 5
        assert same(reader.restore(), state(5))


@pytest.mark.parametrize("clock", sorted(CLOCKS))
def test_a_fresh_run_is_the_newest_run_whatever_the_clocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: str
) -> None:
    """A fresh run beside an older run's steps 600-620, one of the two clocks ten minutes
    off: the fresh run is the newest, and each run keeps its own newest two."""
    first_clock, next_clock = CLOCKS[clock]
    _skew(monkeypatch, first_clock)
    with CheckpointManager(tmp_path, keep_last=2) as old:
        for step in (600, 610, 620):
            old.save(step, state(step)).wait()
    _skew(monkeypatch, next_clock)
    with CheckpointManager(tmp_path, keep_last=2) as new:
        for step in (1, 2, 3):
            new.save(step, state(step)).wait()
    with CheckpointManager(tmp_path) as reader:
        assert reader.runs() == {new.run_id: [2, 3], old.run_id: [610, 620]}
        assert list(reader.runs()) == [new.run_id, old.run_id]  # newest run first
        assert reader.latest_step() == 3
        assert same(reader.restore(), state(3))


def _save_and_upload(mgr: CheckpointManager, step: int) -> None:
    """Save ``step`` and wait until it is in the remote tier too (not superseded)."""
    mgr.save(step, state(step)).wait()
    assert mgr.remote is not None and mgr.remote.flush(timeout_s=120)


@pytest.mark.parametrize("clock", sorted(CLOCKS))
def test_the_tiers_are_ordered_by_commit_not_by_clock(
    tmp_path: Path,
    s3_server: S3Server,
    s3_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    clock: str,
) -> None:
    """Node 1 saves steps 1-3 to its disk and the bucket; node 2 (empty disk), one of the
    two clocks ten minutes off, resumes step 3 from the bucket and saves 4-6. The bucket's
    retention keeps 4-6, and node 1, back with its own older steps, resumes step 6 from the
    bucket (and ``coci ls`` says so)."""
    first_clock, next_clock = CLOCKS[clock]
    url, options = f"s3://{s3_prefix}/run", s3_server.storage_options
    tiers: dict[str, Any] = {
        "keep_last": 3,
        "remote": url,
        "remote_keep_last": 3,
        "remote_storage_options": options,
    }
    _skew(monkeypatch, first_clock)
    with CheckpointManager(tmp_path / "node1", **tiers) as mgr:
        for step in (1, 2, 3):
            _save_and_upload(mgr, step)
    _skew(monkeypatch, next_clock)
    with CheckpointManager(tmp_path / "node2", **tiers) as mgr:
        mgr.restore()
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.tier) == (3, "remote")
        for step in (4, 5, 6):
            _save_and_upload(mgr, step)
    with CheckpointManager(url, storage_options=options) as bucket:
        assert bucket.steps() == [4, 5, 6]
    with CheckpointManager(tmp_path / "node1", **tiers) as mgr:
        assert mgr.steps() == [1, 2, 3]
        assert mgr.latest_step() == 6
        restored = mgr.restore()
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.tier) == (6, "remote")
    assert same(restored, state(6))
    listed = s3_server.run_coci("ls", str(tmp_path / "node1"), "--remote", url)
    assert listed.returncode == 0, listed.stderr
    assert _marked(listed.stdout) == [["remote", "6"]]


# --- tier fallback with damage ----------------------------------------------------------------


def _damage(root: Path, step: int, how: str) -> None:
    """Flip one byte of the step's data or manifest, or delete the step."""
    directory = root / step_dir_name(step)
    if how == "deleted":
        shutil.rmtree(directory)
        return
    path = directory / ("data-r0.bin" if how == "data-byte" else MANIFEST_NAME)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _marked(ls_output: str, words: int = 2) -> list[list[str]]:
    """The first ``words`` words (tier and step, or the step) of each line of ``coci ls``
    marked as the one a resume takes."""
    lines = ls_output.splitlines()
    return [line.split()[:words] for line in lines if "a resume takes" in line]


def _line_of(ls_output: str, *first: str) -> str:
    (line,) = [x for x in ls_output.splitlines() if x.split()[: len(first)] == list(first)]
    return line


def _exported(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


def _saved_steps_1_to_3(local: Path, url: str | None, options: dict[str, Any]) -> None:
    tiers: dict[str, Any] = {"remote": url, "remote_storage_options": options} if url else {}
    with CheckpointManager(local, keep_last=None, **tiers) as mgr:
        for step in (1, 2, 3):
            if url:
                _save_and_upload(mgr, step)
            else:
                mgr.save(step, state(step)).wait()


@pytest.mark.parametrize("how", DAMAGES)
def test_ls_and_export_take_the_step_a_resume_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """One tier, its newest step damaged (or gone): ``coci ls`` marks the step restore takes
    and shows the damaged one as damaged; ``coci export`` without ``--step`` exports it."""
    _saved_steps_1_to_3(tmp_path, None, {})
    _damage(tmp_path, 3, how)
    with CheckpointManager(tmp_path) as mgr:
        restored = mgr.restore()
        assert mgr.last_restore is not None and mgr.last_restore.step == 2
    assert same(restored, state(2))
    capsys.readouterr()
    assert cli.main(["ls", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert _marked(listed, words=1) == [["2"]]
    if how != "deleted":
        assert "damaged" in _line_of(listed, "3")
    out = tmp_path / "out.pt"
    assert cli.main(["export", str(tmp_path), str(out)]) == 0
    assert "step 2" in capsys.readouterr().out
    assert same(_exported(out)["w"], state(2)["w"]) and _exported(out)["step"] == 2


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_local_newest_is_taken_from_the_remote(
    tmp_path: Path, s3_server: S3Server, s3_prefix: str, how: str
) -> None:
    """Steps 1-3 on the disk and in the bucket, the disk's step 3 damaged (or gone): the
    manager's restore (strict too), ``coci ls --remote`` and ``coci export --remote`` take the
    bucket's intact step 3."""
    local, url, options = tmp_path / "local", f"s3://{s3_prefix}/run", s3_server.storage_options
    _saved_steps_1_to_3(local, url, options)
    _damage(local, 3, how)
    with CheckpointManager(local, remote=url, remote_storage_options=options) as mgr:
        assert mgr.latest_step() == 3
        for strict in (False, True):
            restored = mgr.restore(strict=strict)
            assert mgr.last_restore is not None
            assert (mgr.last_restore.step, mgr.last_restore.tier) == (3, "remote")
            assert same(restored, state(3))
    listed = s3_server.run_coci("ls", str(local), "--remote", url)
    assert listed.returncode == 0, listed.stderr
    assert _marked(listed.stdout) == [["remote", "3"]]
    if how != "deleted":
        assert "damaged" in _line_of(listed.stdout, "local", "3")
    out = tmp_path / "out.pt"
    exported = s3_server.run_coci("export", str(local), str(out), "--remote", url)
    assert exported.returncode == 0, exported.stderr
    assert same(_exported(out)["w"], state(3)["w"]) and _exported(out)["step"] == 3


def test_the_newest_damaged_in_both_tiers_falls_back_to_the_older_step(
    tmp_path: Path, s3_server: S3Server, s3_prefix: str
) -> None:
    """Step 3 damaged on the disk (its data) and in the bucket (its manifest): restore, ls
    and export all take step 2, the local copy."""
    local, url, options = tmp_path / "local", f"s3://{s3_prefix}/run", s3_server.storage_options
    _saved_steps_1_to_3(local, url, options)
    _damage(local, 3, "data-byte")
    fs = s3_server.filesystem()
    key = f"{s3_prefix}/run/{step_dir_name(3)}/{MANIFEST_NAME}"
    manifest = bytearray(fs.cat_file(key))
    manifest[len(manifest) // 2] ^= 0x10
    fs.pipe_file(key, bytes(manifest))
    with CheckpointManager(local, remote=url, remote_storage_options=options) as mgr:
        restored = mgr.restore()
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.tier) == (2, "local")
        assert mgr.last_restore.skipped_steps == (3,)
    assert same(restored, state(2))
    listed = s3_server.run_coci("ls", str(local), "--remote", url)
    assert listed.returncode == 0, listed.stderr
    assert _marked(listed.stdout) == [["local", "2"]]
    assert "damaged" in _line_of(listed.stdout, "local", "3")
    assert "damaged" in _line_of(listed.stdout, "remote", "3")
    out = tmp_path / "out.pt"
    exported = s3_server.run_coci("export", str(local), str(out), "--remote", url)
    assert exported.returncode == 0, exported.stderr
    assert _exported(out)["step"] == 2


class _StartStep(pl.Callback):
    """Records the optimizer step training starts at (the resumed checkpoint's)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def _lightning_fit(root: Path, url: str, options: dict[str, Any], steps: int, resume: bool) -> int:
    pl.seed_everything(1, verbose=False)
    started = _StartStep()
    coci = CociCheckpoint(
        root / "local",
        policy="every_n_steps",
        every_n_steps=3,
        save_on_train_end=False,
        keep_last=None,
        resume=resume,
        remote=url,
        remote_storage_options=options,
        remote_upload_every=1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[coci, started],
    )
    trainer.fit(DigitsModel())
    assert started.step is not None
    return started.step


@pytest.mark.parametrize("how", DAMAGES)
def test_lightning_resumes_the_remotes_intact_newest(
    tmp_path: Path, s3_server: S3Server, s3_prefix: str, how: str
) -> None:
    """A Lightning run saves steps 3, 6, 9 to its disk (and 9 to the bucket); with the disk's step 9
    damaged (or gone), ``CociCheckpoint(resume=True)`` resumes step 9 from the bucket."""
    url, options = f"s3://{s3_prefix}/run", s3_server.storage_options
    assert _lightning_fit(tmp_path, url, options, 9, resume=False) == 0
    with CheckpointManager(url, storage_options=options) as bucket:
        assert bucket.steps()[-1] == 9  # (an upload may be superseded by the next)
    _damage(tmp_path / "local", 9, how)
    assert _lightning_fit(tmp_path, url, options, 10, resume=True) == 9


def _accelerate_run(root: Path, url: str, options: dict[str, Any], steps: int) -> int:
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(root),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = CociCheckpointer(
        accelerator,
        root / "local",
        policy="every_n_steps",
        every_n_steps=3,
        keep_last=None,
        save_on_close=False,
        remote=url,
        remote_storage_options=options,
        remote_upload_every=1,
    )
    start = ckpt.resume()
    for step in range(start + 1, steps + 1):
        accelerator.backward(model(torch.full((4, 8), float(step))).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step(step)
    ckpt.close()
    AcceleratorState._reset_state(reset_partial_state=True)
    return start


@pytest.mark.parametrize("how", DAMAGES)
def test_accelerate_resumes_the_remotes_intact_newest(
    tmp_path: Path, s3_server: S3Server, s3_prefix: str, how: str
) -> None:
    """An Accelerate run saves steps 3, 6, 9 to its disk (and 9 to the bucket); with the disk's step
    9 damaged (or gone), ``CociCheckpointer.resume()`` resumes step 9 from the bucket."""
    url, options = f"s3://{s3_prefix}/run", s3_server.storage_options
    assert _accelerate_run(tmp_path, url, options, 9) == 0
    with CheckpointManager(url, storage_options=options) as bucket:
        assert bucket.steps()[-1] == 9  # (an upload may be superseded by the next)
    _damage(tmp_path / "local", 9, how)
    assert _accelerate_run(tmp_path, url, options, 10) == 9
