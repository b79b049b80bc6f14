"""What a save costs the training thread beyond the copy: the per-tensor copy and the writer's
garbage collections, each measured against the way it was done before, interleaved.

    python -m benchmarks.save_overheads_bench --rounds 8

For each state (``tensor_count_bench``'s), two comparisons, the variants alternating save by
save (the first of each round rotates):

* **copy**: the stall of ``save(block=True)`` with small tensors copied by runs of
  ``torch.cat`` (coci's default) against one ``torch._foreach_copy_`` of every tensor (two
  managers, one per variant, the same state);
* **writer**: one manager, the writer building a save's records with the cyclic collector
  paused (coci's default) against with it running (``gc_paused`` made a no-op in the writer):
  the writer thread's CPU time per save, and the time spent in garbage collections per save,
  in the writer's threads and in the main thread, from ``gc.callbacks``.

Every sample waits until the writer is idle before the next save. The collector is left to
run as it would (no ``gc.collect()`` between samples): a full collection comes every few saves,
so the writer's figures are means over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.machine import machine, uptime
from benchmarks._lib.results import run_recorded
from benchmarks._lib.timing import med, parse_choices
from benchmarks.tensor_count_bench import _wait_writer_idle, build_state
from coci_core import CheckpointManager
from coci_core.engine.save import persist, snapshot
from coci_core.engine.save import writer as writer_module

STATES = ("64x4MiB", "3000-mixed", "gpt-adamw", "50000x1KiB")
KEEP_LAST = 3


def log(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def _per_tensor_copy(on: bool) -> Iterator[None]:
    """The snapshot without copy runs: one copy per tensor, as before runs existed."""
    if not on:
        yield
        return
    real = snapshot.Snapshotter._copy_runs

    def none(self: Any, arena: Any, leaves: Any, layout: Any) -> None:
        return None

    snapshot.Snapshotter._copy_runs = none  # type: ignore[method-assign]
    try:
        yield
    finally:
        snapshot.Snapshotter._copy_runs = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _collector_running(on: bool) -> Iterator[None]:
    """The writer without its pause of the collector."""
    if not on:
        yield
        return
    names = vars(persist)  # the writer's own reference to the pause (a module global)
    real = names["gc_paused"]
    names["gc_paused"] = contextlib.nullcontext
    try:
        yield
    finally:
        names["gc_paused"] = real


class _Probe:
    """The writer thread's CPU time per save and the time in collections by thread."""

    def __init__(self) -> None:
        self.writer_cpu: list[float] = []
        self.gc_s: dict[str, float] = {}
        self._start: dict[int, float] = {}
        self._real_run = writer_module.SaveWriter.run

    def __enter__(self) -> _Probe:
        probe, real = self, self._real_run

        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return real(self, *args, **kwargs)
            finally:
                probe.writer_cpu.append(time.thread_time() - t0)

        writer_module.SaveWriter.run = run  # type: ignore[method-assign]
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)
        writer_module.SaveWriter.run = self._real_run  # type: ignore[method-assign]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._start[ident] = time.perf_counter()
            return
        began = self._start.pop(ident, None)
        if began is None:
            return
        name = threading.current_thread().name
        who = "main" if name == "MainThread" else "writer" if "persist" in name else "other"
        self.gc_s[who] = self.gc_s.get(who, 0.0) + time.perf_counter() - began

    def take(self) -> dict[str, float]:
        out = {
            "writer_cpu_s": sum(self.writer_cpu),
            **{f"gc_{k}_s": v for k, v in self.gc_s.items()},
        }
        self.writer_cpu, self.gc_s = [], {}
        return out


def _save(mgr: CheckpointManager, root: Path, step: int, state: Any) -> float:
    t0 = time.perf_counter()
    handle = mgr.save(step, state, block=True)
    stall = time.perf_counter() - t0
    handle.wait()
    _wait_writer_idle(root, KEEP_LAST)
    return stall


