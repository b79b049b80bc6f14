"""CociCheckpointer with a model and optimizer prepared by Accelerate's FSDP plugin
(``fsdp_version=2``), on 2 CPU processes with gloo: each process saves its own shards, and a
run SIGKILLed mid-epoch resumes bit-identical to one never stopped.

Accelerate prepares for FSDP only on accelerators (on CPU it ignores the plugin); the child
forces the FSDP distributed type, which makes ``prepare`` shard the model with ``fully_shard``
(see ``_fsdp2_child``)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from tests.harness.processes import Child, free_port, module, rank_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]

MODULE = "tests.accelerate._fsdp2_child"
WORLD = 2
TOTAL = 14
KILL = 10  # inside the second epoch (12 steps per epoch at 2 processes)


def _run(directory: Path, kill_at: int | None = None) -> list[dict[str, Any]]:
    """Run the processes; with ``kill_at``, SIGKILL them all once process 0 reached that step.
    Their results, by process index (none when killed)."""
    args = [str(directory), str(TOTAL)] + ([str(kill_at)] if kill_at is not None else [])
    port = free_port()
    results: dict[int, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                Child(module(MODULE, *args), env=rank_env(r, WORLD, port, {"LOCAL_RANK": str(r)}))
            )
            for r in range(WORLD)
        ]
        if kill_at is not None:
            for line in procs[0].lines():
                if line.startswith(f"AT {kill_at}"):
                    for p in procs:
                        p.kill()
            assert all(p.wait(60) != 0 for p in procs)
            return []
        for p in procs:
            for line in p.lines():
                if line.startswith("RESULT "):
                    row = json.loads(line[len("RESULT ") :])
                    results[row["rank"]] = row
            assert p.wait(120) == 0
    assert sorted(results) == list(range(WORLD))
    return [results[r] for r in range(WORLD)]


def test_fsdp2_killed_and_resumed_run_is_bit_identical(tmp_path: Path) -> None:
    expected = _run(tmp_path / "uninterrupted")
    assert all(r["sharded"] and r["start"] == 0 for r in expected)

    directory = tmp_path / "run"
    _run(directory, kill_at=KILL)
    steps = CheckpointManager(directory, keep_last=None).steps()
    assert steps[-1] in (6, 9)  # the persist of step 9 may not have been durable yet
    restored = steps[-1]

    # each process wrote its own rows of the sharded weights and moments (17 and 16 of 33)
    manifest = json.loads((directory / f"step-{restored:010d}" / "manifest.json").read_text())
    entries = {e["key"]: e for e in manifest["tensors"]}
    for key in ("/models/0/0.weight", "/optimizers/0/state/0.weight/exp_avg"):
        pieces = entries[key]["pieces"]
        assert sorted((p["file"], p["length"]) for p in pieces) == [
            ("data-r0.bin", 17 * 16 * 4),
            ("data-r1.bin", 16 * 16 * 4),
        ]

    resumed = _run(directory)
    for before, after in zip(expected, resumed, strict=True):
        assert after["start"] == restored
        assert after["sharded"]
        assert (after["model"], after["optim"], after["lr"]) == (
            before["model"],
            before["optim"],
            before["lr"],
        )
        assert after["seen"] == before["seen"][restored * 4 :]
