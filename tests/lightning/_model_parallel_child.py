"""Training with Lightning's ``ModelParallelStrategy`` (FSDP2 over a tensor-parallel plan) on
CPU processes (gloo), checkpointed by ``CociCheckpoint``.

Run as ``python -m tests.lightning._model_parallel_child DIR DP TP TOTAL [KILL]`` (Lightning
starts the other ranks by running the same command), or in DP x TP processes by
``python -m tests.harness.ranks N tests.lightning._model_parallel_child ...`` as torchrun would
(``GATHERED_FILES=1`` in the environment: ``save_distributed_checkpoint=False``, which coci's
saves ignore). With KILL, rank 0 prints
``AT <step>`` after that step and every rank waits to be killed; at the end every rank prints
``RESULT <json>`` (rank, global step, the learning rate, digests of the full model and
optimizer state, the samples this rank trained on).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from coci_lightning import CociCheckpoint
from tests.harness.states import full_digest

BATCH = 4
SAMPLES = 64


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 8, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


class Parallel(pl.LightningModule):
    """An MLP split as Lightning's docs write it: a tensor-parallel plan, then fully_shard.
    The norm and the head are not in the plan: fully_shard over the data-parallel sub-mesh
    makes them DTensors of that sub-mesh, one copy per tensor-parallel rank (the standard
    2-D recipe's embeddings, norms and heads)."""

    def __init__(self) -> None:
        super().__init__()
        # 34 hidden units: even over tensor parallelism; FSDP2 then splits rows unevenly
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 34),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(34, 8),
            torch.nn.LayerNorm(8),
            torch.nn.Linear(8, 8),
        )
        self.seen: list[int] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            plan = {"0": ColwiseParallel(), "3": RowwiseParallel()}
            parallelize_module(self.net, mesh["tensor_parallel"], plan)
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.extend(int(i) for i in idx)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return [opt], [{"scheduler": schedule, "interval": "step"}]

    def train_dataloader(self) -> Any:
        data = Indexed()
        where = self.trainer.strategy.distributed_sampler_kwargs  # the data-parallel rank
        sampler = StatefulDistributedSampler(data, shuffle=True, seed=3, **where)
        return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler)


class _StopHere(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            if trainer.is_global_zero:
                print(f"AT {self.step}", flush=True)
            threading.Event().wait()  # every rank stops here until the process group is killed


def main() -> None:
    directory, dp, tp, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    kill = int(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.set_num_threads(1)
    pl.seed_everything(11, verbose=False)
    model = Parallel()
    callbacks: list[pl.Callback] = [
        CociCheckpoint(policy="every_n_steps", every_n_steps=3, resume=True)
    ]
    if kill is not None:
        callbacks.append(_StopHere(kill))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dp * tp,
        strategy=ModelParallelStrategy(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            # Lightning's own files then hold the full state, gathered on rank 0
            save_distributed_checkpoint=os.environ.get("GATHERED_FILES") != "1",
        ),
        max_steps=total,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
        callbacks=callbacks,
    )
    trainer.fit(model)
    optimizer = trainer.optimizers[0]
    model_state, optim_state = get_state_dict(model.net, optimizer)
    result = {
        "rank": trainer.global_rank,
        "step": trainer.global_step,
        "lr": optimizer.param_groups[0]["lr"],
        "model": full_digest(model_state),
        "optim": full_digest(optim_state),
        "seen": model.seen,
    }
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
