"""One rank saving or restoring DTensors of any placement on a CPU mesh with coci.

``cfg["mode"]``: ``"save"`` (a 2x2 ("dp", "tp") mesh: every placement FSDP2 and tensor
parallelism make, uneven), ``"restore"`` onto ``cfg["mesh"]`` with ``cfg["placements"]``
(names of placements per mesh dim), each rank reading its part in place; ``"dcp_save"`` (the
same state saved by DCP) and ``"dcp_load"`` (a DCP directory loaded by DCP onto a mesh). Run by
``tests.sharding._dist_child.launch(..., module=...)``; prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from coci_core import CheckpointManager, RankGroup
from coci_core.engine.restore.inplace import InPlaceTargets
from coci_core.engine.save import persist
from coci_core.storage import LocalStorage
from tests.sharding._dist_child import _PausingStorage

SAVE_STEP = 5


def full_state() -> dict[str, torch.Tensor]:
    """The tensors saved, whole (the same on every rank)."""
    g = torch.Generator().manual_seed(0)
    return {
        "s0s1": torch.randn(9, 7, generator=g),  # uneven on both dims
        "s1": torch.randn(6, 13, generator=g).to(torch.bfloat16),  # column-wise, uneven
        "s0rep": torch.randn(5, 3, generator=g),  # a replica pair per row block
        "rep_s1": torch.arange(22, dtype=torch.int32).reshape(2, 11),
        "strided": torch.randn(12, 4, generator=g),  # FSDP2 over tensor parallelism
        "rep": torch.randn(4, 4, generator=g),
        "tiny": torch.tensor([1.5]),  # fewer rows than replicas
    }


SAVE_PLACEMENTS: dict[str, list[Any]] = {
    "s0s1": [Shard(0), Shard(1)],
    "s1": [Replicate(), Shard(1)],
    "s0rep": [Shard(0), Replicate()],
    "rep_s1": [Replicate(), Shard(1)],
    "strided": [_StridedShard(0, split_factor=2), Shard(0)],
    "rep": [Replicate(), Replicate()],
    "tiny": [Shard(0), Replicate()],
}
_PLACEMENTS = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}


def _save(cfg: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = full_state()
    model = {k: distribute_tensor(v, mesh, SAVE_PLACEMENTS[k]) for k, v in full.items()}
    state = {"model": model, "plain": torch.ones(3), "step": SAVE_STEP}
    persist.SHARD_PIECE_BYTES = 32  # parts in pieces of 32 bytes, as large ones are cut
    mgr = CheckpointManager(
        cfg["dir"],
        group=RankGroup.from_torch_distributed(),
        chunk_bytes=64,
        **cfg.get("options", {}),
    )
    mgr.save(SAVE_STEP, state).wait()
    if mgr.remote is not None:
        assert mgr.remote.flush(timeout_s=120)
    mgr.close()
    out: dict[str, Any] = {}
    if "pause_rank" in cfg:  # a second save, in which that rank stops half-way: killed there
        rank = dist.get_rank()
        storage = (
            _PausingStorage(cfg["dir"], SAVE_STEP + 1)
            if rank == cfg["pause_rank"]
            else LocalStorage(cfg["dir"])
        )
        group = RankGroup.from_torch_distributed(timeout_s=3)
        with CheckpointManager(storage, group=group) as again:
            try:
                again.save(SAVE_STEP + 1, state).wait()
            except Exception as e:
                out["save_error"] = f"{type(e).__name__}: {e} (cause: {e.__cause__})"
    held = {
        k: v.to_local().numel() * v.element_size() for k, v in model.items() if k not in ("rep",)
    }
    return {"held": held, **out}


def _dcp_save(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same state saved by DCP itself from the 2x2 mesh."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = {k: distribute_tensor(v, mesh, SAVE_PLACEMENTS[k]) for k, v in full_state().items()}
    dcp.save({"model": model, "plain": torch.ones(3), "step": SAVE_STEP}, checkpoint_id=cfg["dir"])
    return {}


def _targets(cfg: dict[str, Any]) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", tuple(cfg["mesh"]))
    targets = {}
    for k, v in full_state().items():
        names = [("S0" if p == "S1" and v.ndim < 2 else p) for p in cfg["placements"]]
        targets[k] = distribute_tensor(torch.zeros_like(v), mesh, [_PLACEMENTS[p] for p in names])
    return targets


def _compare(model: dict[str, Any], targets: dict[str, DTensor]) -> dict[str, Any]:
    out: dict[str, Any] = {"in_place": {}, "equal": {}}
    for k, v in full_state().items():
        got = model[k]
        out["in_place"][k] = got is targets[k]
        assert isinstance(got, DTensor)
        out["equal"][k] = bool(torch.equal(got.full_tensor(), v))
    return out


def _restore(cfg: dict[str, Any]) -> dict[str, Any]:
    """Restore onto each of ``cfg["layouts"]`` (``[mesh, placements]`` pairs) in turn, or onto
    ``cfg["mesh"]`` with ``cfg["placements"]``."""
    layouts = cfg.get("layouts") or [[cfg["mesh"], cfg["placements"]]]
    mgr = CheckpointManager(
        cfg["dir"], group=RankGroup.from_torch_distributed(), **cfg.get("options", {})
    )
    results = []
    for mesh, placements in layouts:
        targets = _targets({"mesh": mesh, "placements": placements})
        state = mgr.restore(targets=InPlaceTargets({"model": targets}))
        out = _compare(state["model"], targets)
        out["bytes_read"] = mgr.last_restore.bytes_read
        out["plain"] = bool(torch.equal(state["plain"], torch.ones(3)))
        out["tier"] = mgr.last_restore.tier
        results.append(out)
    mgr.close()
    return results[0] if "layouts" not in cfg else {"layouts": results}


def _dcp_load(cfg: dict[str, Any]) -> dict[str, Any]:
    """A DCP directory (coci's export) loaded by DCP itself onto ``cfg["mesh"]``."""
    import torch.distributed.checkpoint as dcp

    targets = _targets(cfg)
    state = {"model": dict(targets), "plain": torch.zeros(3)}
    dcp.load(state, checkpoint_id=cfg["dir"])
    out = _compare(state["model"], targets)
    out["plain"] = bool(torch.equal(state["plain"], torch.ones(3)))
    return out


MODES = {"save": _save, "restore": _restore, "dcp_save": _dcp_save, "dcp_load": _dcp_load}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = MODES[cfg["mode"]](cfg)
    out["rank"] = dist.get_rank()
    if "pause_rank" not in cfg:  # a rank killed never meets the others again
        dist.barrier()
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
