"""One process of an Accelerate loop whose model is sharded with FSDP2 (``fully_shard``, the FSDP
plugin's ``fsdp_version=2``), checkpointed by ``CociCheckpointer``.

On CPU, Accelerate ignores the FSDP plugin (it prepares the model for DDP); this child sets the
state's ``distributed_type`` to FSDP after making the Accelerator, so that ``prepare`` applies
``fully_shard`` and the Accelerator reports FSDP (training, and Accelerate's own ``save_state``
and ``load_state``, work on CPU with gloo).

Run as ``python -m tests.accelerate._fsdp2_child DIR TOTAL [KILL]`` with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. Prints ``AT <step>`` after each step and, at the
end (after a ``save_state`` and ``load_state`` of Accelerate's own), ``RESULT <json>`` (process
index, the step it resumed from, whether the parameters are sharded DTensors, digests of the
full model and optimizer state, the samples it trained on).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
    set_seed,
)
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from coci_accelerate import CociCheckpointer
from tests.harness.states import full_digest


def main() -> None:
    directory, total = sys.argv[1], int(sys.argv[2])
    kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    set_seed(5)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=plugin,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    # see the module's docstring; every AcceleratorState() copies PartialState's type back
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    # 33 hidden units: FSDP2 splits the rows unevenly (17 and 16)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(33, 8)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(96, 16, generator=g), torch.randn(96, 8, generator=g))
    data.tensors = (*data.tensors, torch.arange(96))
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
    # Accelerate's own save_state / load_state beside coci (their FSDP path: DCP)
    accelerator.save_state(directory.rstrip("/") + "-accelerate")
    accelerator.load_state(directory.rstrip("/") + "-accelerate")
    model_state, optim_state = get_state_dict(model, optimizer.optimizer)
    result = {
        "rank": accelerator.process_index,
        "start": start,
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
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
