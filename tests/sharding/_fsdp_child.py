"""One rank of a model trained with FSDP2 (``fully_shard``; over tensor parallelism on a 2-D
mesh) and AdamW, checkpointed with coci as DCP's docs write it: the state from
``get_state_dict``, restored in place into the state ``get_state_dict`` gives and loaded with
``set_state_dict``.

``cfg``: ``dir``, ``mesh`` ([dp] or [dp, tp]), ``steps``, ``every`` (save interval), ``api``
(``"into"``: the modules' own ``state_dict()`` saved and ``restore(into=...)``),
``restore_api`` (the restore's, when it is not the save's; a ``StateMismatchError`` then
printed as ``MISMATCH <message>``, exit status 3). Prints
``AT <step>`` after each optimizer step and ``RESULT <json>`` (the restored step, and digests
of the full parameters and optimizer state) at the end.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from coci_core import CheckpointManager, RankGroup, StateMismatchError
from coci_core.engine.restore.inplace import InPlaceTargets
from tests.harness.states import full_digest


def build(mesh_shape: list[int]) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """The model split over the mesh, its optimizer, and this rank's data-parallel index."""
    torch.manual_seed(0)
    # 34 hidden units: even over tp; the rows FSDP2 then splits are uneven (9, 8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 34), torch.nn.ReLU(), torch.nn.Linear(34, 8))
    if len(mesh_shape) == 2:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh["dp"].get_local_rank()
    else:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("dp",))
        fully_shard(model, mesh=mesh)
        dp = mesh.get_local_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, dp


def batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, optimizer, dp = build(cfg["mesh"])
    mgr = CheckpointManager(cfg["dir"], group=RankGroup.from_torch_distributed())
    start = 0
    into = cfg.get("api") == "into"  # the modules' own state_dict() and restore(into=...)
    if mgr.latest_step() is not None:
        if cfg.get("restore_api", cfg.get("api")) == "into":
            try:
                state = mgr.restore(into={"model": model, "optim": optimizer})
            except StateMismatchError as e:
                print(f"MISMATCH {e}", flush=True)
                os._exit(3)
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)  # the live, sharded state
            state = mgr.restore(targets=InPlaceTargets({"model": model_sd, "optim": optim_sd}))
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        start = state["step"]
    for step in range(start, cfg["steps"]):
        x, y = batch(step, dp)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % cfg["every"] == 0:
            if into:
                model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
            mgr.save(step + 1, {"model": model_sd, "optim": optim_sd, "step": step + 1})
        print(f"AT {step + 1}", flush=True)
    mgr.close()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "rank": dist.get_rank(),
        "start": start,
        "model": full_digest(model_sd),
        "optim": full_digest(optim_sd),
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    dist.barrier()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
