"""``python -m MODULE ARGS`` in several processes on this machine, as torchrun starts them, but
forked instead of started afresh.

Run as ``python -m tests.harness.ranks N MODULE ARGS...``: it imports MODULE (not as
``__main__``: its imports, torch's, the framework's) and what its processes would each import
lazily (:data:`LAZY`), then forks N processes, ranks 0 to N-1 meeting on a free port on
loopback, each with the variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), and each runs MODULE as
``__main__`` with ARGS and exits as ``python -m`` would. torchrun starts a fresh interpreter for
each process, which imports everything again (seconds each: Lightning's or the Trainer's
imports); these start with the imports done, as a child forked from the harness's zygote
(:mod:`tests.harness.zygote` forks this launcher from one that has imported MODULE's
framework). The objects imported are frozen (``gc.freeze``) before the fork: else each
process's garbage collections, at its exit above all, touch every one of them and copy the
memory they share (seconds).

Each process is a process of its own, in this one's session: killing the tree kills them all.
The exit status is 0 when every process ends with 0; else the first other status (128 + the
signal for a process killed by one), the others then SIGKILLed, as torchrun ends a run when
one of its processes fails.
"""

from __future__ import annotations

import gc
import importlib
import os
import runpy
import signal
import sys
from typing import NoReturn

from tests.harness.processes import free_port

# What a process imports lazily, by a module that makes it do so: torch's optimizers import
# torch._dynamo when the first is made; the digits are loaded with scikit-learn.
LAZY = {"torch": "torch._dynamo", "tests.harness.digits": "sklearn.datasets"}


def _become(rank: int, world: int, port: int, name: str, args: list[str]) -> NoReturn:
    """In the forked process: rank ``rank`` runs ``name`` as ``python -m`` would."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    sys.argv = [name, *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # up through main(): the interpreter ends as `python -m` would


def main() -> None:
    processes, name, *args = sys.argv[1:]
    world = int(processes)
    importlib.import_module(name)
    del sys.modules[name]  # imported for its imports; run afresh as __main__ in each process
    for loaded, lazy in LAZY.items():
        if loaded in sys.modules:
            importlib.import_module(lazy)
    gc.freeze()
    port = free_port()
    running: set[int] = set()
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _become(rank, world, port, name, args)
        running.add(pid)
    code = 0
    while running:
        pid, status = os.wait()
        running.discard(pid)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0:
            code = exit_code if exit_code > 0 else 128 - exit_code
            for other in running:
                os.kill(other, signal.SIGKILL)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
