"""When this process started, for the restart time: from the process's start to its first
training step after a restore (what a failure costs beyond the lost work)."""

from __future__ import annotations

import os
import time

__all__ = ["process_start_unix"]


def process_start_unix() -> float | None:
    """This process's start as a Unix time (Linux: ``/proc``), or None where unknown."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        # the command name (field 2) may hold spaces: the fields after it follow its ")"
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    # a clock stepped since boot, or a container's /proc of the host: not to be trusted
    return started if 0 <= time.time() - started < 30 * 86400 else None
