"""Runs ``coci import`` on each of many sources, each in a forked process with a memory limit
and a wall-clock deadline, and prints what each did.

Run as ``python -m tests.adversarial._import_child JSON`` with ``{"cases": [{"name", "src",
"dst"}], "memory_mb", "deadline_s"}``. This process imports torch and coci once; each case
runs in a fork of it that limits its address space to ``memory_mb`` above what it has mapped
(``RLIMIT_AS``), is killed by ``SIGALRM`` after ``deadline_s``, and calls the CLI's ``main``
as ``coci import SRC DST`` does (an exception escaping ``main`` prints its traceback and exits
1, as the interpreter would). For each case one line ``CASE <json>``: ``name``, ``status``
(the exit status, or minus the signal that ended it), ``stdout``, ``stderr`` and ``seconds``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

# what an import loads, loaded before the memory limit is set
import torch.distributed.checkpoint.filesystem
import torch.distributed.checkpoint.metadata

import coci_core.engine.manager
import coci_core.interop.exchange
import coci_core.interop.foreign  # noqa: F401
from coci_core.commands.cli import main


def _mapped_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _run_limited(src: str, dst: str, memory_mb: int, deadline_s: int, fds: tuple[int, int]) -> None:
    """In the forked child: limit it, run ``coci import``, exit with its status."""
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    limit = _mapped_bytes() + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.alarm(deadline_s)  # default action: the process ends with SIGALRM
    try:
        code = main(["import", src, dst])
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_case(case: dict[str, Any], memory_mb: int, deadline_s: int) -> dict[str, Any]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            fds = (out.fileno(), err.fileno())
            _run_limited(case["src"], case["dst"], memory_mb, deadline_s, fds)
        _, status = os.waitpid(pid, 0)
        seconds = time.monotonic() - start
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
    return {
        "name": case["name"],
        "status": os.waitstatus_to_exitcode(status),
        "stdout": texts[0],
        "stderr": texts[1],
        "seconds": seconds,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    cfg = json.loads(sys.argv[1])
    for case in cfg["cases"]:
        result = run_case(case, cfg["memory_mb"], cfg["deadline_s"])
        print("CASE " + json.dumps(result), flush=True)
