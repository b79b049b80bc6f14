"""A process that saves and then ends in the way ``cfg["order"]`` names, usually without
closing its manager (see test_exit_orders.py).

Two-rank orders (gloo, ``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment; every rank
saves steps 1 and 2, step 2 still being persisted when the order begins):

- ``exit``: the script ends; ``freed``: the manager was local to a function that returned;
- ``destroy``: ``dist.destroy_process_group()``, then the script ends;
- ``close-destroy`` / ``destroy-close``: ``close()`` and ``destroy_process_group()``;
- ``nonblocking-destroy``: step 2 saved with ``block=False``, the group destroyed at once;
- ``rank0-exits-first``: rank 0 calls ``sys.exit(0)``; rank 1 waits for step 2, goes on
  computing, destroys the group and ends.

One-process orders (``cfg["storage_options"]`` for an S3 URL): step 1 is committed by a
closed manager; a second manager restores it, prints ``READY`` and waits for a line on stdin
(meanwhile the test stops the S3 server or removes the directory), then

- ``unclosed``: the script ends; ``freed``: the manager is freed first (function scope);
- ``pending``: it saves step 2 (which cannot become durable), then the script ends;
- ``upload-pending``: the directory is local, ``cfg["remote"]`` (S3) is the remote tier: it
  saves step 2 (durable locally, its upload cannot succeed), prints ``EXITING`` on stderr and
  the script ends;
- ``warm_up``: (no S3, no READY) a manager warms up a large state and the script ends;
- ``late-thread``: (no READY) a non-daemon thread saves step 2 once the main thread has
  ended, and prints what ``save`` raised.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from coci_core import CheckpointManager

_KEEP: list[CheckpointManager] = []  # managers the script holds until it ends


def state(step: int) -> dict[str, Any]:
    """The state saved as ``step``: values that differ per step."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.full((300,), float(step))}


def two_ranks(cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    order = cfg["order"]

    def save_both() -> CheckpointManager:
        mgr = CheckpointManager(cfg["dir"])
        mgr.save(1, state(1)).wait()
        mgr.save(2, state(2), block=order != "nonblocking-destroy")
        return mgr

    if order == "freed":
        save_both()  # nothing holds the manager any more
        return
    mgr = save_both()
    _KEEP.append(mgr)
    if order in ("destroy", "nonblocking-destroy"):
        dist.destroy_process_group()
    elif order == "close-destroy":
        mgr.close()
        dist.destroy_process_group()
    elif order == "destroy-close":
        dist.destroy_process_group()
        mgr.close()
    elif order == "rank0-exits-first":
        if rank == 0:
            sys.exit(0)
        mgr.wait()  # rank 0's exit commits step 2
        x = torch.randn(64, 64)
        for _ in range(20):  # training goes on without rank 0
            x = torch.tanh(x @ x.T)
        dist.destroy_process_group()
    elif order != "exit":
        raise ValueError(f"unknown order {order!r}")


def one_process(cfg: dict[str, Any]) -> None:
    order = cfg["order"]
    options = cfg.get("storage_options") or {}
    if order == "warm_up":
        _KEEP.append(CheckpointManager(cfg["dir"]))
        _KEEP[0].warm_up({"w": torch.zeros(cfg["warm_up_bytes"], dtype=torch.uint8)})
        return
    if order == "late-thread":
        late_thread(cfg["dir"])
        return
    remote = cfg.get("remote")

    def manager() -> CheckpointManager:
        if remote is None:
            return CheckpointManager(cfg["dir"], storage_options=options)
        return CheckpointManager(cfg["dir"], remote=remote, remote_storage_options=options)

    with manager() as first:
        first.save(1, state(1)).wait()

    def resume() -> CheckpointManager:
        mgr = manager()
        mgr.restore()
        assert mgr.claim() is None  # a training run holds the directory from its start
        print("READY", flush=True)
        sys.stdin.readline()  # the storage goes away meanwhile
        if order == "pending":  # overwrite: no check in save() itself that the step exists
            mgr.save(2, state(2), overwrite=True)
        elif order == "upload-pending":
            mgr.save(2, state(2)).wait()
            print("EXITING", file=sys.stderr, flush=True)
        return mgr

    if order == "freed":
        resume()
    elif order in ("unclosed", "pending", "upload-pending"):
        _KEEP.append(resume())
    else:
        raise ValueError(f"unknown order {order!r}")


def late_thread(directory: str) -> None:
    import threading

    mgr = CheckpointManager(directory)
    mgr.save(1, state(1), block=False)

    def after_main() -> None:
        while threading.main_thread().is_alive():
            threading.Event().wait(0.01)
        try:
            mgr.save(2, state(2))
        except Exception as e:
            print(f"RAISED {type(e).__name__}: {e}", flush=True)

    threading.Thread(target=after_main).start()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    (two_ranks if config["kind"] == "two_ranks" else one_process)(config)
