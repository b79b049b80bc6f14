"""One rank of a LightningModule sharded with FSDP1 (``FullyShardedDataParallel``, what Lightning's
``FSDPStrategy`` wraps it in) on CPU with gloo, saved and restored through the code
``CociCheckpoint`` uses for that strategy: ``sharded_state`` (what each rank saves) and the
strategy's ``load_checkpoint`` as coci wraps it. ``FSDPStrategy`` refuses a CPU accelerator, so
the strategy object is given the FSDP module and optimizer here as its ``setup`` would.

Run as ``python -m tests.lightning._fsdp1_child DIR MESH`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; MESH is ``1d`` (FULL_SHARD over a 1-D device mesh), ``hybrid`` (HYBRID_SHARD
over a (1, world) mesh) or ``none`` (no device mesh). Prints ``RESULT <json>``: the digests of
the full state at the save, after training on and after the restore, and after training on
again from the restored state; or the error of the save (no device mesh).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from coci_core import CheckpointManager, CociError, RankGroup
from coci_lightning._io import CociCheckpointIO, use_coci_io
from coci_lightning._sharded import sharded_state


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Trainer:
    """What ``use_coci_io`` reads of a Trainer: its strategy."""

    def __init__(self, strategy: FSDPStrategy) -> None:
        self.strategy = strategy


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The full model and optimizer state (gathered), hashed."""
    full = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=full)
    h = hashlib.sha256()
    for key, t in sorted(model_state.items()):
        h.update(key.encode() + t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for key, state in sorted(optim_state["state"].items()):
        for name, t in sorted(state.items()):
            h.update(
                f"{key}.{name}".encode()
                + t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            )
    return h.hexdigest()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def main(directory: str, mesh_kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    module = Net()
    kwargs: dict[str, Any] = {}
    if mesh_kind == "1d":
        kwargs["device_mesh"] = init_device_mesh("cpu", (world,))
    elif mesh_kind == "hybrid":
        kwargs["device_mesh"] = init_device_mesh("cpu", (1, world))
        kwargs["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
    model = FullyShardedDataParallel(
        module, device_id=torch.device("cpu"), use_orig_params=True, **kwargs
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = FSDPStrategy(**kwargs)
    strategy.connect(module)
    strategy.model = model  # as FSDPStrategy.setup leaves it
    strategy.optimizers = [optimizer]
    io = use_coci_io(_Trainer(strategy))
    assert isinstance(io.inner, TorchCheckpointIO) and isinstance(io, CociCheckpointIO)
    io.rank = dist.get_rank()

    train(model, optimizer, range(3))
    with sharded_state(strategy):  # what CociCheckpoint's dump of the checkpoint takes
        state = {
            "state_dict": strategy.lightning_module_state_dict(),
            "optimizer_states": [strategy.optimizer_state(optimizer)],
            "global_step": 3,
        }
    kinds = sorted({type(t).__name__ for t in state["state_dict"].values()})
    mgr = CheckpointManager(directory, group=RankGroup.from_torch_distributed())
    try:
        mgr.save(3, state)
    except CociError as e:
        mgr.close()
        return {"rank": dist.get_rank(), "kinds": kinds, "error": f"{type(e).__name__}: {e}"}
    mgr.close()
    saved = digest(model, optimizer)
    train(model, optimizer, range(3, 5))
    trained_on = digest(model, optimizer)

    loaded = strategy.load_checkpoint(os.path.join(directory, "step-0000000003"))
    restored = digest(model, optimizer)
    train(model, optimizer, range(3, 5))
    return {
        "rank": dist.get_rank(),
        "kinds": kinds,
        "global_step": loaded["global_step"],
        "saved": saved,
        "trained_on": trained_on,
        "restored": restored,
        "trained_again": digest(model, optimizer),
    }


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2])
    dist.barrier()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
