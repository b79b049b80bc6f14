"""A writer that SIGKILLs itself at the N-th file-system operation of a re-save and a retention.

argv: directory, kill_at (-1: never; then it prints how many operations there were), exchange
(1: publish may swap directories with renameat2; 0: the two-rename fallback).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

import torch

from coci_core import CheckpointManager, LocalStorage
from coci_core.storage import local


def state(tag: float) -> dict[str, object]:
    return {"w": torch.full((50_000,), tag), "b": torch.arange(1000) * tag, "tag": tag}


def main() -> None:
    directory, kill_at, exchange = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    storage = LocalStorage(directory)
    storage.exchange = exchange
    mgr = CheckpointManager(storage, keep_last=1)
    mgr.save(5, state(1.0)).wait()  # the committed step that is re-saved, then retired

    calls = {"n": 0}

    def point(fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            if calls["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            calls["n"] += 1
            return fn(*args, **kwargs)

        return wrapped

    os.rename = point(os.rename)
    os.unlink = point(os.unlink)
    os.rmdir = point(os.rmdir)
    os.fsync = point(os.fsync)
    local._rename_exchange = point(local._rename_exchange)
    shutil.rmtree = point(shutil.rmtree)

    mgr.save(5, state(2.0), overwrite=True).wait()  # re-save of a committed step
    mgr.save(6, state(3.0)).wait()  # retention removes step 5
    mgr.close()
    print("OPS", calls["n"], flush=True)


if __name__ == "__main__":
    main()
