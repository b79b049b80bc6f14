"""One rank of a job whose ranks restore together: saves a ``Shard(0)`` DTensor and per-rank
state at steps 1 to 3 (``cfg["save"]``), damages copies of the checkpoint (rank 0, between
barriers; or forges rank 1's copy of the newest manifest), then restores each copy through
``restore()``, ``restore(into=...)`` and ``InPlaceTargets``, and reports the step each restore
ended on, or its error.

Run by ``tests.sharding._dist_child.launch(..., module="tests.adversarial._agree_child")``.
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

from coci_core import CheckpointManager, CociError, InPlaceTargets, RankGroup
from tests.adversarial.craft import edit_manifest
from tests.harness.faults import flip_stored_byte

STEPS = (1, 2, 3)


def full(step: int) -> torch.Tensor:
    return torch.arange(48.0).reshape(12, 4) + 100 * step


def rank_value(step: int, rank: int) -> torch.Tensor:
    return torch.full((3,), float(10 * step + rank))


# name -> damage done to a copy of the saved checkpoint (the saving world's ranks 0 and 1)
SCENARIOS: dict[str, list[tuple[int, str, int]]] = {
    "intact": [],
    "piece": [(3, "/model/w", 1)],  # rank 1's piece of the newest step
    "rank_state": [(3, "rank:/rng", 1)],  # rank 1's own state of the newest step
    # the newest step damaged for rank 1, the one before for rank 0: two rounds to agree
    "staggered": [(3, "/model/w", 1), (2, "/model/w", 0)],
    "all": [(3, "/model/w", 1), (2, "/model/w", 0), (1, "/model/w", 1)],
}


# name -> an edit of the newest step's manifest (resealed) in rank 1's node-local copy only:
# a copy of one commit (its place and run) that says other things than the other ranks' copy
FORGED: dict[str, Any] = {
    # rank 1's copy says one rank saved it (before: restored, rank 1 without its own state)
    "forged_world1": lambda doc: doc.update(world_size=1, per_rank=doc["per_rank"][:1]),
    "forged_world4": lambda doc: doc.update(world_size=4),
    "forged_step": lambda doc: doc.update(step=7),
    "forged_run": lambda doc: doc.update(run="forged"),
    # of the same world and ranks, another value of the shared tree (every rank restores it)
    # or another layout of rank 1's piece (before: restored, rank 1 with what its copy said)
    "forged_tree": lambda doc: doc["tree"]["v"].update(step=7),
    "forged_layout": lambda doc: swap_stored(doc["tensors"][0]["pieces"]),
}


def swap_stored(pieces: list[dict[str, Any]]) -> None:
    """Where two pieces of an array are stored swapped: each still verifies (its stored
    bytes' checksum goes with it), the array's rows are swapped."""
    stored = ("file", "offset", "nbytes", "crc32c", "params")
    a, b = ({k: p[k] for k in stored} for p in pieces[:2])
    pieces[0].update(b)
    pieces[1].update(a)


def restore_all(root: Path, mesh: Any, rank: int) -> dict[str, Any]:
    """Every scenario's copy, restored through each path: the step, or the error."""
    out: dict[str, Any] = {}
    names = [*SCENARIOS, "missing_here", "unreadable_here", "tiers", "other_run_here"]
    names += [*FORGED, "forged_tiers", "forged_tree_tiers"]
    for name in names:
        directory = root / name
        if name in ("missing_here", "unreadable_here"):
            directory = root / "intact"
        if name == "missing_here" and rank == 1:
            directory = root / "empty"  # a node whose disk holds nothing
        if name == "unreadable_here" and rank == 1:
            directory = root / "a-file"  # a node that cannot read the directory at all
        if name == "other_run_here":  # a node whose disk holds another run's steps 1 to 3
            directory = root / ("other-run" if rank == 1 else "intact")
        if name in FORGED:
            directory = root / (name if rank == 1 else "intact")
        if name == "forged_tiers":  # as forged_world1, with the original on a remote tier
            directory = root / ("forged_world1" if rank == 1 else "intact")
        if name == "forged_tree_tiers":  # as forged_tree, with the original on a remote tier
            directory = root / ("forged_tree" if rank == 1 else "intact")
        # a remote tier holding an intact copy of what rank 1 finds damaged locally
        remote = root / "intact" if name == "tiers" else None
        if name in ("forged_tiers", "forged_tree_tiers"):
            remote = root / "saved"
        if name == "tiers":
            directory = root / "piece"
        for path in ("restore", "into", "targets"):
            group = RankGroup.from_torch_distributed()
            mgr = CheckpointManager(directory, group=group, keep_last=None, remote=remote)
            live = {
                "w": distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)]),
                "rng": torch.zeros(3),
            }
            model = torch.nn.Linear(4, 12, bias=False)
            try:
                if path == "restore":
                    state = mgr.restore()
                    got_w = state["model"]["w"]
                elif path == "into":
                    state = mgr.restore(into={"model": Holder(live)})
                    got_w = live["w"]
                else:
                    target = {"model": {"w": live["w"]}, "rng": live["rng"]}
                    state = mgr.restore(targets=InPlaceTargets(target))
                    got_w = state["model"]["w"]
                step = mgr.last_restore.step if mgr.last_restore else None
                if hasattr(got_w, "full_tensor"):
                    got_w = got_w.full_tensor()
                exact = step is not None and torch.equal(got_w, full(step))
                exact = exact and state.get("step") == step
                rng = state.get("rng")
                own = rng is not None and torch.equal(rng, rank_value(step or 0, rank))
                out[f"{name}/{path}"] = {"step": step, "exact": exact, "own": own}
            except CociError as e:
                out[f"{name}/{path}"] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                mgr.close()
                del model
    return out


