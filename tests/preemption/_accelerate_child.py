"""The Accelerate loop of tests/accelerate/loop.py with the default ``preemption="auto"``.

argv: DIR, then ``notice`` (train on; print ``READY`` after step 3; on the notice print
``PREEMPTED <json>`` and let :class:`~coci_core.Preempted` end the process) or ``resume
TOTAL`` (resume and train to TOTAL; print ``RESULT <json>``).
"""

from __future__ import annotations

import json
import sys

from coci_core import Preempted
from tests.accelerate.loop import train


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    if mode == "resume":
        result = train(directory, int(sys.argv[3]))
        print("RESULT " + json.dumps({"start": result["start"]}), flush=True)
        return
    try:
        train(directory, 10**6, kill_at=3, on_kill=lambda acc: print("READY", flush=True))
    except Preempted as stop:
        print("PREEMPTED " + json.dumps({"saved": stop.step, "code": stop.code}), flush=True)
        raise


if __name__ == "__main__":
    main()
