"""A run whose wall clock (the one that stamps ``created_unix``) is OFFSET seconds off: it
resumes the directory's newest checkpoint (if any), saves steps FIRST..LAST (keep_last=3), then
SIGKILLs itself (a crash).

argv: directory (a path, or an s3:// URL reached through the AWS_* environment), offset in
seconds, first step, last step.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from coci_core import CheckpointManager
from coci_core.engine.save import persist


class SkewedClock:
    """The ``time`` module with a wall clock ``offset_s`` off (``time()``; the rest as is)."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def time(self) -> float:
        return time.time() + self.offset_s

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def state(step: int) -> dict[str, object]:
    """The state saved at ``step``."""
    return {"w": torch.full((4096,), float(step)), "step": step}


def main() -> None:
    directory, offset = sys.argv[1], float(sys.argv[2])
    first, last = int(sys.argv[3]), int(sys.argv[4])
    persist.time = SkewedClock(offset)  # type: ignore[attr-defined,assignment]
    mgr = CheckpointManager(directory, keep_last=3, compression="none")
    if mgr.steps():
        mgr.restore()
    for step in range(first, last + 1):
        mgr.save(step, state(step)).wait()
    print("SAVED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