def state_cell(name: str, rounds: int, quick: bool, scratch: Path) -> dict[str, Any]:
    state, info = build_state(name, quick)
    log(f"{name}: {info['tensors']} tensors, {info['bytes'] / 1e6:.1f} MB")
    copy: dict[str, list[float]] = {"runs": [], "per_tensor": []}
    roots = {k: scratch / name / f"copy-{k}" for k in copy}
    mgrs = {k: CheckpointManager(roots[k], keep_last=KEEP_LAST) for k in copy}
    writer: dict[str, list[dict[str, float]]] = {"paused": [], "running": []}
    wroot = scratch / name / "writer"
    wmgr = CheckpointManager(wroot, keep_last=KEEP_LAST)
    step = 0
    try:
        for _ in range(3):  # the arena, the flatten cache and the copy runs made
            step += 1
            for k, mgr in mgrs.items():
                with _per_tensor_copy(k == "per_tensor"):
                    _save(mgr, roots[k], step, state)
            _save(wmgr, wroot, step, state)
        wstep = step
        for r in range(rounds):
            step += 1
            order = list(copy) if r % 2 == 0 else list(reversed(copy))
            for k in order:
                with _per_tensor_copy(k == "per_tensor"):
                    copy[k].append(_save(mgrs[k], roots[k], step, state))
            for k in list(writer) if r % 2 == 0 else list(reversed(writer)):
                wstep += 1
                with _Probe() as probe, _collector_running(k == "running"):
                    _save(wmgr, wroot, wstep, state)
                    writer[k].append(probe.take())
    finally:
        for mgr in (*mgrs.values(), wmgr):
            mgr.close()
    summary: dict[str, Any] = {k: med(v) for k, v in copy.items()}
    for k, samples in writer.items():
        keys = sorted({key for s in samples for key in s})
        summary[k] = {key: med([s.get(key, 0.0) for s in samples]) for key in keys}
        summary[k]["mean"] = {
            key: sum(s.get(key, 0.0) for s in samples) / len(samples) for key in keys
        }
    return {"state": info, "copy": copy, "writer": writer, "summary": summary}


def report(res: dict[str, Any]) -> str:
    lines = [
        "| state | tensors | stall, copy runs | one copy per tensor | ratio |",
        "|---|---|---|---|---|",
    ]
    for c in res["cells"]:
        s = c["summary"]
        lines.append(
            f"| {c['state']['name']} | {c['state']['tensors']} | {s['runs'] * 1e3:.1f} ms | "
            f"{s['per_tensor'] * 1e3:.1f} ms | {s['runs'] / s['per_tensor']:.2f}x |"
        )
    lines += [
        "",
        "| state | writer CPU per save, paused / running (mean) | collections in the writer "
        "per save (mean) | in the main thread (mean) |",
        "|---|---|---|---|",
    ]
    for c in res["cells"]:
        p, r = c["summary"]["paused"]["mean"], c["summary"]["running"]["mean"]
        lines.append(
            f"| {c['state']['name']} | {p['writer_cpu_s'] * 1e3:.0f} / "
            f"{r['writer_cpu_s'] * 1e3:.0f} ms | {p.get('gc_writer_s', 0.0) * 1e3:.1f} / "
            f"{r.get('gc_writer_s', 0.0) * 1e3:.1f} ms | {p.get('gc_main_s', 0.0) * 1e3:.1f} / "
            f"{r.get('gc_main_s', 0.0) * 1e3:.1f} ms |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--states", default=",".join(STATES), help=f"comma list of {STATES}")
    ap.add_argument("--rounds", type=int, default=8, help="rounds; medians and means over them")
    ap.add_argument("--quick", action="store_true", help="small states (a smoke test)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: temp)")
    ap.add_argument(
        "--out",
        default=str(Path(tempfile.gettempdir()) / "coci-bench-results"),
        help="results directory (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    states = parse_choices(args.states, STATES, "states")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)

    def run(scratch: Path) -> dict[str, Any]:
        out: dict[str, Any] = {
            "machine": machine(disk_of=str(scratch)),
            "rounds": args.rounds,
            "quick": args.quick,
            "torch_threads": torch.get_num_threads(),
            "cells": [],
        }
        log(f"machine: {out['machine']}; {uptime()}")
        for name in states:
            out["cells"].append(state_cell(name, args.rounds, args.quick, scratch))
        return out

    res, path = run_recorded("save-overheads", run, scratch_dir=args.dir, out_dir=args.out)
    print(report(res))
    log(f"results in {path}")
    return res


if __name__ == "__main__":
    main()
