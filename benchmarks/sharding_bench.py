#!/usr/bin/env python
"""Sharded saves over 1, 2 and 4 processes on one machine: every rank writing its share (coci),
rank 0 writing everything (coci with ``alone=True``, what coci did before sharding), and
``torch.distributed.checkpoint.save`` with its default, deduplicating planner.

Run (a few minutes; it only creates and deletes run-*/ under --dir):

    python -m benchmarks.sharding_bench --worlds 1,2,4 --size 1G --reps 5 \
        --dir bench-tmp/sharding

The state is the engine benchmark's transformer (fp32 weights + Adam state), the same on every
rank (data parallel). Every repetition runs the methods in an order rotated by one; before each
method all ranks meet at a barrier, and each rank times its own part from there. Reported per
method and world size (medians over repetitions): the stall of the slowest rank (the save call,
block=True: the copy), the critical path (rank 0's time until the checkpoint is committed:
coci's ``wait()``, DCP's ``save`` return), the bytes the busiest rank wrote against the total.
Results: benchmarks/results/sharding-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._lib.files import dir_bytes, scratch
from benchmarks._lib.machine import loadavg
from benchmarks._lib.ranks import run_ranks
from benchmarks._lib.results import results_path, write_json
from benchmarks._lib.timing import parse_size

METHODS = ("coci_sharded", "coci_rank0", "dcp")


def rank_main(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benchmarks.engine.state import build_state
    from coci_core import CheckpointManager, RankGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state, _ = build_state(cfg["size"])
    root = Path(cfg["dir"]) / f"run-w{world}"
    group = RankGroup.from_torch_distributed(timeout_s=600)
    sharded = CheckpointManager(root / "coci_sharded", keep_last=1, group=group)
    rank0 = CheckpointManager(root / "coci_rank0", keep_last=1, group=group)
    samples: list[dict[str, Any]] = []
    for rep in range(cfg["reps"] + 1):  # repetition 0 is the warm-up
        order = METHODS[rep % 3 :] + METHODS[: rep % 3]
        for method in order:
            dist.barrier()
            t0 = time.perf_counter()
            stall = durable = 0.0
            written = 0
            if method == "coci_sharded":
                handle = sharded.save(rep, state)
                stall = time.perf_counter() - t0
                event = handle.wait()
                durable = time.perf_counter() - t0
                written = event.bytes_written
            elif method == "coci_rank0":
                if rank == 0:
                    handle = rank0.save(rep, state, alone=True)
                    stall = time.perf_counter() - t0
                    event = handle.wait()
                    durable = time.perf_counter() - t0
                    written = event.bytes_written
            else:
                target = root / "dcp" / f"rep{rep}"
                dcp.save(state, checkpoint_id=str(target))
                durable = stall = time.perf_counter() - t0
                dist.barrier()
                written = dir_bytes(target, f"__{rank}_")
            samples.append(
                {
                    "rep": rep,
                    "method": method,
                    "rank": rank,
                    "stall_s": stall,
                    "durable_s": durable,
                    "bytes": written,
                }
            )
            dist.barrier()
            if method == "dcp" and rank == 0:
                shutil.rmtree(root / "dcp", ignore_errors=True)
    sharded.close()
    rank0.close()
    print("SAMPLES " + json.dumps(samples), flush=True)
    dist.barrier()
    os._exit(0)


def summarize(world: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method in METHODS:
        reps = sorted({s["rep"] for s in samples if s["rep"] > 0})
        stall, crit, busiest, total = [], [], [], []
        for rep in reps:
            rows = [s for s in samples if s["rep"] == rep and s["method"] == method]
            stall.append(max(r["stall_s"] for r in rows))
            crit.append(max(r["durable_s"] for r in rows))
            busiest.append(max(r["bytes"] for r in rows))
            total.append(sum(r["bytes"] for r in rows))
        out[method] = {
            "stall_s": statistics.median(stall),
            "critical_path_s": statistics.median(crit),
            "critical_path_range": [min(crit), max(crit)],
            "busiest_rank_bytes": statistics.median(busiest),
            "total_bytes": statistics.median(total),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--size", default="1G")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--dir", default=None, help="scratch directory (default: a new temporary one)"
    )
    parser.add_argument("--rank-config")
    args = parser.parse_args()
    args.dir = scratch(args.dir, "sharding")
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    cfg = {"dir": args.dir, "size": parse_size(args.size), "reps": args.reps}
    load_before = loadavg()
    results: dict[str, Any] = {"config": cfg, "load_before": load_before, "worlds": {}}
    for world in [int(w) for w in args.worlds.split(",")]:
        started = time.perf_counter()
        samples = run_ranks("benchmarks.sharding_bench", world, cfg)
        results["worlds"][str(world)] = {
            "samples": samples,
            "summary": summarize(world, samples),
            "seconds": time.perf_counter() - started,
            "load_after": loadavg(),
        }
        shutil.rmtree(Path(args.dir) / f"run-w{world}", ignore_errors=True)
    out = results_path("sharding")
    write_json(out, results)
    print(f"results: {out}; load before {load_before}")
    print(
        "| world | method | stall s (slowest rank) | critical path s (min-max) "
        "| busiest rank MB | total MB | busiest / total |"
    )
    print("|---|---|---|---|---|---|---|")
    for world, cell in results["worlds"].items():
        for method, m in cell["summary"].items():
            lo, hi = m["critical_path_range"]
            print(
                f"| {world} | {method} | {m['stall_s']:.3f} | {m['critical_path_s']:.3f} "
                f"({lo:.3f}-{hi:.3f}) | {m['busiest_rank_bytes'] / 1e6:.0f} | "
                f"{m['total_bytes'] / 1e6:.0f} | "
                f"{m['busiest_rank_bytes'] / max(1, m['total_bytes']):.2f} |"
            )


if __name__ == "__main__":
    main()
