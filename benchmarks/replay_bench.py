"""The training thread's cost of replaying a cached layout: coci's checks over all tensors at
once against one fingerprint per tensor (the way before), interleaved save by save.

    python -m benchmarks.replay_bench --rounds 15

For each state (``tensor_count_bench``'s), two managers save the same state with
``save(block=True)``, alternating save by save (the first of each round rotates):

* **bulk** (coci's default): the tensors' addresses read by one ``map``, the rest of their
  layouts by one guard over all of them (``FlattenCache``), dicts of tensors (and an
  optimizer's dicts of them under int keys) replayed whole;
  and no version counter read for a save that copies everything before it returns;
* **per tensor**: every dict walked key by key, one fingerprint (address, dtype, shape,
  strides, device, lazy bits) read per tensor and every tensor's version counter read, as
  the replay did before.

Per save: the stall (wall time in ``save()``), the main thread's CPU time in it, and its CPU
time in the replay alone (``flatten_state`` and binding the arena, ``Snapshotter.prepare``:
what the two ways differ in, less disturbed by other processes than the copy); printed:
medians over rounds, and each state's stall over the ``64x4MiB`` state's when both ran. Every
sample waits until the writer is idle before the next save.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
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
from coci_core.engine import manager
from coci_core.engine.format import tree
from coci_core.engine.save import snapshot

STATES = ("64x4MiB", "3000-mixed", "gpt-adamw", "50000x1KiB")
VARIANTS = ("bulk", "per_tensor")
KEEP_LAST = 3


def log(msg: str) -> None:
    print(msg, flush=True)


def _check_each(self: Any) -> None:
    """``check_layouts`` as the replay did it before: one fingerprint per tensor."""
    cache = self._cache
    if self.others != cache.others:
        raise tree._Miss
    for k, t in enumerate(self.plains):
        i = cache.plain_at[k]
        fingerprint = tree._fingerprint(t)
        if cache.fingerprints[i] != fingerprint:
            if tree._storage_short(t):
                raise tree._Miss
            self._moves(i, fingerprint)


def _no_dict(self: Any, d: Any, key: str) -> None:
    return None


@contextlib.contextmanager
def _per_tensor(on: bool) -> Iterator[None]:
    """The replay without its checks over all tensors at once (see the module's doc)."""
    if not on:
        yield
        return
    cls = tree._Flattener
    real = cls.check_layouts, cls._replay_tensor_dict, cls._replay_dict_dicts
    prepare = snapshot.Snapshotter.prepare

    def versions_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        return prepare(self, *args, **{**kwargs, "background": True})

    cls.check_layouts = _check_each  # type: ignore[method-assign]
    cls._replay_tensor_dict = _no_dict  # type: ignore[method-assign,assignment]
    cls._replay_dict_dicts = _no_dict  # type: ignore[method-assign,assignment]
    snapshot.Snapshotter.prepare = versions_read  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.check_layouts, cls._replay_tensor_dict, cls._replay_dict_dicts = real  # type: ignore[method-assign]
        snapshot.Snapshotter.prepare = prepare  # type: ignore[method-assign]


@contextlib.contextmanager
def _replay_cpu(spent: list[float]) -> Iterator[None]:
    """Add the calling thread's CPU time in ``flatten_state`` and ``prepare`` to ``spent``."""
    flatten, prepare = manager.flatten_state, snapshot.Snapshotter.prepare

    def timed(f: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent.append(time.thread_time() - c0)

        return run

    manager.flatten_state = timed(flatten)  # type: ignore[attr-defined]
    snapshot.Snapshotter.prepare = timed(prepare)  # type: ignore[method-assign]
    try:
        yield
    finally:
        manager.flatten_state = flatten  # type: ignore[attr-defined]
        snapshot.Snapshotter.prepare = prepare  # type: ignore[method-assign]


def _save(mgr: CheckpointManager, root: Path, step: int, state: Any) -> dict[str, float]:
    spent: list[float] = []
    with _replay_cpu(spent):
        c0, t0 = time.thread_time(), time.perf_counter()
        handle = mgr.save(step, state, block=True)
        stall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    handle.wait()
    _wait_writer_idle(root, KEEP_LAST)
    return {"stall": stall, "cpu": cpu, "replay_cpu": sum(spent)}


def state_cell(name: str, rounds: int, quick: bool, scratch: Path) -> dict[str, Any]:
    state, info = build_state(name, quick)
    log(f"{name}: {info['tensors']} tensors, {info['bytes'] / 1e6:.1f} MB")
    roots = {k: scratch / name / k for k in VARIANTS}
    mgrs = {k: CheckpointManager(roots[k], keep_last=KEEP_LAST) for k in VARIANTS}
    samples: dict[str, dict[str, list[float]]] = {
        k: {"stall": [], "cpu": [], "replay_cpu": []} for k in VARIANTS
    }
    step = 0
    try:
        for r in range(3 + rounds):  # 3 unrecorded: the arena, the cache, the copy runs made
            step += 1
            for k in VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS)):
                with _per_tensor(k == "per_tensor"):
                    sample = _save(mgrs[k], roots[k], step, state)
                if r >= 3:
                    for m, v in sample.items():
                        samples[k][m].append(v)
    finally:
        for mgr in mgrs.values():
            mgr.close()
    summary = {k: {m: med(v) for m, v in s.items()} for k, s in samples.items()}
    return {"state": info, "samples": samples, "summary": summary}


def report(res: dict[str, Any]) -> str:
    cells = {c["state"]["name"]: c for c in res["cells"]}
    base = cells.get("64x4MiB")
    lines = [
        "| state | tensors | stall, bulk / per tensor | ratio | main thread CPU in save(), "
        "bulk / per tensor | of it in the replay | stall / 64x4MiB's, bulk / per tensor |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in cells.items():
        b, p = c["summary"]["bulk"], c["summary"]["per_tensor"]
        rel = "-"
        if base is not None and name != "64x4MiB":
            bb, bp = base["summary"]["bulk"]["stall"], base["summary"]["per_tensor"]["stall"]
            rel = f"{b['stall'] / bb:.2f}x / {p['stall'] / bp:.2f}x"
        lines.append(
            f"| {name} | {c['state']['tensors']} | {b['stall'] * 1e3:.1f} / "
            f"{p['stall'] * 1e3:.1f} ms | {b['stall'] / p['stall']:.2f}x | "
            f"{b['cpu'] * 1e3:.1f} / {p['cpu'] * 1e3:.1f} ms | "
            f"{b['replay_cpu'] * 1e3:.2f} / {p['replay_cpu'] * 1e3:.2f} ms | {rel} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--states", default=",".join(STATES), help=f"comma list of {STATES}")
    ap.add_argument("--rounds", type=int, default=15, help="rounds; medians over them")
    ap.add_argument("--quick", action="store_true", help="small states (a smoke test)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
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
    if args.threads is not None:
        torch.set_num_threads(args.threads)
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
        log(uptime())
        return out

    res, path = run_recorded("replay", run, scratch_dir=args.dir, out_dir=args.out)
    print(report(res))
    log(f"results in {path}")
    return res


if __name__ == "__main__":
    main()
