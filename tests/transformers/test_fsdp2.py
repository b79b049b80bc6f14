"""FSDP2 through the Trainer (``fsdp="full_shard"``, ``fsdp_config={"version": 2}``) on two
processes (torchrun, gloo): each process saves its own shards, the run SIGKILLed mid-epoch
resumes bit-identical to a run never stopped, and its checkpoint also resumes onto one process
without FSDP, by coci or (exported) by the Trainer itself.

On CPU, Accelerate 1.15 ignores the FSDP plugin (the Trainer would train with DDP); the child's
Trainer forces the FSDP type and plugin (``tests.transformers.run.FSDP2Trainer``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from accelerate.state import AcceleratorState

from coci_core import CheckpointManager
from coci_transformers.export import export_step
from tests.harness.processes import Child, child_env, module, run
from tests.transformers.run import train

COMMAND = module("torch.distributed.run", "--nproc-per-node", "2", "-m", "tests.transformers.run")
BATCH = 4  # per process


def _results(stdout: str, mark: str) -> dict[int, dict[str, Any]]:
    rows = [json.loads(x[len(mark) :]) for x in stdout.splitlines() if x.startswith(mark)]
    return {r["rank"]: r for r in rows}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.faults
def test_fsdp2_through_the_trainer_killed_and_resumed(tmp_path: Path) -> None:
    total, kill = 12, 7  # 4 steps an epoch; saves at 3, 6, 9, 12
    env = child_env({"OMP_NUM_THREADS": "1"})
    with Child(
        [*COMMAND, str(tmp_path / "run"), str(total), str(kill), "--fsdp"],
        env=env,
        stderr=subprocess.DEVNULL,
        kill_scope="tree",
    ) as child:
        child.kill_at(f"AT {kill}")
    with CheckpointManager(tmp_path / "run" / "coci", keep_last=None) as mgr:
        steps = mgr.steps()
    assert steps and steps[-1] <= kill and steps[-1] % 3 == 0
    start = steps[-1]
    # each process wrote its own rows of the sharded weights and moments (33 and 32 of 65)
    step_dir = tmp_path / "run" / "coci" / f"step-{start:010d}"
    entries = {e["key"]: e for e in json.loads((step_dir / "manifest.json").read_text())["tensors"]}
    for key in (
        "/model/transformer.wte.weight",
        "/optimizer/state/transformer.wte.weight/exp_avg",
    ):
        pieces = sorted((p["file"], p["length"]) for p in entries[key]["pieces"])
        assert pieces == [("data-r0.bin", 33 * 32 * 4), ("data-r1.bin", 32 * 32 * 4)]
    shutil.copytree(tmp_path / "run", tmp_path / "one")
    # exported now, as the Trainer's checkpoint-N, whole: the run below goes on in "run" and
    # prunes its older steps (keep_last 3: step 3 is gone by its end, when the kill came before
    # step 6 was committed)
    exported = tmp_path / "exported" / f"checkpoint-{start}"
    summary = export_step(str(tmp_path / "run" / "coci"), exported, start)
    assert summary.startswith(f"exported step {start} "), summary

    # the same processes train a run never stopped, then resume the killed one
    command = [*COMMAND, str(tmp_path / "run"), str(total), "--resume", "--fsdp"]
    out = run([*command, "--reference", str(tmp_path / "ref")], env=env, timeout_s=300)
    assert out.returncode == 0, out.stderr[-3000:]
    expected, resumed = _results(out.stdout, "REFERENCE "), _results(out.stdout, "RESULT ")
    assert sorted(resumed) == [0, 1]
    for rank in (0, 1):
        assert expected[rank]["sharded"] and resumed[rank]["sharded"]
        assert resumed[rank]["start"] == start
        assert resumed[rank]["digest"] == expected[rank]["digest"]
        assert resumed[rank]["seen"] == expected[rank]["seen"][start * BATCH :]

    # onto one process, without FSDP: the weights and optimizer state put back whole from the
    # shards, and the run goes on to its end
    AcceleratorState._reset_state(True)
    one = train(tmp_path / "one", total, resume=True)
    assert one["start"] == start and not one["sharded"]
    assert len(one["seen"]) == (total - start) * BATCH
    history = [e for e in expected[0]["log"] if e.get("step", 0) <= start]
    assert one["log"][: len(history)] == history

    # exported as the Trainer's checkpoint-N (above): the Trainer itself resumes from it on one
    # process (weights, optimizer keyed by index, scheduler) and ends bit-identical to coci's
    # resume (neither put back nothing, nor put back something else)
    # the random states of process 0, as coci's resume onto one process takes them (the
    # Trainer on one process reads rng_state.pth only)
    shutil.copy(exported / "rng_state_0.pth", exported / "rng_state.pth")
    AcceleratorState._reset_state(True)
    native = train(tmp_path / "exported", total, resume=str(exported))
    assert native["digest"] == one["digest"]
