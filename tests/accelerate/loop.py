"""The issue's Accelerate loop on scikit-learn's digits, as a function and as a process.

Run as ``python -m tests.accelerate.loop DIR TOTAL [KILL] [--coci JSON] [--samples N]
[--fsdp2]`` (also under ``accelerate launch`` or torchrun): with KILL it prints ``AT <step>``
after that step and waits to be killed; ``--coci`` adds or replaces ``CociCheckpointer``
options; ``--samples``: the first N digits (512) make the data set; ``--fsdp2`` (several
processes): the model is sharded with FSDP2 by Accelerate's FSDP plugin (``fsdp_version=2``;
see :func:`force_fsdp`), and at the end Accelerate's own ``save_state`` / ``load_state`` (their
FSDP path) run beside coci, in ``DIR/accelerate``; at the end each process prints
``RESULT <json>`` (process index, weights digest, that of the weights and the optimizer's
state, of the full tensors, whether the parameters are sharded DTensors, the step it resumed
from, samples trained on).
"""

from __future__ import annotations

import hashlib
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
    set_seed,
)
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from coci_accelerate import CociCheckpointer, CociTracker
from tests.harness.digits import digits_flat
from tests.harness.states import full_digest


def digits(n: int = 512) -> TensorDataset:
    """The first ``n`` digits with their indices."""
    x, y = digits_flat(n)
    return TensorDataset(x, y, torch.arange(n))


def force_fsdp(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make ``accelerator``, made with ``plugin`` on CPU, prepare for FSDP.

    On CPU, Accelerate ignores the FSDP plugin (it prepares the model for DDP); setting the
    state's ``distributed_type`` to FSDP (on ``PartialState()`` too: every ``AcceleratorState()``
    copies its type back) and recording the plugin makes ``prepare`` apply ``fully_shard`` and
    the Accelerator report FSDP (training, and Accelerate's own ``save_state`` and
    ``load_state``, work on CPU with gloo)."""
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def train(
    directory: str,
    total_steps: int,
    *,
    kill_at: int | None = None,
    on_kill: Any = None,
    every_n_steps: int = 5,
    batch_size: int = 16,
    epochs: int = 3,
    dirpath: str | None = None,
    storage_options: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    samples: int = 512,
    fsdp2: bool = False,
) -> dict[str, Any]:
    """The issue's loop: prepare, resume, train with ``accelerator.log`` and ``ckpt.step``."""
    set_seed(5)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp2 else None
    accelerator = Accelerator(
        cpu=True,
        log_with=[CociTracker()],
        project_dir=directory,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
        fsdp_plugin=plugin,
    )
    if plugin is not None:
        force_fsdp(accelerator, plugin)
    accelerator.init_trackers("digits")
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    dataloader = DataLoader(digits(samples), batch_size=batch_size, shuffle=True)
    model, optimizer, dataloader, scheduler = accelerator.prepare(
        model, optimizer, dataloader, scheduler
    )
    ckpt = CociCheckpointer(
        accelerator,
        **{
            "dirpath": dirpath,
            "storage_options": storage_options,
            "policy": "every_n_steps",
            "every_n_steps": every_n_steps,
            **(options or {}),
        },
    )
    start_step = ckpt.resume()  # optimizer steps completed: the label of the checkpoint
    seen: list[int] = []
    step = start_step
    try:
        while step < total_steps:
            for batch in dataloader:
                x, y, idx = batch
                seen.extend(idx.tolist())
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step += 1
                accelerator.log({"loss": loss.item()}, step=step)
                ckpt.step(step)
                if kill_at is not None and step == kill_at:
                    on_kill(accelerator)
                if step >= total_steps:
                    break
    finally:
        ckpt.close()
    if fsdp2:  # Accelerate's own save_state / load_state beside coci's (their FSDP path: DCP)
        accelerator.save_state(os.path.join(directory, "accelerate"))
        accelerator.load_state(os.path.join(directory, "accelerate"))
    digest = hashlib.sha256()
    for name, t in accelerator.unwrap_model(model).state_dict().items():
        t = t.full_tensor() if isinstance(t, DTensor) else t  # a collective, as full_digest's
        digest.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    state = {"model": model.state_dict(), "opt": optimizer.optimizer.state_dict()}
    result = {
        "rank": accelerator.process_index,
        "digest": digest.hexdigest(),
        "state": full_digest(state),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "seen": seen,
        "start": start_step,
    }
    accelerator.end_training()  # it ends the process group: after the collectives above
    return result


def _wait_for_kill(accelerator: Accelerator) -> None:
    if accelerator.is_main_process:
        print(f"AT {os.environ['COCI_KILL_AT']}", flush=True)
    threading.Event().wait()


def main() -> None:
    argv, options, samples = sys.argv[1:], None, 512
    fsdp2 = "--fsdp2" in argv
    argv = [a for a in argv if a != "--fsdp2"]
    if "--coci" in argv:
        at = argv.index("--coci")
        options = json.loads(argv[at + 1])
        del argv[at : at + 2]
    if "--samples" in argv:
        at = argv.index("--samples")
        samples = int(argv[at + 1])
        del argv[at : at + 2]
    directory, total = argv[0], int(argv[1])
    kill = int(argv[2]) if len(argv) > 2 else None
    if kill is not None:
        os.environ["COCI_KILL_AT"] = str(kill)
    result = train(
        directory,
        total,
        kill_at=kill,
        on_kill=_wait_for_kill,
        options=options,
        samples=samples,
        fsdp2=fsdp2,
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
