"""A Lightning training process for kill tests.

Run as ``python -m tests.lightning._child DIR TOTAL [KILL] [--dirpath URL]
[--storage-options JSON] [--coci JSON] [--devices N] [--fsdp2]``: checkpoints go to
``DIR/coci``, or to ``--dirpath`` (an fsspec URL such as ``s3://bucket/run``, reached with
``--storage-options`` or else the environment's ``AWS_*`` variables); ``--coci`` adds or
replaces ``CociCheckpoint`` options; ``--devices 2``: two processes (DDP, gloo; Lightning
starts the second unless a launcher started both, as torchrun or ``tests.harness.ranks``); with
``--fsdp2`` the processes shard the model with FSDP2 instead, as Lightning's users do:
``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` and ``fully_shard`` in
``configure_model``, each process reading its own part of the data set
(``StatefulDistributedSampler``).

With KILL it prints ``AT <step>`` after that step and waits to be killed; at the end it prints
``RESULT <json>`` with the final weights' digest (``digest``), that of the weights and the
optimizer's state (``state``, the full tensors: the same on every process), whether the
parameters were sharded (DTensors), the step it started from and the sample indices this process
trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from coci_lightning import CociCheckpoint
from tests.harness.states import full_digest
from tests.lightning.models import DigitsModel, digest


class _Start(pl.Callback):
    """The step the fit started from (after any resume)."""

    step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step = trainer.global_step


class _ShardedDigitsModel(DigitsModel):
    """The digits MLP sharded with FSDP2 over the data-parallel mesh, as Lightning's docs do."""

    def configure_model(self) -> None:
        mesh = self.device_mesh  # ModelParallelStrategy's, made before configure_model
        assert mesh is not None
        fully_shard(self.net, mesh=mesh["data_parallel"])


class _StopHere(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            print(f"AT {self.step}", flush=True)
            os.read(sys.stdin.fileno(), 1)  # the parent never writes: wait for SIGKILL
            raise SystemExit("not killed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("total", type=int)
    parser.add_argument("kill", type=int, nargs="?")
    parser.add_argument("--dirpath", default=None)
    parser.add_argument("--storage-options", type=json.loads, default=None)
    parser.add_argument("--coci", type=json.loads, default={})
    parser.add_argument("--devices", type=int, default=1, help="processes (DDP on CPU, gloo)")
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 (ModelParallelStrategy)")
    args = parser.parse_args()
    pl.seed_everything(7, verbose=False)
    model = _ShardedDigitsModel(distributed=True) if args.fsdp2 else DigitsModel()
    strategy: str | Strategy = "ddp" if args.devices > 1 else "auto"
    if args.fsdp2:
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    options = {"policy": "every_n_steps", "every_n_steps": 6, "resume": True, **args.coci}
    start = _Start()
    callbacks: list[pl.Callback] = [
        CociCheckpoint(
            **{"dirpath": args.dirpath, "storage_options": args.storage_options, **options}
        ),
        start,
    ]
    if args.kill is not None:
        callbacks.append(_StopHere(args.kill))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.total,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.directory,
        callbacks=callbacks,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    state = full_digest({"model": model.state_dict(), "opt": trainer.optimizers[0].state_dict()})
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    result = {
        "rank": trainer.global_rank,
        "digest": None if sharded else digest(model),
        "state": state,
        "sharded": sharded,
        "start": start.step,
        "seen": model.seen,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
