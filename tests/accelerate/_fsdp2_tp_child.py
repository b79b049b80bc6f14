"""One process of an Accelerate loop on a 2-D mesh, ``ParallelismConfig(dp_shard_size=2,
tp_size=2)``: the MLP block is tensor-parallel (``parallelize_module`` over
``accelerator.torch_device_mesh["tp"]``, as Accelerate requires a model to be before
``prepare``), the norm and the head are not; ``prepare`` shards the whole model with FSDP2 over
the data-parallel dimension. Checkpointed by ``CociCheckpointer``.

On CPU, Accelerate ignores the FSDP plugin (the distributed type stays ``MULTI_CPU``), and the
``Accelerator`` constructor refuses a ``ParallelismConfig`` under ``MULTI_CPU``
(``ParallelismConfig._validate_accelerator``: "only compatible DistributedType.FSDP (version
2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED"). Forcing the FSDP type
*before* the constructor does not help either: ``AcceleratorState`` then never records the
plugin (it does so only while turning a ``MULTI_<accelerator>`` type into FSDP), and
``is_fsdp2`` fails. So this child makes the ``Accelerator`` with the FSDP plugin alone, forces
the FSDP type (as ``tests.accelerate.loop.force_fsdp`` does), then does what the constructor
does with a ``ParallelismConfig``, with Accelerate's own code: ``state.parallelism_config``,
``state.device_mesh = config.get_device_mesh("cpu")`` and ``config._validate_accelerator``.
From there on, ``prepare`` runs Accelerate's 2-D path: ``_prepare_tp`` (the parameters that
are not DTensors become DTensors replicated over ``tp``), then ``fully_shard`` over the
``dp_shard`` dimension (those parameters end up 2-D: ``(Shard(0), Replicate())`` on
``("dp_shard", "tp")``), and the data loader splits batches over ``dp_shard`` only (the two
``tp`` ranks of a ``dp_shard`` rank see the same batch).

One piece of that path is missing on any device with transformers 5: ``_prepare_tp`` imports
``transformers.integrations.tensor_parallel.ReplicateParallel`` (for the modules whose
parameters it replicates), a class transformers 5 removed, so ``prepare`` raises ImportError.
:func:`_provide_replicate_parallel` supplies it, as transformers 4 defined it: the module's
inputs become DTensors replicated over the mesh, its outputs local tensors again.

Run as ``python -m tests.accelerate._fsdp2_tp_child DIR TOTAL [KILL]`` with RANK, WORLD_SIZE
(4), LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. Prints ``AT <step>`` after each step and, at
the end, ``RESULT <json>`` (process index, the step it resumed from, each parameter's mesh
dimensions and placements, digests of the full model and optimizer state, the samples it
trained on).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    set_seed,
)
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from coci_accelerate import CociCheckpointer
from tests.harness.states import full_digest


class Net(torch.nn.Module):
    """An MLP block (tensor-parallel) before a norm and a head (not tensor-parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 36)
        self.down = torch.nn.Linear(36, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 9)  # 9 rows: FSDP2 splits them unevenly (5 and 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(torch.relu(self.up(x)))
        return self.head(self.norm(h))


class _ReplicateParallel:
    """transformers 4's ``ReplicateParallel``, the part Accelerate's ``_prepare_tp`` calls."""

    @staticmethod
    def _inputs(module: torch.nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    @staticmethod
    def _outputs(module: torch.nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def prepare_module_tp(self, module: torch.nn.Module, mesh: DeviceMesh) -> None:
        distribute_module(module, mesh, input_fn=self._inputs, output_fn=self._outputs)


def _provide_replicate_parallel() -> bool:
    """Supply ``ReplicateParallel`` where transformers lacks it (module docstring); whether it
    was missing."""
    import transformers.integrations.tensor_parallel as tp

    if hasattr(tp, "ReplicateParallel"):
        return False
    tp.ReplicateParallel = _ReplicateParallel  # type: ignore[attr-defined]
    return True


def make_accelerator() -> Accelerator:
    """An Accelerator of FSDP2 on a ``(dp_shard=2, tp=2)`` mesh, on CPU (module docstring)."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=plugin,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)
    config._validate_accelerator(accelerator)
    return accelerator


def _layout(model: torch.nn.Module) -> dict[str, Any]:
    return {
        name: [list(p.device_mesh.mesh_dim_names or ()), [str(x) for x in p.placements]]
        if isinstance(p, DTensor)
        else None
        for name, p in model.named_parameters()
    }


def main() -> None:
    directory, total = sys.argv[1], int(sys.argv[2])
    kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    set_seed(5)
    shimmed = _provide_replicate_parallel()
    accelerator = make_accelerator()
    model = Net()
    parallelize_module(
        model,
        accelerator.torch_device_mesh["tp"],
        {"up": ColwiseParallel(), "down": RowwiseParallel()},
    )
    model.tp_size = 2  # what Accelerate reads (get_model_tp_size) of a tensor-parallel model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 9, generator=g))
    data.tensors = (*data.tensors, torch.arange(48))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ckpt = CociCheckpointer(accelerator, directory, policy="every_n_steps", every_n_steps=3)
    start = step = ckpt.resume()
    seen: list[int] = []
    while step < total:
        for x, y, idx in loader:
            seen.extend(idx.tolist())
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            ckpt.step(step)
            print(f"AT {step}", flush=True)
            if step == kill:
                threading.Event().wait()  # until the test kills every process
            if step >= total:
                break
    ckpt.close()
    model_state, optim_state = get_state_dict(model, optimizer.optimizer)
    mesh = accelerator.torch_device_mesh
    result = {
        "rank": accelerator.process_index,
        "dp_shard": mesh.get_local_rank("dp_shard"),
        "start": start,
        "shimmed": shimmed,
        "layout": _layout(model),
        "lr": scheduler.get_last_lr(),
        "model": full_digest(model_state),
        "optim": full_digest(optim_state),
        "seen": seen,
    }
    accelerator.wait_for_everyone()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
