"""FSDP2 through the Trainer (``fsdp="full_shard"``, ``fsdp_config={"version": 2}``) on two
processes (gloo): a checkpoint of the sharded run resumes onto one process without FSDP, by coci
or (exported) by the Trainer itself. (The sharded run SIGKILLed and resumed on two processes,
bit-identical, is the adapter contract's: tests/contract/test_contract.py.)

On CPU, Accelerate 1.15 ignores the FSDP plugin (the Trainer would train with DDP); the child's
Trainer forces the FSDP type and plugin (``tests.transformers.run.FSDP2Trainer``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState

from coci_core import CheckpointManager
from coci_transformers.export import export_step
from tests.harness.processes import child_env, module, run
from tests.harness.results import result_rows
from tests.transformers.run import BATCH, train

SAVED, TOTAL = 6, 12  # the sharded run saves at 3 and 6; the runs on one process go on to 12


@pytest.mark.slow
@pytest.mark.dist
def test_a_sharded_checkpoint_resumes_onto_one_process_by_coci_and_by_the_trainer(
    tmp_path: Path,
) -> None:
    """Two processes train with FSDP2 to step 6. Its checkpoint resumes onto one process
    without FSDP (the weights and optimizer state put back whole from the shards; the Trainer's
    log history as the sharded run left it) and the run goes on to step 12; exported as the
    Trainer's ``checkpoint-6``, the Trainer itself resumes from it on one process (weights,
    optimizer keyed by index, scheduler) and ends bit-identical to coci's resume (neither put
    back nothing, nor put back something else)."""
    command = module("tests.harness.ranks", "2", "tests.transformers.run")
    done = run(
        [*command, str(tmp_path / "run"), str(SAVED), "--fsdp"],
        env=child_env({"OMP_NUM_THREADS": "1"}),
        timeout_s=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = {row["rank"]: row for row in result_rows(done.stdout)}
    assert sorted(sharded) == [0, 1] and all(row["sharded"] for row in sharded.values())
    with CheckpointManager(tmp_path / "run" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, SAVED]
        manifest = mgr.manifest(SAVED)
    # each process wrote its own rows of the sharded embedding (33 and 32 of 65: uneven)
    entries = {e.key: e for e in manifest.tensors}
    pieces = sorted((p.file, p.length) for p in entries["/model/transformer.wte.weight"].pieces)
    assert pieces == [("data-r0.bin", 33 * 32 * 4), ("data-r1.bin", 32 * 32 * 4)]
    exported = tmp_path / "exported" / f"checkpoint-{SAVED}"
    summary = export_step(str(tmp_path / "run" / "coci"), exported, SAVED)
    assert summary.startswith(f"exported step {SAVED} "), summary

    # onto one process, without FSDP: the run goes on to its end
    AcceleratorState._reset_state(True)
    one = train(tmp_path / "run", TOTAL, resume=True)
    assert one["start"] == SAVED and not one["sharded"]
    assert len(one["seen"]) == (TOTAL - SAVED) * BATCH
    history = [e for e in sharded[0]["log"] if "train_loss" not in e]  # without its summary
    assert one["log"][: len(history)] == history

    # the Trainer on one process reads rng_state.pth only: the random states of process 0, as
    # coci's resume onto one process takes them
    shutil.copy(exported / "rng_state_0.pth", exported / "rng_state.pth")
    AcceleratorState._reset_state(True)
    native = train(tmp_path / "exported", TOTAL, resume=str(exported))
    assert native["digest"] == one["digest"]
