"""A child for tests/test_harness.py: it reports how it was started, then does what argv says.

argv: what (``report``, ``raise``, ``exit <code>``, ``wait``: block on stdin, ``thread``: print
from a non-daemon thread after the main module ends, ``fail <rank> <code>``: that rank exits
with that status, the others wait forever).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading

import torch


def main() -> None:
    what = sys.argv[1]
    atexit.register(print, "ATEXIT", flush=True)
    if what == "report":
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
        report = {
            "argv": sys.argv,
            "cwd": os.getcwd(),
            "env": os.environ.get("COCI_HARNESS_PROBE"),
            "rank": os.environ.get("RANK"),
            "world": os.environ.get("WORLD_SIZE"),
            "main_spec": getattr(sys.modules["__main__"].__spec__, "name", None),
            "path0": sys.path[0],
            "threads": torch.get_num_threads(),
            "hash": hash("coci"),
            "forked": b"tests.harness.zygote" in b" ".join(cmdline),
            "stdin": sys.stdin.read(),
        }
        print("RESULT " + json.dumps(report), flush=True)
        print("to stderr", file=sys.stderr)
    elif what == "raise":
        raise ValueError("the child's own error")
    elif what == "exit":
        sys.exit(int(sys.argv[2]))
    elif what == "fail":
        if os.environ["RANK"] == sys.argv[2]:
            sys.exit(int(sys.argv[3]))
        threading.Event().wait()
    elif what == "wait":
        print("READY", flush=True)
        sys.stdin.read()
    elif what == "thread":
        done = threading.Event()

        def late() -> None:
            done.wait(0.5)
            print("THREAD", flush=True)

        threading.Thread(target=late).start()


if __name__ == "__main__":
    main()
