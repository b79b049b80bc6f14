"""One rank of a 2x2 ("dp", "tp") CPU mesh: DTensors as distribute_tensor and as FSDP2 over
tensor parallelism lay them out, checked against the regions ``dtensor_regions`` gives.

Run by ``tests.sharding._dist_child.launch(..., module=...)``; prints ``RESULT <json>``: per
tensor, its placements, whether this rank's local tensor equals the full tensor at its region,
whether torch reassembles the full tensor from locals cut at those regions, and the region this
rank writes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from coci_core.engine.format.regions import dtensor_layout, dtensor_regions, writers


def check(name: str, dt: DTensor, full: torch.Tensor) -> dict[str, Any]:
    shape, mesh_shape, placements, order = dtensor_layout(dt)
    regions = dtensor_regions(shape, mesh_shape, placements, shard_order=order, key=name)
    coord = tuple(dt.device_mesh.get_coordinate() or ())
    mine = regions[coord]
    local = dt.to_local()
    rebuilt = DTensor.from_local(
        full[mine.slices()].contiguous(),
        dt.device_mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    ).full_tensor()
    written = writers(regions).get(coord)
    return {
        "placements": repr(placements),
        "local_equal": local.shape == torch.Size(mine.shape)
        and torch.equal(local, full[mine.slices()]),
        "rebuilt_equal": torch.equal(rebuilt, full),
        "writes": None if written is None else [list(written.offsets), list(written.shape)],
        "itemsize": full.element_size(),
        "shape": list(full.shape),
    }


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    full = {
        "s0s1": torch.randn(9, 7, generator=g),  # uneven on both dims
        "s0rep": torch.randn(5, 3, generator=g),
        "rep_s1": torch.arange(22, dtype=torch.int32).reshape(2, 11),
        "strided": torch.randn(12, 4, generator=g),
    }
    tensors = {
        "s0s1": distribute_tensor(full["s0s1"], mesh, [Shard(0), Shard(1)]),
        "s0rep": distribute_tensor(full["s0rep"], mesh, [Shard(0), Replicate()]),
        "rep_s1": distribute_tensor(full["rep_s1"], mesh, [Replicate(), Shard(1)]),
        "strided": distribute_tensor(
            full["strided"], mesh, [_StridedShard(0, split_factor=2), Shard(0)]
        ),
    }
    torch.manual_seed(0)  # the same model on every rank, before it is split
    # 33 rows: uneven over tp, then uneven again over dp (9, 8 | 8, 8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 6))
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        tensors["fsdp_tp." + name] = param
        full["fsdp_tp." + name] = whole[name]
    out = {name: check(name, dt, full[name]) for name, dt in tensors.items()}
    dist.barrier()
    return {"rank": dist.get_rank(), "tensors": out}


if __name__ == "__main__":
    result = main()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
