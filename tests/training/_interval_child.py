"""A plain training loop with a ``Checkpointer(policy="every_n_steps", every_n_steps=16)``:
epochs of 64 batches, an epoch-interval LR schedule, resumed from the newest checkpoint.

argv: directory, total steps, and optionally a step after which it prints ``AT <step>`` (once the
saves before it are durable) and waits to be killed. At the end it prints ``RESULT <json>``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading

import torch

from coci_core import NoCheckpointError
from coci_core.training import Checkpointer

BATCHES_PER_EPOCH = 64


def train(directory: str, total: int, kill_at: int | None = None) -> dict[str, object]:
    """Train to step ``total`` (from the newest checkpoint in ``directory``, if any)."""
    torch.manual_seed(0)
    data = torch.randn(BATCHES_PER_EPOCH, 4, 8)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ckpt = Checkpointer(directory, policy="every_n_steps", every_n_steps=16, keep_last=None)
    step = 0
    try:
        state = ckpt.restore()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step = int(state["step"])
    except NoCheckpointError:
        pass
    start = step
    while step < total:
        batch = data[step % BATCHES_PER_EPOCH]
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % BATCHES_PER_EPOCH == 0:
            schedule.step()  # the epoch's end
        ckpt.observe(step, loss=float(loss.detach()))
        if ckpt.should_save(step):
            state = {
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
            }
            ckpt.save(step, state)
        if step == kill_at:
            ckpt.wait()
            print(f"AT {step}", flush=True)
            threading.Event().wait()
    ckpt.close()
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values()))
    return {"start": start, "digest": digest.hexdigest()}


def main() -> None:
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    result = train(sys.argv[1], int(sys.argv[2]), kill_at)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
