"""An Accelerate loop with no logging configured, for the tests of what its user reads.

Run as ``python -m tests.accelerate._logging_child DIR`` (one process) or under torchrun (each
process runs it; gloo on CPU): CociCheckpointer with ``verbose=True`` saves every 5 of 12
optimizer steps and at ``close()``, after a ``resume()`` that finds nothing.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader

from coci_accelerate import CociCheckpointer
from tests.accelerate.example import dataset


def main() -> None:
    directory = sys.argv[1]
    set_seed(3)
    accelerator = Accelerator(
        cpu=True,
        project_dir=directory,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Linear(8, 3)
    model, optimizer, loader = accelerator.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(dataset(), batch_size=4, shuffle=True),
    )
    ckpt = CociCheckpointer(
        accelerator, policy="every_n_steps", every_n_steps=5, total_steps=12, verbose=True
    )
    step = ckpt.resume()  # nothing to resume: it says so
    while step < 12:
        for x, y, _ in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step(loss=loss.item())
            step += 1
            if step == 12:
                break
    ckpt.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
