#!/usr/bin/env python
"""Benchmark of coci's engine against the copy limit, torch.save, DCP async_save, safetensors
and raw fsync'ed disk writes; restore speed; and step-time overhead in a CPU training loop.

Run (about 20 minutes on 2 idle cores; it only creates and deletes cell-*/ and train/ under --dir):

    python -m benchmarks.engine_bench --sizes 100M,1G,4G --reps 5 --dir bench-tmp/engine

Writes benchmarks/results/engine-<time>.json (every sample, load averages, machine) and prints
Markdown tables; ``--report FILE.json`` prints the tables of an earlier run again.

Method: every method runs once as a warm-up (its first, allocating save is reported apart);
then ``--reps`` repetitions, each running every method once, in an order rotated by one per
repetition. Medians are over repetitions. Each save is made durable and its file pages are
dropped from the page cache before the next method runs, so that methods do not overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._lib.files import scratch
from benchmarks._lib.machine import Idle, machine, mem_available_gib, uptime
from benchmarks._lib.results import write_json
from benchmarks._lib.timing import parse_size, perf
from benchmarks.engine import measure
from benchmarks.engine.measure import size_cell, training_cell
from benchmarks.engine.report import report
from benchmarks.engine.state import compute_fn


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sizes",
        default="100M,1G,4G",
        help="state sizes (decimal units); empty: training loop only",
    )
    ap.add_argument("--reps", type=int, default=5, help="steady-state repetitions per method")
    ap.add_argument("--big-reps", type=int, default=3, help="repetitions for states >= 2 GB")
    ap.add_argument(
        "--dir",
        default=None,
        help="scratch directory on the disk under test (default: a new temporary one)",
    )
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results"), help="results directory"
    )
    ap.add_argument(
        "--compute-s",
        type=float,
        default=1.0,
        help="simulated compute between save(block=False) and before_update",
    )
    ap.add_argument(
        "--dcp-threads", type=int, default=1, help="FileSystemWriter thread_count for DCP"
    )
    ap.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    ap.add_argument("--no-train", action="store_true", help="skip the training loop")
    ap.add_argument("--train-width", type=int, default=4096)
    ap.add_argument("--train-layers", type=int, default=4)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=10, help="steps per method per round")
    ap.add_argument("--train-every", type=int, default=5, help="save every N steps")
    ap.add_argument("--train-rounds", type=int, default=3)
    ap.add_argument(
        "--idle-budget",
        type=float,
        default=300,
        help="total seconds the run may wait for other processes to leave the cores",
    )
    ap.add_argument(
        "--idle-threshold", type=float, default=0.15, help="cores used by others that count as idle"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 reps, small training, no safetensors save",
    )
    ap.add_argument("--report", metavar="JSON", help="print the tables of an earlier run and exit")
    args = ap.parse_args()
    args.dir = scratch(args.dir, "engine")
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
    if args.quick:
        args.reps, args.big_reps, args.train_rounds = 2, 1, 1
        args.train_layers, args.train_steps, args.train_every = 2, 6, 3
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_path = out_dir / f"engine-{stamp}.json"
    Path(args.dir).mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    t_start = perf()
    res: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": machine(args.dir),
        "args": vars(args),
        "cells": [],
    }
    idle = measure.IDLE = Idle(args.idle_budget, args.idle_threshold, log)
    idle.wait(60)
    compute, cinfo = compute_fn(args.compute_s)
    res["compute"] = cinfo
    log(f"machine {res['machine']}; compute {cinfo}; {uptime()}")

    def dump() -> None:
        res["seconds"] = perf() - t_start
        write_json(out_path, res)

    for s in filter(None, args.sizes.split(",")):
        size = parse_size(s)
        idle.wait(90)
        log(f"cell {s} ({uptime()}, MemAvailable {mem_available_gib():.1f} GiB)")
        res["cells"].append(size_cell(size, args, compute, log))
        dump()
    if not args.no_train:
        idle.wait(90)
        log(f"training loop ({uptime()})")
        res["training"] = training_cell(args, log)
    res["idle_waited_s"] = idle.waited_s
    dump()
    log(f"done in {res['seconds'] / 60:.1f} min; results in {out_path}")
    print(report(res))


if __name__ == "__main__":
    main()
