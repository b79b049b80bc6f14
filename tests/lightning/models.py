"""A small Lightning model on scikit-learn's digits, with dropout and a shuffling loader."""

from __future__ import annotations

import hashlib
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from tests.harness.digits import digits_flat


class IndexedDigits(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Digits (8x8 images, 10 classes) with each sample's index, to count what was seen."""

    def __init__(self, n: int = 256) -> None:
        self.x, self.y = digits_flat(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


class DigitsModel(pl.LightningModule):
    """An MLP with dropout trained with Adam and a step LR schedule."""

    def __init__(
        self, stateful_loader: bool = True, batch_size: int = 16, distributed: bool = False
    ) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 10)
        )
        self.stateful_loader = stateful_loader
        self.batch_size = batch_size
        self.distributed = distributed
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.extend(int(i) for i in idx)
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def train_dataloader(self) -> Any:
        data = IndexedDigits()
        if self.distributed:  # one shuffled order per epoch, split over ranks, stateful
            sampler = StatefulDistributedSampler(data, shuffle=True, seed=3)
            return StatefulDataLoader(data, batch_size=self.batch_size, sampler=sampler)
        if self.stateful_loader:
            return StatefulDataLoader(data, batch_size=self.batch_size, shuffle=True)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True)


def digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
