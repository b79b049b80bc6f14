"""CociCheckpointer under Accelerate's FSDP2 on a 2-D mesh, ``ParallelismConfig(dp_shard_size=2,
tp_size=2)``: an MLP block tensor-parallel over ``tp`` (``ColwiseParallel`` /
``RowwiseParallel``), a LayerNorm and a head that are not, FSDP2 over ``dp_shard``, AdamW, on 4
CPU processes with gloo. A run SIGKILLed mid-epoch resumes bit-identical to one never stopped.

What Accelerate 1.15 cannot do here, and what the child does instead (``_fsdp2_tp_child``):

- On CPU it ignores the FSDP plugin (the type stays ``MULTI_CPU``) and then refuses the
  ``ParallelismConfig`` in the ``Accelerator`` constructor (``_validate_accelerator``: only
  FSDP2, ``MULTI_<accelerator>`` or DeepSpeed). The child makes the Accelerator with the FSDP
  plugin alone, forces the FSDP type, and attaches the config and its mesh as the constructor
  would (``get_device_mesh``, ``_validate_accelerator``: Accelerate's own code).
- ``prepare``'s tensor-parallel step (``Accelerator._prepare_tp``, FSDP2 branch) imports
  ``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5
  removed: with transformers 5 it raises ImportError on any device. The child supplies the
  class as transformers 4 defined it (inputs replicated DTensors, outputs local).

The rest is Accelerate's path unchanged: the norm's and head's parameters become DTensors
replicated over ``tp``, then ``fully_shard`` over ``dp_shard`` makes every parameter a 2-D
DTensor on ``("dp_shard_cp", "tp")`` (``(Shard(0), Replicate())`` for the layers that are not
tensor-parallel, ``_StridedShard`` for the column-parallel one). Three launches of 4 processes:
one never stopped, one killed, one resumed.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from tests.harness.processes import Child, free_port, module, rank_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]

MODULE = "tests.accelerate._fsdp2_tp_child"
WORLD = 4
TOTAL = 8
KILL = 7  # in the second epoch (6 steps per epoch: 48 samples, batches of 4, 2 dp_shard ranks)


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
            assert p.wait(240) == 0
    assert sorted(results) == list(range(WORLD))
    return [results[r] for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp2_tp")
    expected = _run(root / "uninterrupted")
    directory = root / "run"
    _run(directory, kill_at=KILL)
    restored = CheckpointManager(directory, keep_last=None).steps()[-1]
    manifest = json.loads((directory / f"step-{restored:010d}" / "manifest.json").read_text())
    resumed = _run(directory)
    return {"expected": expected, "restored": restored, "manifest": manifest, "resumed": resumed}


def test_accelerate_lays_out_the_2d_recipe(runs: dict[str, Any]) -> None:
    dims = ["dp_shard_cp", "tp"]
    for r in runs["expected"]:
        assert r["start"] == 0
        layout = r["layout"]
        for name in ("norm.weight", "norm.bias", "head.weight", "head.bias"):
            assert layout[name] == [dims, ["S(0)", "R"]], name
        assert layout["down.weight"] == [dims, ["S(0)", "S(1)"]]
        assert layout["up.weight"][0] == dims and layout["up.weight"][1][1] == "S(0)"
    # the two tp ranks of a dp_shard rank train on the same batches, the dp_shard ranks not
    seen = [r["seen"] for r in runs["expected"]]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]


def test_2d_state_is_written_once_over_the_four_processes(runs: dict[str, Any]) -> None:
    """Every model and optimizer tensor's bytes are stored exactly once (the copies that the
    ``tp`` ranks hold of the replicated layers are not written twice)."""
    assert runs["restored"] in (3, 6)  # the persist of step 6 may not have been durable yet
    entries = {e["key"]: e for e in runs["manifest"]["tensors"]}
    keys = [k for k in entries if k.startswith(("/models/0/", "/optimizers/0/state/"))]
    assert len(keys) == 8 + 2 * 8 + 8  # parameters; exp_avg, exp_avg_sq; step (one per param)
    for key in keys:
        entry = entries[key]
        pieces = sorted((p["start"], p["length"]) for p in entry["pieces"])
        full = math.prod(entry["shape"]) * 4
        assert sum(length for _, length in pieces) == full, key
        ends = [start + length for start, length in pieces]
        assert [start for start, _ in pieces] == [0, *ends[:-1]], key  # contiguous, no overlap
    head = entries["/models/0/head.weight"]
    assert sorted(p["file"] for p in head["pieces"]) == [f"data-r{r}.bin" for r in range(4)]


def test_fsdp2_tp_killed_and_resumed_run_is_bit_identical(runs: dict[str, Any]) -> None:
    restored = runs["restored"]
    for before, after in zip(runs["expected"], runs["resumed"], strict=True):
        assert after["start"] == restored
        assert after["layout"] == before["layout"]
        assert (after["model"], after["optim"], after["lr"]) == (
            before["model"],
            before["optim"],
            before["lr"],
        )
        assert after["seen"] == before["seen"][restored * 4 :]
