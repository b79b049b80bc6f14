"""CociTracker and CociCheckpointer on a real Accelerator (CPU): resume, ranks, errors."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from coci_accelerate import CociCheckpointer, CociTracker
from coci_accelerate import _state as accelerate_state
from coci_core import CheckpointError, CheckpointManager, CociError, ConfigError
from coci_core.telemetry import read_jsonl
from coci_core.telemetry.timeline import find_runs
from tests.accelerate.loop import digits, train
from tests.harness.faults import flip_stored_byte
from tests.harness.processes import Child, free_port, module, run
from tests.harness.results import result_rows

BATCH = 16
SAMPLES = 512
STEPS_PER_EPOCH = SAMPLES // BATCH


def _results(stdout: str) -> dict[int, dict[str, Any]]:
    return {row["rank"]: row for row in result_rows(stdout)}


def _kill_and_resume(
    command: list[str],
    directory: Path,
    total: int,
    kill: int,
    damage: Callable[[Path, list[int]], None] | None = None,
) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """Run ``command`` until it prints ``AT kill``, then SIGKILL it and all its workers at
    once (torchrun starts them in sessions of their own), as a node failure would; run it
    again to its end (after ``damage`` to the checkpoint directory and its steps). The steps
    committed at the kill, and the second run's results."""
    with Child(
        [*command, str(directory), str(total), str(kill)],
        stderr=subprocess.DEVNULL,
        kill_scope="tree",
    ) as child:
        child.kill_at(f"AT {kill}")
    steps = CheckpointManager(directory / "coci", keep_last=None).steps()
    if damage is not None:
        damage(directory / "coci", steps)
    out = run([*command, str(directory), str(total)], timeout_s=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return steps, _results(out.stdout)


class _Stop(Exception):
    pass


def _stop(accelerator: Accelerator) -> None:
    raise _Stop


def test_in_process_resume_is_bit_exact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop stopped after step 43 and resumed (from 40, in epoch 2) ends bit-identical, trains
    on exactly the samples the uninterrupted loop did after step 40, and says where it
    restored from (the directory's absolute path, though the run named it relatively)."""
    monkeypatch.chdir(tmp_path)
    reference = train(str(tmp_path / "ref"), 70)
    AcceleratorState._reset_state(True)
    with pytest.raises(_Stop):
        train(str(tmp_path / "run"), 70, kill_at=43, on_kill=_stop)
    AcceleratorState._reset_state(True)
    with caplog.at_level("INFO", logger="coci_accelerate"):
        resumed = train("run", 70)
    assert resumed["start"] == 40  # close() waits until the save at 40 is durable
    assert f"coci: Accelerate restores step 40 from {tmp_path / 'run' / 'coci'}" in caplog.text
    assert resumed["digest"] == reference["digest"]
    assert resumed["seen"] == reference["seen"][resumed["start"] * BATCH :]


@pytest.mark.slow
@pytest.mark.dist
def test_sigkill_two_processes_resume_one_step_past_one_ranks_damage(tmp_path: Path) -> None:
    """The same with 2 processes (torchrun, gloo), the newest step's random states of rank 1
    damaged on disk: both processes resume the step before (the newest intact for both), end
    bit-identical and see each of their remaining samples once."""
    port = str(free_port())  # not torchrun's default 29500, which another test may hold
    command = module(
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        port,
        "-m",
        "tests.accelerate.loop",
    )
    expected = _results(
        run([*command, str(tmp_path / "ref"), "40"], timeout_s=600, check=True).stdout
    )

    def damage(directory: Path, steps: list[int]) -> None:
        flip_stored_byte(directory, steps[-1], 1, own=True)

    steps, resumed = _kill_and_resume(command, tmp_path / "run", 40, 23, damage)
    assert len(steps) >= 2 and steps[-1] <= 23 and steps[-1] % 5 == 0  # older: writer lagged
    with CheckpointManager(tmp_path / "run" / "coci") as mgr:
        manifest = mgr.manifest(mgr.steps()[-1])
    # both processes wrote their share, and each its own random states
    assert manifest.world_size == 2
    assert [f.name for f in manifest.files] == ["data-r0.bin", "data-r1.bin"]
    assert all(f.nbytes > 0 for f in manifest.files)
    assert len(manifest.per_rank) == 2 and all(r.tree for r in manifest.per_rank)
    start = steps[-2]
    for rank in (0, 1):
        assert resumed[rank]["digest"] == expected[rank]["digest"]
        # 2 processes: each takes half of every global batch of 2 x 16
        assert resumed[rank]["seen"] == expected[rank]["seen"][start * BATCH :]


def _accelerator(tmp_path: Path, **kwargs: Any) -> Accelerator:
    return Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
        **kwargs,
    )


def _prepared(accelerator: Accelerator) -> tuple[Any, Any]:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def test_tracker_losses_reach_the_planner_and_tensorboard(tmp_path: Path) -> None:
    """Losses given to accelerator.log reach the planner (its telemetry records them) and the
    TensorBoard scalars are written."""
    accelerator = _accelerator(tmp_path, log_with=[CociTracker()])
    accelerator.init_trackers("t")
    model, optimizer = _prepared(accelerator)
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=10)
    ckpt.checkpointer.telemetry_every_n_steps = 1
    for step in range(25):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": 1.0 / (step + 1)}, step=step + 1)
        ckpt.step(step + 1)
    ckpt.close()
    records = read_jsonl(tmp_path / "coci" / "telemetry.jsonl")
    losses = {r["step"]: r["loss"] for r in records if r["type"] == "loss"}
    assert losses[8] == pytest.approx(1 / 8)
    assert [r["step"] for r in records if r["type"] == "save"] == [10, 20, 25]  # 25: close()
    acc = EventAccumulator(str(tmp_path / "coci" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("coci/stall_ms")] == [10, 20, 25]


def test_save_state_carries_the_planner_state(tmp_path: Path) -> None:
    """accelerator.save_state / load_state take the planner's estimates along."""
    accelerator = _accelerator(tmp_path)
    _prepared(accelerator)
    ckpt = CociCheckpointer(accelerator)
    for step in range(30):
        ckpt.checkpointer.observe(step, loss=2.0 - step / 30, step_time_s=0.05)
    saved = ckpt.checkpointer.planner.state_dict()
    accelerator.save_state(str(tmp_path / "state"))
    ckpt.close()
    AcceleratorState._reset_state(True)
    accelerator = _accelerator(tmp_path / "other")
    _prepared(accelerator)
    other = CociCheckpointer(accelerator)
    accelerator.load_state(str(tmp_path / "state"))
    assert other.checkpointer.planner.state_dict() == saved
    other.close()


def test_load_state_carries_the_step_count(tmp_path: Path) -> None:
    """After accelerator.load_state, coci's count of optimizer steps is the saved one, so the
    loop's restored overall_step is accepted by ckpt.step(overall_step)."""
    accelerator = _accelerator(tmp_path)
    model, optimizer = _prepared(accelerator)
    ckpt = CociCheckpointer(accelerator, save_on_close=False)
    for _ in range(3):
        accelerator.backward(model(torch.ones(1, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step()
    accelerator.save_state(str(tmp_path / "state"))
    ckpt.close()
    AcceleratorState._reset_state(True)
    accelerator = _accelerator(tmp_path / "other")
    model, optimizer = _prepared(accelerator)
    other = CociCheckpointer(accelerator, save_on_close=False)
    try:
        accelerator.load_state(str(tmp_path / "state"))
        assert other.completed_steps == 3
        accelerator.backward(model(torch.ones(1, 4)).sum())
        optimizer.step()
        other.step(4)
    finally:
        other.close()


def test_step_before_prepare_is_refused(tmp_path: Path) -> None:
    """ckpt.step() before accelerator.prepare() says what to do."""
    ckpt = CociCheckpointer(_accelerator(tmp_path))
    with pytest.raises(CociError, match=r"call accelerator\.prepare"):
        ckpt.step(0)
    ckpt.close()


def test_foreign_layout_and_world_size_change_are_refused(tmp_path: Path) -> None:
    """A directory of another layout, other prepared objects or another number of processes
    gives a clear error instead of a half-restored run."""
    with CheckpointManager(tmp_path / "coci") as mgr:
        mgr.save(3, {"state_dict": {"w": torch.ones(2)}, "global_step": 3})
    accelerator = _accelerator(tmp_path)
    _prepared(accelerator)
    ckpt = CociCheckpointer(accelerator)
    with pytest.raises(CheckpointError, match="not written by coci_accelerate"):
        ckpt.resume()
    ckpt.close()
    state = {
        **accelerate_state.collect(accelerator, 5),
        accelerate_state.PROCESS_KEY: accelerate_state.collect_own(accelerator, skip=ckpt),
    }
    with pytest.raises(CheckpointError, match="written by 2 processes and this run has 1"):
        accelerate_state.apply(accelerator, {**state, "num_processes": 2}, skip=ckpt)
    with pytest.raises(CheckpointError, match="models: 2 at the save, 1 now"):
        accelerate_state.apply(accelerator, {**state, "models": state["models"] * 2}, skip=ckpt)
    # the registered objects are named: coci's own CociCheckpointer is one of them
    own = {**state[accelerate_state.PROCESS_KEY], "custom": []}
    with pytest.raises(
        CheckpointError,
        match=r"registered objects: 0 at the save, 1 now \(CociCheckpointer\).*another dirpath",
    ):
        accelerate_state.apply(accelerator, {**state, accelerate_state.PROCESS_KEY: own}, skip=ckpt)
    # another optimizer's state (AdamW's into this run's SGD): named, not torch's KeyError later
    adamw = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters()).state_dict()
    with pytest.raises(ConfigError, match=r"this run's optimizer \(SGD\).*lacks .*momentum"):
        accelerate_state.apply(accelerator, {**state, "optimizers": [adamw]}, skip=ckpt)
    # another model's weights: torch's lines, with the model named and what to do
    other = torch.nn.Linear(4, 3).state_dict()
    with pytest.raises(
        ConfigError, match=r"(?s)this run's model \(Linear\).*size mismatch.*dirpath"
    ):
        accelerate_state.apply(accelerator, {**state, "models": [other]}, skip=ckpt)


def test_inexact_dataloader_configuration_warns(tmp_path: Path) -> None:
    """Without a seedable sampler and a stateful loader, one warning says what to set."""
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="use_seedable_sampler=True"):
        ckpt = CociCheckpointer(accelerator)
    ckpt.close()


def test_bad_arguments(tmp_path: Path) -> None:
    """Bad arguments raise at construction, naming the parameter."""
    from coci_core import ConfigError

    accelerator = _accelerator(tmp_path)
    with pytest.raises(ConfigError, match="'policy'"):
        CociCheckpointer(accelerator, policy="often")
    with pytest.raises(ConfigError, match="'every_n_steps' must be given"):
        CociCheckpointer(accelerator, policy="every_n_steps")
    with pytest.raises(ConfigError, match="'accelerator'"):
        CociCheckpointer("acc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'loss_key'"):
        CociTracker(loss_key="")


def test_panel_goes_through_accelerates_tensorboard_tracker(tmp_path: Path) -> None:
    """With log_with=["tensorboard"], the coci scalars land in Accelerate's own event file."""
    accelerator = _accelerator(tmp_path, log_with=["tensorboard", CociTracker()])
    accelerator.init_trackers("tb")
    model, optimizer = _prepared(accelerator)
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=4)
    for step in range(1, 10):
        accelerator.backward(model(torch.ones(1, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": 1.0}, step=step)
        ckpt.step(step)
    ckpt.close()
    accelerator.end_training()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("coci/stall_ms")] == [4, 8, 9]
    assert "loss" in acc.Tags()["scalars"]
    # the tracker's directory points the coci tab at the checkpoint directory
    assert find_runs(tmp_path / "tb") == {"tb": str(tmp_path / "coci")}
    assert find_runs(tmp_path) == {"coci": str(tmp_path / "coci")}


def test_resume_from_an_epochs_last_batch_is_bit_exact(tmp_path: Path) -> None:
    """A checkpoint taken on the last batch of an epoch (step 32 of 32) resumes at the next
    epoch's start, not into a replay of the finished epoch's order."""
    reference = train(str(tmp_path / "ref"), 70, every_n_steps=32)
    AcceleratorState._reset_state(True)
    with pytest.raises(_Stop):
        train(str(tmp_path / "run"), 70, kill_at=40, on_kill=_stop, every_n_steps=32)
    AcceleratorState._reset_state(True)
    resumed = train(str(tmp_path / "run"), 70, every_n_steps=32)
    assert resumed["start"] == 32
    assert resumed["digest"] == reference["digest"]
    assert resumed["seen"] == reference["seen"][32 * BATCH :]


def test_resume_reads_into_the_prepared_tensors(tmp_path: Path) -> None:
    """resume() fills the prepared model's and optimizer's own tensors (an optimizer that has
    already stepped keeps its moment tensors), bit for bit the checkpoint's values."""
    AcceleratorState._reset_state(True)
    train(str(tmp_path), 10)  # saves at 5 and 10
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    model = torch.nn.Sequential(  # what train() prepares
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    loader = torch.utils.data.DataLoader(digits(), batch_size=BATCH, shuffle=True)
    model, optimizer, _, _ = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.backward(model(torch.randn(4, 64)).sum())
    optimizer.step()  # the optimizer has its state: resume must fill, not replace, it
    optimizer.zero_grad()
    live = [*model.state_dict().values()]
    live += [t for s in optimizer.optimizer.state.values() for t in s.values()]
    ptrs = [t.data_ptr() for t in live]
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=5)
    try:
        assert ckpt.resume() == 10
        with CheckpointManager(ckpt.dirpath) as mgr:
            saved = mgr.restore(step=10)
    finally:
        ckpt.close()
    now = [*model.state_dict().values()]
    now += [t for s in optimizer.optimizer.state.values() for t in s.values()]
    assert [t.data_ptr() for t in now] == ptrs
    for k, t in model.state_dict().items():
        assert torch.equal(t, saved["models"][0][k])
    for i, s in optimizer.optimizer.state_dict()["state"].items():
        for k, t in s.items():
            assert torch.equal(t, saved["optimizers"][0]["state"][i][k])
