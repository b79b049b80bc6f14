"""The machine and its load: load averages, CPU used by other processes, waiting for quiet
cores, and a description of the machine for the result files."""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

perf = time.perf_counter
HZ = os.sysconf("SC_CLK_TCK")


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _proc_stat(pid: str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process and its live descendants,
    their reaped children included): a benchmark's own processes (DCP's writer process, a
    restore in a new process) are not a disturbance."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
    parent: dict[int, int] = {}
    cpu: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = _proc_stat(d)
        if st is None:
            continue
        parent[int(d)] = int(st[1])
        cpu[int(d)] = sum(int(x) for x in st[11:15])  # utime, stime, cutime, cstime
    me = os.getpid()
    ours = {me}
    grew = True
    while grew:
        grew = False
        for pid, pp in parent.items():
            if pp in ours and pid not in ours:
                ours.add(pid)
                grew = True
    return user + nice + system + irq + softirq + steal, sum(cpu.get(p, 0) for p in ours)


class Others:
    """CPU used by everything but this process and its descendants (cores, averaged over a
    window): the disturbance of a sample. Kernel writeback threads count too (a few % during
    writes)."""

    #: (busy jiffies of the machine, jiffies of what is not a disturbance)
    jiffies: Callable[[], tuple[int, int]] = staticmethod(tree_jiffies)

    def __enter__(self) -> Self:
        self.t0, (self.b0, self.s0) = perf(), self.jiffies()
        return self

    def __exit__(self, *exc: object) -> None:
        b, own = self.jiffies()
        wall = max(perf() - self.t0, 1e-3)
        self.cores = max(0.0, ((b - self.b0) - (own - self.s0)) / HZ / wall)


class Idle:
    """Waits (within a total budget) until other processes leave the cores alone: two quiet
    windows of ``poll_s`` in a row, others using fewer than ``threshold`` cores."""

    def __init__(
        self,
        budget_s: float,
        threshold: float,
        log: Callable[[str], None],
        poll_s: float = 1.0,
        log_after_s: float = 3.0,
    ) -> None:
        self.budget_s, self.threshold, self.log = budget_s, threshold, log
        self.poll_s, self.log_after_s = poll_s, log_after_s
        self.waited_s = 0.0

    @property
    def left_s(self) -> float:
        return self.budget_s - self.waited_s

    def wait(self, max_s: float = 90.0) -> float:
        start, quiet = perf(), 0
        while (
            quiet < 2
            and perf() - start < max_s
            and self.waited_s + (perf() - start) < self.budget_s
        ):
            with Others() as o:
                time.sleep(self.poll_s)
            quiet = quiet + 1 if o.cores < self.threshold else 0
        waited = perf() - start
        self.waited_s += waited
        if waited > self.log_after_s:
            self.log(
                f"    (waited {waited:.0f} s for other processes to leave the cores; {uptime()})"
            )
        return waited


def thread_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process's live Python threads other than the main one,
    by thread name (coci's writer and telemetry threads, AsyncCheckpointIO's executor...)."""
    out: dict[str, float] = {}
    for th in threading.enumerate():
        if th is threading.main_thread() or th.native_id is None:
            continue
        try:
            f = Path(f"/proc/self/task/{th.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[th.name] = out.get(th.name, 0.0) + (int(f[11]) + int(f[12])) / HZ
    return out


def machine(disk_of: str | None = None) -> dict[str, Any]:
    """CPUs, memory, versions and the disk under ``disk_of`` (``df -hT``; default: the
    system's temporary directory)."""
    import torch

    cpu_model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu_model = line.split(":", 1)[1].strip()
            break
    disk = subprocess.run(
        ["df", "-hT", disk_of or tempfile.gettempdir()], capture_output=True, text=True
    ).stdout.splitlines()[-1]
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "disk": " ".join(disk.split()[:3]),
    }
