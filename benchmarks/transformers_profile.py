#!/usr/bin/env python
"""Where the steps after a ``CociCallback`` save lose their time (issue 39): the run of
``transformers_bench`` for (a) and (c), with CPU and scheduler accounting that a loaded
machine moves less than wall time.

For each step, by its place after a save (+0: the step whose end saves, the stall included),
the training thread's wall time, its CPU time and its wait on the run queue (both from
``/proc/self/task/<tid>/schedstat``), the rest (off the CPU and not runnable: waiting for the
GIL or another lock) and its voluntary switches; for (c), the CPU and wall time of each part
of the writer's work per save (on the thread that ran it). Linux only.

Run (the figures in docs/benchmarks-adapters.md, "Profile of the steps after a save"):

    python -m benchmarks.transformers_profile --reps 2 --steps 50 --dir bench-tmp/prof
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import transformers_bench as tb
from benchmarks._lib.files import scratch
from coci_core.engine.directory import retention
from coci_core.engine.save import persist, snapshot
from coci_core.engine.save import writer as save_writer
from coci_core.storage import local

#: (label, step when it began, wall s, CPU s, thread name) of each timed part of a save
PARTS: list[tuple[str, int, float, float, str]] = []
#: (step, wall ms, run ms, run-queue wait ms, voluntary switches) at each step's end
ENDS: list[tuple[int, float, float, float, int]] = []


def sched(tid: int) -> tuple[float, float, int]:
    """The thread's CPU and run-queue wait (ms) and voluntary switches so far."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait, _ = f.read().split()
    switches = 0
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                switches = int(line.split()[1])
    return int(run) / 1e6, int(wait) / 1e6, switches


def timed(owner: Any, name: str, label: str) -> None:
    """Record each call of ``owner.name`` in :data:`PARTS`."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        step = ENDS[-1][0] if ENDS else 0
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            thread = threading.current_thread().name.rstrip("_0123456789")
            PARTS.append((label, step, wall, cpu, thread))

    setattr(owner, name, wrapper)


def instrument() -> None:
    tid = threading.get_native_id()  # the training thread
    clock_end = tb.Clock.on_step_end

    def on_step_end(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        clock_end(self, args, state, control, **kwargs)
        ENDS.append((state.global_step, time.perf_counter() * 1e3, *sched(tid)))

    tb.Clock.on_step_end = on_step_end  # type: ignore[method-assign]
    timed(snapshot.Snapshotter, "copy", "copy")
    timed(persist._Pieces, "checksum_raw", "checksums")
    timed(local.LocalStorage, "write_file", "write_file")
    timed(persist, "_manifest_json", "manifest JSON")
    timed(persist._Pieces, "share", "commit records")
    timed(local.LocalStorage, "publish", "publish")
    timed(retention, "make_room", "make_room")
    timed(retention, "apply_keep_last", "retention")
    timed(retention, "remove_uncommitted", "remove_uncommitted")
    timed(save_writer.SaveWriter, "run", "whole save")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--every", type=int, default=10, help="K")
    p.add_argument("--methods", default="ac", help="of transformers_bench's (a) to (e)")
    a = p.parse_args()
    torch.set_num_threads(1)
    bench = argparse.Namespace(
        steps=a.steps, warmup=10, every=a.every, mtbf=1800.0, d_model=384, heads=6, layers=4,
        vocab=8192, seq=32, batch=4, threads=1, tiny=False,
    )  # fmt: skip
    instrument()
    root = Path(scratch(a.dir, "transformers-profile"))
    steps: dict[str, dict[int, list[tuple[float, ...]]]] = {}
    parts: dict[tuple[str, str], list[tuple[float, float]]] = {}
    methods = list(a.methods)
    for rep in range(a.reps):
        for m in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            ENDS.clear()
            PARTS.clear()
            r = tb.run(m, bench, root / m)
            for (_, w0, r0, q0, v0), (step, w1, r1, q1, v1) in itertools.pairwise(ENDS):
                if step > bench.warmup:
                    wall, run, wait = w1 - w0, r1 - r0, q1 - q0
                    row = (wall, run, wait, wall - run - wait, v1 - v0)
                    steps.setdefault(m, {}).setdefault((step - 1) % a.every, []).append(row)
            for label, step, wall, cpu, thread in PARTS:
                if step > bench.warmup:
                    parts.setdefault((label, thread), []).append((wall, cpu))
            load = os.getloadavg()[0]
            print(f"rep {rep} {m}: saves within the run {100 * r['within_run_overhead']:+.1f} %, "
                  f"load {load:.1f}")  # fmt: skip
    med = statistics.median
    print("\nThe training thread, per step by its place after a save (medians, ms):")
    for m, by in sorted(steps.items()):
        print(f"\n({m}) | wall | CPU | run-queue wait | blocked (mean) | voluntary switches")
        for k, rows in sorted(by.items()):
            print(
                f"+{k} | {med(x[0] for x in rows):.1f} | {med(x[1] for x in rows):.1f} | "
                f"{med(x[2] for x in rows):.1f} | {med(x[3] for x in rows):.1f} "
                f"({statistics.mean(x[3] for x in rows):.1f}) | "
                f"{statistics.mean(x[4] for x in rows):.1f}"
            )
    print("\nEach save's parts (medians of the calls after the warm-up, ms): thread | wall | CPU")
    for (label, thread), v in sorted(parts.items()):
        print(f"{label} | {thread} | {1e3 * med(x[0] for x in v):.2f} | "
              f"{1e3 * med(x[1] for x in v):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
