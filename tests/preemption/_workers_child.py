"""Training over a ``DataLoader`` with two workers that acts on SIGTERM (see
test_loader_workers.py), in a plain loop or under an adapter.

argv: JSON ``dir``, ``kind`` (``loop``, ``lightning``, ``accelerate``, ``transformers``),
``shield`` (the plain loop calls ``Checkpointer.shield_loader_workers``) and ``context`` (the
loader's ``multiprocessing_context``). Prints ``WORKERS <pids>`` at step 4, once each worker
has handed batches over, and trains on until the notice: the adapter (or the loop) saves the
next step and stops with :class:`~coci_core.Preempted` (exit status 143).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

WORKERS_AT = 4


def _loader(cfg: dict[str, Any], batch: int = 4) -> DataLoader[Any]:
    return DataLoader(
        TensorDataset(torch.randn(4096, 8)),
        batch_size=batch,
        num_workers=2,
        multiprocessing_context=cfg.get("context"),
    )


def _step_done(step: int) -> None:
    if step == WORKERS_AT:
        children = [p.pid for p in multiprocessing.active_children()]
        print("WORKERS " + json.dumps(children), flush=True)
    time.sleep(0.01)  # a step's compute, not a synchronisation


def loop(cfg: dict[str, Any]) -> None:
    from coci_core.preemption import Preemption
    from coci_core.training import Checkpointer

    model = torch.nn.Linear(8, 2)
    loader = _loader(cfg)
    ckpt = Checkpointer(
        cfg["dir"],
        policy="every_n_steps",
        every_n_steps=10**9,
        preemption=Preemption(("SIGTERM",), margin_s=0.0),
    )
    ckpt.watch_preemption()
    if cfg["shield"]:
        assert ckpt.shield_loader_workers(loader) == 1
    for step, (batch,) in enumerate(loader, start=1):
        model(batch).sum().backward()
        _step_done(step)
        if ckpt.should_save(step):
            ckpt.save(step, {"model": model.state_dict()})
        ckpt.stop_if_preempted()
    ckpt.close()


def lightning(cfg: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    from coci_lightning import CociCheckpoint

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            _step_done(self.global_step)
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return _loader(cfg)

    trainer = pl.Trainer(
        max_steps=10**6,
        accelerator="cpu",
        callbacks=[CociCheckpoint(cfg["dir"], policy="every_n_steps", every_n_steps=10**9)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())


def accelerate(cfg: dict[str, Any]) -> None:
    from accelerate import Accelerator

    from coci_accelerate import CociCheckpointer

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(cfg))
    ckpt = CociCheckpointer(accelerator, cfg["dir"], policy="every_n_steps", every_n_steps=10**9)
    for step, (batch,) in enumerate(loader, start=1):
        accelerator.backward(model(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
        _step_done(step)
        ckpt.step()


def transformers(cfg: dict[str, Any]) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from coci_transformers import CociCallback
    from tests.transformers.run import Tokens, tiny_model

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _step_done(state.global_step)

    arguments = TrainingArguments(
        output_dir=cfg["dir"],
        max_steps=10**5,
        per_device_train_batch_size=4,
        dataloader_num_workers=2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    coci = CociCallback(f"{cfg['dir']}/coci", policy="every_n_steps", every_n_steps=10**9)
    Trainer(
        model=tiny_model(),
        args=arguments,
        train_dataset=Tokens(),
        callbacks=[coci, Steps()],
    ).train()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = json.loads(sys.argv[1])
    {"loop": loop, "lightning": lightning, "accelerate": accelerate, "transformers": transformers}[
        config["kind"]
    ](config)
    print("DONE", flush=True)
