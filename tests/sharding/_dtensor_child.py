"""One rank saving DTensors (Shard(0) and Replicate() on a 1-D CPU mesh; a Partial one, refused)
with coci.

Run by ``tests.sharding._dist_child.launch(..., module=...)``; prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from coci_core import CheckpointManager, RankGroup, UnsupportedValueError


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb": torch.randn(10, 7, generator=g),  # 10 rows: uneven over 4 ranks (3, 3, 3, 1)
        "w": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "rep": torch.arange(12.0),
        "plain": torch.ones(5, dtype=torch.int64),
    }


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_state()
    state = {
        "model": {
            "emb": distribute_tensor(full["emb"], mesh, [Shard(0)]),
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        },
        "plain": full["plain"],
        "step": 3,
    }
    out: dict[str, Any] = {"rank": dist.get_rank()}
    try:
        partial = {"x": DTensor.from_local(torch.ones(3), mesh, [Partial()])}
        CheckpointManager(cfg["dir"] + "-refused").save(1, partial)
    except UnsupportedValueError as e:
        out["refused"] = str(e)
    mgr = CheckpointManager(cfg["dir"], group=RankGroup.from_torch_distributed(), chunk_bytes=64)
    mgr.save(3, state).wait()
    restored = mgr.restore()
    mgr.close()
    out["local_rows"] = state["model"]["emb"].to_local().shape[0]
    out["restored_equal"] = all(
        torch.equal(restored["model"][k], full[k]) for k in ("emb", "w", "rep")
    ) and torch.equal(restored["plain"], full["plain"])
    dist.barrier()
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
