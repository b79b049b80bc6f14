"""A loop that trains 6 steps (saving every 3) and then, after its last step boundary, gets
``argv[2]`` (``SIGTERM``, ``SIGUSR1`` or ``none``) before ``close()``: prints ``CLOSED`` if
``close()`` returns. argv[1]: the checkpoint directory; argv[3]: ``user`` installs a Python
SIGTERM handler before coci's (it prints ``USER HANDLER``)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch

from coci_core.preemption import Preemption
from coci_core.training import Checkpointer


def main() -> None:
    directory, sent, handler = sys.argv[1], sys.argv[2], sys.argv[3]
    if handler == "user":

        def said(signum: int, frame: Any) -> None:
            print("USER HANDLER", flush=True)

        signal.signal(signal.SIGTERM, said)
    ckpt = Checkpointer(
        directory,
        policy="every_n_steps",
        every_n_steps=3,
        preemption=Preemption(("TERM@30", "USR1@60")),
    )
    ckpt.watch_preemption()
    for step in range(1, 7):
        ckpt.observe(step, loss=1.0 / step)
        if ckpt.should_save(step):
            ckpt.save(step, {"w": torch.full((4,), float(step))})
        ckpt.stop_if_preempted()
    if sent != "none":  # after the last step boundary: a final evaluation, say
        os.kill(os.getpid(), signal.Signals[sent])
    ckpt.save(7, {"w": torch.full((4,), 7.0)})  # the final save
    ckpt.close()
    print("CLOSED", flush=True)


if __name__ == "__main__":
    main()
