"""One process of ``benchmarks.restart_bench``: trains a model whose checkpoint (weights and
Adam's state) is ``size_mb`` MB, with Lightning or Accelerate, saving with coci or with the
framework's own checkpointing; or resumes from that checkpoint and prints how long it took from
this process's start to the end of its first training step, then exits at once.

``python -m benchmarks.restart_child JSON`` with keys ``framework`` (``lightning`` or
``accelerate``), ``method`` (``coci``, ``native`` or ``fresh``: no checkpoint, the start-up alone),
``phase`` (``save`` or ``resume``), ``dir`` and ``size_mb``. Prints ``FIRST <seconds>``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from coci_core.training.restart import process_start_unix

_STARTED = process_start_unix() or time.time()
_PIECES = 8
SAVE_STEPS = 4


def _first_step_done() -> None:
    print(f"FIRST {time.time() - _STARTED:.4f}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # nothing after the first step is measured (no final save, no teardown)


def _model(size_mb: int) -> Any:
    import torch

    class Big(torch.nn.Module):
        """Parameters of size_mb / 3 MB (Adam's two moments make the state size_mb)."""

        def __init__(self) -> None:
            super().__init__()
            n = size_mb * (1 << 20) // 4 // 3 // _PIECES
            g = torch.Generator().manual_seed(0)
            self.ws = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(n, generator=g) * 0.01) for _ in range(_PIECES)]
            )
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            reg = sum(w.square().mean() for w in self.ws)
            return self.head(x).square().mean() + 1e-3 * reg

    return Big()


def _data() -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x), batch_size=16)


def lightning(cfg: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from coci_lightning import CociCheckpoint

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(cfg["size_mb"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.net(batch[0])
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class FirstStep(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if cfg["phase"] == "resume":
                _first_step_done()

    callbacks: list[Callback] = [FirstStep()]
    if cfg["method"] == "coci":
        callbacks.append(
            CociCheckpoint(cfg["dir"], policy="every_n_steps", every_n_steps=SAVE_STEPS)
        )
    elif cfg["method"] == "native":
        callbacks.append(
            ModelCheckpoint(cfg["dir"], every_n_train_steps=SAVE_STEPS, save_last=True)
        )
    trainer = L.Trainer(
        max_steps=SAVE_STEPS + 1 if cfg["phase"] == "save" else 1000,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    resume = cfg["phase"] == "resume" and cfg["method"] != "fresh"
    trainer.fit(Module(), _data(), ckpt_path="last" if resume else None)


def accelerate(cfg: dict[str, Any]) -> None:
    import torch
    from accelerate import Accelerator

    from coci_accelerate import CociCheckpointer

    accelerator = Accelerator(cpu=True, project_dir=cfg["dir"])
    model = _model(cfg["size_mb"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _data())
    ckpt = None
    done = 0
    if cfg["method"] == "coci":
        ckpt = CociCheckpointer(
            accelerator, policy="every_n_steps", every_n_steps=SAVE_STEPS, save_on_close=False
        )
        if cfg["phase"] == "resume":
            done = ckpt.resume()
    elif cfg["method"] == "native" and cfg["phase"] == "resume":
        accelerator.load_state(os.path.join(cfg["dir"], "native"))
        done = SAVE_STEPS
    for (x,) in loader:
        loss = model(x)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        done += 1
        if cfg["phase"] == "resume":
            _first_step_done()
        if ckpt is not None:
            ckpt.step(done, loss=float(loss))
        if done == SAVE_STEPS:
            break
    if cfg["method"] == "native":
        accelerator.save_state(os.path.join(cfg["dir"], "native"))
    if ckpt is not None:
        ckpt.close()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    {"lightning": lightning, "accelerate": accelerate}[config["framework"]](config)
