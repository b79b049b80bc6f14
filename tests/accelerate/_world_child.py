"""A process of a ``torchrun`` job that makes an Accelerator (``cpu=True`` when asked) and a
CociCheckpointer, prints ``RESULT <process_index> <num_processes>`` and closes it."""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer


def main() -> None:
    directory, cpu = sys.argv[1], sys.argv[2] == "cpu"
    accelerator = Accelerator(
        cpu=cpu,
        project_dir=directory,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    ckpt = CociCheckpointer(accelerator, every_n_steps=5, preemption=None, save_on_close=False)
    print(f"RESULT {accelerator.process_index} {accelerator.num_processes}", flush=True)
    ckpt.close()
    del model
    accelerator.end_training()


if __name__ == "__main__":
    main()
