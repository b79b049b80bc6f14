"""A rank of a gloo job that makes ``CheckpointManager(dir)`` with no ``group`` (cfg["mode"]):
"every" rank, rank 0 "alone" (the others make none), or "single" (every rank opts out with
``RankGroup.single()`` on one directory). Prints ``RESULT <json>``."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import coci_core.engine.group
from coci_core import CheckpointManager, CociError, RankGroup


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    coci_core.engine.group.JOIN_TIMEOUT_S = 5.0
    state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 4}
    out: dict[str, Any] = {"rank": rank}
    try:
        if cfg["mode"] == "every":
            with CheckpointManager(cfg["dir"]) as mgr:
                out["world_size"] = mgr.group.world_size
                mgr.save(4, state).wait()
                out["restored"] = bool(torch.equal(mgr.restore()["w"], state["w"]))
        elif cfg["mode"] == "alone":
            if rank == 0:
                CheckpointManager(cfg["dir"]).close()
        elif rank == 0:
            with CheckpointManager(cfg["dir"], group=RankGroup.single()) as mgr:
                mgr.save(4, state).wait()
                dist.barrier()  # rank 0 has saved and still holds the directory
                dist.barrier()  # until rank 1 has tried
        else:
            dist.barrier()
            try:
                with CheckpointManager(cfg["dir"], group=RankGroup.single()) as mgr:
                    mgr.save(5, state).wait()
            finally:
                dist.barrier()
    except CociError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
