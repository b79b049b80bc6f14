"""One rank of a job whose ranks restore together from delta chains and two tiers.

Saves a ``Shard(0)`` DTensor large enough to be delta-encoded (``compression="lossless"``,
``full_every`` 4: step 1 a base, steps 2 to 4 XOR deltas against it) and per-rank state at
steps 1 to 4; rank 0 makes damaged copies (each rank's node-local disk damaged differently),
then every rank restores its copy of each scenario, with the remote tier the scenario names,
and reports the step it ended on, or its error.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from coci_core import CheckpointManager, CociError, RankGroup
from coci_core.engine.format.manifest import step_dir_name
from tests.harness.faults import flip_stored_byte

STEPS = (1, 2, 3, 4)


def full(step: int) -> torch.Tensor:
    return torch.arange(8192.0).reshape(2048, 4) + step


def rank_value(step: int, rank: int) -> torch.Tensor:
    return torch.full((3,), float(10 * step + rank))


# name -> (rank 0's local copy, rank 1's local copy, the remote tier or None)
SCENARIOS: dict[str, tuple[str, str, str | None]] = {
    # rank 0's base (step 1) damaged: every delta on it is lost for rank 0 alone
    "base_r0": ("base_r0", "saved", None),
    # the same, an intact copy on the remote tier
    "base_r0_remote": ("base_r0", "saved", "remote"),
    # rank 0's newest (4) damaged, rank 1's second-newest (3): step 2 is the newest for both
    "staggered": ("newest_r0", "second_r1", None),
    # the same at once, with the remote tier intact: 4
    "staggered_remote": ("newest_r0", "second_r1", "remote"),
    # step 4 absent on rank 1's disk, present on rank 0's; the remote holds it
    "absent_r1_remote": ("saved", "absent4", "remote"),
    # step 4 absent on rank 1's disk, no remote: the newest both hold is 3
    "absent_r1": ("saved", "absent4", None),
    # rank 1's base damaged, rank 0's newest; the remote holds only steps 1 and 2
    "base_r1_remote_old": ("newest_r0", "base_r1", "upto2"),
    # rank 0's base damaged locally and rank 1's newest damaged; the remote holds a copy
    "base_r0_newest_r1_remote": ("base_r0", "newest_r1", "remote"),
}
EXPECTED = {
    "base_r0": None,  # no step intact for rank 0
    "base_r0_remote": 4,
    "staggered": 2,
    "staggered_remote": 4,
    "absent_r1_remote": 4,
    "absent_r1": 3,
    "base_r1_remote_old": 2,
    "base_r0_newest_r1_remote": 4,
}


def damage(root: Path) -> None:
    saved = root / "saved"
    newest = json.loads((saved / step_dir_name(4) / "manifest.json").read_bytes())
    assert newest["bases"] == [1], newest["bases"]  # a delta on step 1, as the scenarios need
    copies = {
        "base_r0": [(1, 0)],
        "base_r1": [(1, 1)],
        "newest_r0": [(4, 0)],
        "newest_r1": [(4, 1)],
        "second_r1": [(3, 1)],
    }
    for name, flips in copies.items():
        shutil.copytree(saved, root / name)
        for step, rank in flips:
            flip_stored_byte(root / name, step, rank, "/model/w")
    shutil.copytree(saved, root / "remote")
    shutil.copytree(saved, root / "absent4")
    shutil.rmtree(root / "absent4" / step_dir_name(4))
    shutil.copytree(saved, root / "upto2")
    for step in (3, 4):
        shutil.rmtree(root / "upto2" / step_dir_name(step))


def restore_all(root: Path, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (local0, local1, remote) in SCENARIOS.items():
        directory = root / (local0 if rank == 0 else local1)
        mgr = CheckpointManager(
            directory,
            group=RankGroup.from_torch_distributed(),
            keep_last=None,
            remote=root / remote if remote else None,
        )
        try:
            state = mgr.restore()
            step = mgr.last_restore.step if mgr.last_restore else None
            w = state["model"]["w"]
            w = w.full_tensor() if hasattr(w, "full_tensor") else w
            exact = step is not None and torch.equal(w, full(step))
            own = torch.equal(state["rng"], rank_value(step or 0, rank))
            out[name] = {"step": step, "exact": exact and own}
        except CociError as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            mgr.close()
    return out


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root = Path(cfg["dir"])
    mgr = CheckpointManager(
        root / "saved",
        group=RankGroup.from_torch_distributed(),
        keep_last=None,
        compression="lossless",
        compression_options={"full_every": 4},
    )
    for step in STEPS:
        state = {"model": {"w": distribute_tensor(full(step), mesh, [Shard(0)])}, "step": step}
        mgr.save(step, state, per_rank={"rng": rank_value(step, rank)}).wait()
    mgr.close()
    dist.barrier()
    if rank == 0:
        damage(root)
    dist.barrier()
    out = {"rank": rank, "results": restore_all(root, rank)}
    dist.barrier()
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