class Holder:
    """A ``load_state_dict`` target that copies the restored model into ``live``."""

    def __init__(self, live: dict[str, Any]) -> None:
        self.live = live

    def load_state_dict(self, state: dict[str, Any]) -> None:
        w = state["w"]
        if hasattr(w, "full_tensor"):
            w = w.full_tensor()
        local = self.live["w"]
        shard = distribute_tensor(w, local.device_mesh, local.placements)
        local.to_local().copy_(shard.to_local())


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root = Path(cfg["dir"])
    if cfg.get("save"):
        mgr = CheckpointManager(
            root / "saved", group=RankGroup.from_torch_distributed(), keep_last=None
        )
        for step in STEPS:
            state = {
                "model": {"w": distribute_tensor(full(step), mesh, [Shard(0)])},
                "step": step,
            }
            mgr.save(step, state, per_rank={"rng": rank_value(step, rank)}).wait()
        mgr.close()
        # another run (another job) writing the same steps into a directory of its own
        mgr = CheckpointManager(
            root / "other-run", group=RankGroup.from_torch_distributed(), keep_last=None
        )
        for step in STEPS:
            state = {"model": {"w": distribute_tensor(-full(step), mesh, [Shard(0)])}}
            mgr.save(step, state, per_rank={"rng": rank_value(step, rank)}).wait()
        mgr.close()
        dist.barrier()
        if rank == 0:
            for name, damage in SCENARIOS.items():
                shutil.copytree(root / "saved", root / name)
                for step, key, r in damage:
                    own = key.startswith("rank:")
                    flip_stored_byte(root / name, step, r, key.removeprefix("rank:"), own=own)
            for name, edit in FORGED.items():
                shutil.copytree(root / "saved", root / name)
                edit_manifest(root / name, 3, edit)
            (root / "empty").mkdir()
            (root / "a-file").write_bytes(b"not a directory")
    dist.barrier()
    out = {"rank": rank, "results": restore_all(root, mesh, rank)}
    dist.barrier()
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
