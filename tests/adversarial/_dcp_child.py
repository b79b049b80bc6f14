"""One rank of a job that saves DTensor shards with torch.distributed.checkpoint (gloo, CPU).

Run by ``tests.sharding._dist_child.launch(..., module="tests.adversarial._dcp_child")`` with
``{"dir": ...}``; every rank writes its shards into one DCP directory and prints ``RESULT``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def full_state() -> dict[str, Any]:
    """The state every rank saves, as whole tensors."""
    g = torch.Generator().manual_seed(1)
    return {
        "rows": torch.randn(5, 3, generator=g),  # 5 rows: 3 + 2 over two ranks
        "cols": torch.randn(4, 6, generator=g).to(torch.bfloat16),  # Shard(1): column blocks
        "rep": torch.arange(7, dtype=torch.int32),
        "plain": torch.ones(2, 2, dtype=torch.float64),
    }


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_state()
    state = {
        "model": {
            "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        },
        "plain": full["plain"],
        "step": 11,
        "note": "two ranks",
    }
    dcp.save(state, checkpoint_id=cfg["dir"])
    dist.barrier()
    return {"rank": dist.get_rank()}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
