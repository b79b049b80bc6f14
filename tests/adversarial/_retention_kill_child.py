"""Retention SIGKILLed at each of its file-system operations in turn.

argv: template (a directory of committed steps 1-5 of one run: 1 and 4 bases, the others deltas
on the base below), out, run id. For N = 0, 1, ...: the template is copied to ``out/kN`` and a
forked process applies ``keep_last=2`` there (as the writer does after step 5 commits), killing
itself with SIGKILL at its N-th operation, until one finishes unkilled; then again into
``out/aN`` keeping step 2 (a delta on step 1) besides them (``also_keep``, an adapter's best
step). Prints ``RESULT {"killed": N, "statuses_killed": [...], "killed_also": M,
"statuses_killed_also": [...]}`` (each pass's unkilled point, the exit status of each killed
one). The fork keeps
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
    results = {}
    for name, also_keep in (("killed", ()), ("killed_also", (2,))):
        results[name], results[f"statuses_{name}"] = _kill_each(template, out, run_id, also_keep)
    print("RESULT", json.dumps(results), flush=True)


def _kill_each(
    template: str, out: str, run_id: str, also_keep: tuple[int, ...]
) -> tuple[int, list[int]]:
    """The kill points until one finishes unkilled (its number), and the killed ones' exit
    statuses; ``also_keep``: the steps kept besides the newest (``keep_also``), into
    ``out/aN`` (else ``out/kN``)."""
    statuses: list[int] = []
    for n in range(100):
        directory = os.path.join(out, f"{'a' if also_keep else 'k'}{n}")
        shutil.copytree(template, directory)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                storage = LocalStorage(directory)
                _kill_at(n)
                retention.apply_keep_last(
                    storage,
                    keep_last=2,
                    run_id=run_id,
                    newest=5,
                    next_base=4,
                    also_keep=also_keep,
                )
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            if os.WEXITSTATUS(status) != 0:
                raise SystemExit(f"retention failed at kill point {n}")
            return n, statuses
        statuses.append(-os.WTERMSIG(status))
    raise SystemExit("retention never finished")


if __name__ == "__main__":
    main()
