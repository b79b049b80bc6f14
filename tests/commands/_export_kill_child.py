"""``coci export SRC OUT --format dcp --step N`` with the two-rename swap of a system without
``renameat2``, SIGKILLed between its two renames (OUT moved aside, the new export not yet in).

argv: SRC, OUT, N.
"""

from __future__ import annotations

import os
import signal
import sys

from coci_core.commands.cli import main
from coci_core.interop import swap


def main_child() -> None:
    src, out, step = sys.argv[1:4]
    swap._EXCHANGE = False
    renames = {"n": 0}
    rename = os.rename

    def killing_rename(a: object, b: object) -> None:
        if renames["n"] == 1:  # the second rename of the swap: the new export to OUT
            os.kill(os.getpid(), signal.SIGKILL)
        renames["n"] += 1
        rename(a, b)  # type: ignore[arg-type]

    by_renames = swap._swap_by_renames

    def swap_killed(new: object, target: object) -> None:
        os.rename = killing_rename  # type: ignore[assignment]
        by_renames(new, target)  # type: ignore[arg-type]

    swap._swap_by_renames = swap_killed  # type: ignore[assignment]
    sys.exit(main(["export", src, out, "--format", "dcp", "--step", step]))


if __name__ == "__main__":
    main_child()
