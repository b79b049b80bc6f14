"""Retention SIGKILLed at each of its file-system operations in turn.

argv: template (a directory of committed steps 1-5 of one run: 1 and 4 bases, the others deltas
on the base below), out, run id. For N = 0, 1, ...: the template is copied to ``out/kN`` and a
forked process applies ``keep_last=2`` there (as the writer does after step 5 commits), killing
itself with SIGKILL at its N-th operation; once one finishes unkilled, prints
``RESULT {"killed": N, "statuses": [...]}`` (the exit status of each killed one). The fork keeps
this to one interpreter start; the forked process runs no torch op.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

from coci_core import LocalStorage
from coci_core.engine.directory import retention


def _kill_at(n: int) -> None:
    """Patch this process's file-system operations to SIGKILL it at the ``n``-th."""
    calls = [0]

    def point(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            calls[0] += 1
            return fn(*args, **kwargs)

        return wrapped

    os.rename = point(os.rename)  # type: ignore[assignment]
    os.unlink = point(os.unlink)  # type: ignore[assignment]
    os.rmdir = point(os.rmdir)  # type: ignore[assignment]
    os.fsync = point(os.fsync)  # type: ignore[assignment]
    shutil.rmtree = point(shutil.rmtree)  # type: ignore[assignment]


def main() -> None:
    template, out, run_id = sys.argv[1:4]
    statuses: list[int] = []
    for n in range(100):
        directory = os.path.join(out, f"k{n}")
        shutil.copytree(template, directory)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                storage = LocalStorage(directory)
                _kill_at(n)
                retention.apply_keep_last(
                    storage, keep_last=2, run_id=run_id, newest=5, next_base=4
                )
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            if os.WEXITSTATUS(status) != 0:
                raise SystemExit(f"retention failed at kill point {n}")
            print("RESULT", json.dumps({"killed": n, "statuses": statuses}), flush=True)
            return
        statuses.append(-os.WTERMSIG(status))
    raise SystemExit("retention never finished")


if __name__ == "__main__":
    main()
