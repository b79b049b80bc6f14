"""A process of a two-process ``torchrun`` job (see test_trust.py): trains 2 steps with a
registered object and saves them, then a second ``CociCheckpointer`` resumes with that
object refusing its state on process 1 only (a user's ``load_state_dict`` that raises, as on
a state forged for that process); each process prints ``RESULT <json>``: the error it got."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer


class Counter:
    """A registered object whose state process 1 refuses once ``refuse`` is set."""

    def __init__(self, index: int) -> None:
        self.index, self.n, self.refuse = index, 0, False

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.refuse and self.index == 1:
            raise ValueError(f"n={state['n']} is not a count this process accepts")
        self.n = state["n"]


def main() -> None:
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = Counter(accelerator.process_index)
    accelerator.register_for_checkpointing(counter)
    options = {"policy": "every_n_steps", "every_n_steps": 2, "preemption": None}
    ckpt = CociCheckpointer(accelerator, sys.argv[1], **options)
    for _ in range(2):
        accelerator.backward(model(torch.ones(4, 2)).sum())
        optimizer.step()
        optimizer.zero_grad()
        counter.n += 1
        ckpt.step()
    ckpt.close()
    counter.refuse = True
    again = CociCheckpointer(accelerator, sys.argv[1], **options)
    try:
        again.resume()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    line = "RESULT " + json.dumps({"index": accelerator.process_index, "error": error}) + "\n"
    os.write(1, line.encode())  # one write: the two processes share the pipe
    # nothing left to save; no teardown of the process group whose peer may be gone already
    # (it aborted now and then: "terminate called without an active exception")
    os._exit(0)


if __name__ == "__main__":
    main()
