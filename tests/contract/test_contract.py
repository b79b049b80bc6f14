"""The contract every framework adapter keeps, run on each through its driver (drivers.py):
a run SIGKILLed mid-epoch resumes bit-identical to a run never stopped, each remaining sample
once, from a local directory and from an ``s3://`` one; ``policy="every_n_steps"`` commits
exactly the planned steps and the final one, and the framework writes no checkpoint of its own;
``coci report`` reads the run's telemetry and names those checkpoints; the user reads coci's
lines once each, on stderr, also from two processes whose model FSDP2 shards (gloo, CPU), each
of which writes its share; such a run SIGKILLed and resumed is bit-identical too, each process
having written its own pieces of the sharded weights; the adapter takes the shared options as
declared once.

Each driver's runs never stopped (in one process; in two with FSDP2) are made once
(``reference``, ``sharded_reference``, module-scoped) and read by every test; the runs are the
real framework's, in child processes, killed with a real SIGKILL."""

from __future__ import annotations

import math
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.commands import cli
from coci_core.training import signature_drift
from tests.contract.drivers import DRIVERS, AdapterDriver, Outcome
from tests.harness.processes import Child, child_env, run
from tests.harness.s3 import S3Server


@dataclass(frozen=True)
class Plan:
    """The steps of a driver's runs in ``processes`` processes: a save every quarter epoch, a
    kill one step past the first save of epoch 2, and an end one step into epoch 3 (not a
    planned save)."""

    every: int
    kill: int
    total: int
    epoch: int  # steps an epoch
    batch: int  # samples a step, over all processes

    @classmethod
    def of(cls, driver: AdapterDriver, processes: int = 1) -> Plan:
        epoch = driver.steps_per_epoch // processes
        every = max(epoch // 4, 1)
        batch = driver.batch * processes
        return cls(
            every=every, kill=epoch + every + 1, total=2 * epoch + 1, epoch=epoch, batch=batch
        )

    def options(self) -> dict[str, Any]:
        return {
            "policy": "every_n_steps",
            "every_n_steps": self.every,
            "keep_last": None,
            "verbose": True,
        }

    def saves(self) -> list[int]:
        """The steps a run to the end commits: the multiples of ``every`` and the last."""
        return [*range(self.every, self.total, self.every), self.total]


@dataclass(frozen=True)
class Reference:
    directory: Path
    outcome: Outcome
    stdout: str
    stderr: str


@pytest.fixture(scope="module", params=DRIVERS, ids=lambda d: d.name)
def driver(request: pytest.FixtureRequest) -> AdapterDriver:
    chosen: AdapterDriver = request.param
    return chosen


@pytest.fixture(scope="module")
def reference(driver: AdapterDriver, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The driver's run never stopped, its checkpoints kept."""
    plan = Plan.of(driver)
    directory = tmp_path_factory.mktemp(f"{driver.name}-reference")
    done = run(driver.command(directory, plan.total, plan.options()), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return Reference(directory, driver.outcome(done.stdout), done.stdout, done.stderr)


SHARDED_ENV = {"OMP_NUM_THREADS": "1"}  # two processes share the machine's cores


@pytest.fixture(scope="module")
def sharded_reference(driver: AdapterDriver, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The driver's run in two processes (gloo) whose model FSDP2 shards, never stopped, its
    checkpoints kept."""
    plan = Plan.of(driver, processes=2)
    directory = tmp_path_factory.mktemp(f"{driver.name}-fsdp2")
    command = driver.command(directory, plan.total, plan.options(), processes=2, fsdp2=True)
    done = run(command, env=child_env(SHARDED_ENV), timeout_s=300, cwd=directory)
    assert done.returncode == 0, done.stderr[-3000:]
    return Reference(directory, driver.outcome(done.stdout), done.stdout, done.stderr)


def _kill_then_resume(
    driver: AdapterDriver,
    directory: Path,
    options: dict[str, Any],
    *,
    where: str | None = None,
    env: dict[str, str] | None = None,
    storage_options: dict[str, Any] | None = None,
    plan: Plan | None = None,
    **launch: Any,
) -> tuple[list[int], Outcome]:
    """Train in ``directory`` (checkpoints in ``where``, by default its ``coci``; ``launch``:
    the command's ``processes`` and ``fsdp2``), SIGKILL the processes one step past the first
    save of epoch 2, then train again to the end: the steps committed at the kill and the
    second run's outcome. The processes run in ``directory``'s parent."""
    plan = plan or Plan.of(driver)
    cwd = directory.parent
    command = driver.command(directory, plan.total, options, kill_at=plan.kill, **launch)
    with Child(command, env=env, stderr=subprocess.DEVNULL, kill_scope="tree", cwd=cwd) as child:
        assert child.kill_at(f"AT {plan.kill}") == -signal.SIGKILL
    where = where or str(directory / "coci")
    with CheckpointManager(where, storage_options=storage_options, keep_last=None) as mgr:
        steps = mgr.steps()
    command = driver.command(directory, plan.total, options, resume=True, **launch)
    done = run(command, env=env, timeout_s=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return steps, driver.outcome(done.stdout)


def _assert_resumed_exactly(
    plan: Plan, steps: list[int], resumed: Outcome, expected: Outcome
) -> None:
    """The run resumed from the newest committed step ends as the run never stopped."""
    # the newest planned save, or an older one if its writer was still at work at the kill
    assert steps and steps[-1] <= plan.kill and steps[-1] % plan.every == 0
    start = steps[-1]
    assert resumed.start == start
    assert resumed.state == expected.state
    assert resumed.seen == expected.seen[start * plan.batch :]
    assert resumed.history == expected.history
    # the epoch of the checkpoint (epoch 2, or 1 if the writer lagged), trained partly before
    # it and partly after the resume (by every process): each sample of the data set once
    assert len(expected.seen) == plan.total * plan.batch
    size, at = plan.epoch * plan.batch, start * plan.batch
    first = at // size * size
    interrupted = expected.seen[first:at] + resumed.seen[: first + size - at]
    assert sorted(interrupted) == sorted(expected.seen[:size]) == sorted(set(expected.seen))


@pytest.mark.faults
def test_sigkill_mid_epoch_then_resume_is_bit_identical(
    driver: AdapterDriver, reference: Reference, tmp_path: Path
) -> None:
    """SIGKILL one step past the first save of epoch 2; a new process resumes from the newest
    committed step and ends with the model and optimizer of the run never stopped (and the
    framework's record of the run), having trained on each remaining sample once, in order."""
    options = Plan.of(driver).options()
    steps, resumed = _kill_then_resume(driver, tmp_path / "run", options)
    _assert_resumed_exactly(Plan.of(driver), steps, resumed, reference.outcome)


@pytest.mark.faults
def test_sigkill_with_an_s3_dirpath_then_resume(
    driver: AdapterDriver,
    reference: Reference,
    s3_server: S3Server,
    s3_prefix: str,
    tmp_path: Path,
) -> None:
    """The same with ``dirpath="s3://..."`` (credentials and endpoint from the ``AWS_*``
    variables only, as a user's shell gives them): the run resumes from the bucket exactly,
    and nothing of coci's lands on local disk (no ``coci`` folder, no folder named ``s3:``)."""
    url = f"s3://{s3_prefix}/run"
    options = {**Plan.of(driver).options(), "dirpath": url}
    env = child_env(s3_server.env, drop_prefixes=("AWS_", "FSSPEC_"))
    steps, resumed = _kill_then_resume(
        driver,
        tmp_path / "run",
        options,
        where=url,
        env=env,
        storage_options=s3_server.storage_options,
    )
    _assert_resumed_exactly(Plan.of(driver), steps, resumed, reference.outcome)
    local = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")]
    assert not [p for p in local if "s3:" in p or "coci" in p], local


def test_planned_saves_are_exactly_the_multiples_and_the_final_step(
    driver: AdapterDriver, reference: Reference
) -> None:
    """``policy="every_n_steps", every_n_steps=K``: the committed steps are the multiples of K
    and the last step, and beside coci's directory the framework wrote no checkpoint."""
    plan = Plan.of(driver)
    with CheckpointManager(reference.directory / "coci", keep_last=None) as mgr:
        assert mgr.steps() == plan.saves()
    assert sorted(p.name for p in reference.directory.iterdir()) == ["coci"]


def test_report_reads_the_runs_telemetry(
    driver: AdapterDriver, reference: Reference, capsys: pytest.CaptureFixture[str]
) -> None:
    """``coci report`` on the run's directory names its committed checkpoints, and the run
    wrote TensorBoard events for coci's tab. (The command runs in this process: a process of
    its own costs two seconds a driver and tests nothing more.)"""
    plan = Plan.of(driver)
    coci = reference.directory / "coci"
    assert cli.main(["report", str(coci)]) == 0
    steps = plan.saves()
    assert f"checkpoints committed: {len(steps)} at steps {steps}" in capsys.readouterr().out
    assert list((coci / "tensorboard").glob("events.out.tfevents.*"))


def test_the_user_reads_each_line_once_on_stderr(
    driver: AdapterDriver, reference: Reference
) -> None:
    """With no logging configured and ``verbose=True``: one plan line (in the words every
    adapter uses, naming this adapter's class), one line per save and one summary, on stderr
    (as the framework's own messages), none on stdout."""
    plan = Plan.of(driver)
    lines = [line for line in reference.stderr.splitlines() if line.startswith("coci: ")]
    (told,) = [line for line in lines if line.startswith("coci: plan ")]
    assert re.match(r"coci: plan at step \d+ \(every_n_steps policy, time objective\)", told)
    assert f"then every {plan.every} steps" in told and f"{driver.adapter.__name__}(" in told
    saved = [line for line in lines if " saved: stall " in line]
    assert [int(line.split()[2]) for line in saved] == plan.saves(), lines
    assert all(" MB written" in line for line in saved)
    (summary,) = [line for line in lines if "checkpoints committed" in line]
    count = len(plan.saves())
    assert summary.startswith(f"coci: {count} checkpoints committed (newest step {plan.total})")
    assert "coci:" not in reference.stdout


@pytest.mark.slow
@pytest.mark.dist
def test_two_processes_each_write_their_share_and_rank_0_alone_speaks(
    driver: AdapterDriver, sharded_reference: Reference
) -> None:
    """Two processes (gloo, FSDP2) on one stderr: every planned step committed with both
    processes' shares, and the user reads coci's lines once each, as from one process (rank
    0's)."""
    plan = Plan.of(driver, processes=2)
    lines = [line for line in sharded_reference.stderr.splitlines() if line.startswith("coci: ")]
    assert len([line for line in lines if line.startswith("coci: plan ")]) == 1, lines
    saved = [line for line in lines if " saved: stall " in line]
    assert [int(line.split()[2]) for line in saved] == plan.saves(), lines
    (summary,) = [line for line in lines if "checkpoints committed" in line]
    assert summary.startswith(f"coci: {len(plan.saves())} checkpoints committed")
    assert "(this rank's share)" in summary
    assert "coci:" not in sharded_reference.stdout
    with CheckpointManager(sharded_reference.directory / "coci", keep_last=None) as mgr:
        assert mgr.steps() == plan.saves()
        manifest = mgr.manifest(plan.total)
    assert manifest.world_size == 2 and len(manifest.per_rank) == 2
    assert sorted(f.name.split("-")[1].removesuffix(".bin") for f in manifest.files) == ["r0", "r1"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.faults
def test_fsdp2_sigkill_mid_epoch_then_resume_is_bit_identical(
    driver: AdapterDriver, sharded_reference: Reference, tmp_path: Path
) -> None:
    """Two processes (gloo, CPU) whose model FSDP2 shards, as the framework's users shard it,
    SIGKILLed one step past the first save of epoch 2: two new processes resume from the newest
    committed step and end with the model and optimizer of the run never stopped (and the
    framework's record of the run), the two having trained on each remaining sample once. The
    state was sharded (DTensors) in both runs, and in the checkpoint each sharded weight and
    moment lies in both processes' data files, each byte once."""
    plan = Plan.of(driver, processes=2)
    directory = tmp_path / "run"
    env = child_env(SHARDED_ENV)
    steps, resumed = _kill_then_resume(
        driver, directory, plan.options(), env=env, plan=plan, processes=2, fsdp2=True
    )
    _assert_resumed_exactly(plan, steps, resumed, sharded_reference.outcome)
    assert sharded_reference.outcome.sharded and resumed.sharded
    with CheckpointManager(directory / "coci", keep_last=None) as mgr:
        manifest = mgr.manifest(steps[-1])
    assert manifest.world_size == 2
    split = [
        e for e in manifest.tensors if {p.file for p in e.pieces} == {"data-r0.bin", "data-r1.bin"}
    ]
    assert any(e.key.endswith("weight") for e in split), [e.key for e in manifest.tensors]
    assert any(e.key.endswith("weight/exp_avg") for e in split), [e.key for e in split]
    for entry in split:  # each byte once: the processes' pieces tile the tensor
        itemsize = getattr(torch, entry.dtype).itemsize
        assert sum(p.length for p in entry.pieces) == math.prod(entry.shape) * itemsize, entry


def test_the_adapter_takes_the_declared_options(driver: AdapterDriver) -> None:
    """The adapter spells its signature out (for IDEs and LightningCLI), and it takes every
    shared option as declared once, by CheckpointOptions.check: keyword-only, with the same
    default and annotation."""
    assert signature_drift(driver.adapter) == []
