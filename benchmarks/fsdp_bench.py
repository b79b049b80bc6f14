#!/usr/bin/env python
"""An FSDP2 model and AdamW over 2 and 4 processes on one machine: coci against
``torch.distributed.checkpoint`` (DCP) ``save``, ``async_save`` and ``load``.

Run (several minutes; it only creates and deletes run-*/ under --dir):

    python -m benchmarks.fsdp_bench --worlds 2,4 --state-mb 512 --rounds 3

The model (``--state-mb`` of parameters and AdamW moments in all, fp32) is split by
``fully_shard`` over a 1-D mesh of every rank; the state saved is ``get_state_dict``'s (DTensor
shards, FSDP2's own layout). Every round runs the save methods in an order rotated by one; before
each, all ranks meet at a barrier and each times its own part from there. Per method and world
size (medians over rounds after a warm-up round): the blocking time of the slowest rank (the
call the training loop waits for), the time until the checkpoint is durable on the slowest rank,
and the bytes the busiest rank wrote against the bytes it holds. Restore: onto another layout of
the same processes (every tensor split along its last dim, as a tensor-parallel plan splits a
row-wise layer), coci's in-place restore against DCP's ``load`` into the same DTensors, with
both checkpoints' pages dropped from the page cache first (as after a restart: coci's writes
leave none there, DCP's would). Results: a JSON file (``--out``, default a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks._lib.files import dir_bytes, drop_file_cache, scratch
from benchmarks._lib.machine import loadavg
from benchmarks._lib.ranks import run_ranks
from benchmarks._lib.results import write_json

SAVES = ("coci", "coci_block_false", "dcp_save", "dcp_async_save")
RESTORES = ("coci_restore", "dcp_load")
HIDDEN = 1024


def _model(state_mb: int) -> Any:
    import torch

    params = state_mb * 2**20 // 4 // 3  # the parameters and AdamW's two moments
    layers = max(1, round(params / (HIDDEN * HIDDEN)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)))


def _owned_bytes(state: Any, world: int) -> int:
    """The bytes this rank holds: its DTensor shards whole, plain tensors a 1/world share."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0.0
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, DTensor):
            local = value.to_local()
            total += local.numel() * local.element_size()
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size() / world
    return int(total)


def _another_layout(state: Any, mesh: Any) -> Any:
    """Empty DTensors of ``state``'s shapes split along their last dim (plain values as they
    are): the whole state, as a restore onto another layout fills it."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if isinstance(state, dict):
        return {k: _another_layout(v, mesh) for k, v in state.items()}
    if isinstance(state, list):
        return [_another_layout(v, mesh) for v in state]
    if isinstance(state, DTensor):
        return distribute_tensor(torch.empty(state.shape), mesh, [Shard(state.ndim - 1)])
    if isinstance(state, torch.Tensor):
        return state.clone()
    return state


def rank_main(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from coci_core import CheckpointManager, RankGroup
    from coci_core.engine.restore.inplace import InPlaceTargets

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = _model(cfg["state_mb"])
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # moments made (zeros)
    state = {"model": model_sd, "optim": optim_sd, "step": 1}
    owned = _owned_bytes(state, world)
    root = Path(cfg["dir"]) / f"run-w{world}"
    group = RankGroup.from_torch_distributed(timeout_s=600)
    managers = {
        "coci": CheckpointManager(root / "coci", keep_last=1, group=group),
        "coci_block_false": CheckpointManager(root / "coci_bf", keep_last=1, group=group),
    }
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    samples: list[dict[str, Any]] = []
    for rnd in range(cfg["rounds"] + 1):  # round 0 is the warm-up
        k = rnd % len(SAVES)
        for method in SAVES[k:] + SAVES[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            if method in managers:
                mgr = managers[method]
                handle = mgr.save(rnd + 1, state, block=method == "coci")
                blocking = time.perf_counter() - t0
                handle.wait()
                durable = time.perf_counter() - t0
                step_dir = (
                    root / ("coci" if method == "coci" else "coci_bf") / f"step-{rnd + 1:010d}"
                )
                dist.barrier()
                written = dir_bytes(step_dir, f"data-r{rank}")
            else:
                target = root / method / f"round{rnd}"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if method == "dcp_save":
                        dcp.save(state, checkpoint_id=str(target))
                        blocking = durable = time.perf_counter() - t0
                    else:
                        future = dcp.async_save(
                            state, checkpoint_id=str(target), async_stager=stager
                        )
                        blocking = time.perf_counter() - t0
                        getattr(future, "upload_completion", future).result()
                        durable = time.perf_counter() - t0
                dist.barrier()
                written = dir_bytes(target, f"__{rank}_")
            samples.append(
                {
                    "round": rnd,
                    "method": method,
                    "rank": rank,
                    "blocking_s": blocking,
                    "durable_s": durable,
                    "bytes": written,
                    "owned": owned,
                }
            )
        # restore onto another layout: every tensor split along its last dim
        for method in RESTORES[rnd % 2 :] + RESTORES[: rnd % 2]:
            targets = _another_layout(state, mesh)
            drop_file_cache(root / "coci")  # cold, as after a restart (coci's own writes
            drop_file_cache(root / "dcp_save")  # leave nothing in the cache; DCP's would)
            dist.barrier()
            t0 = time.perf_counter()
            if method == "coci_restore":
                managers["coci"].restore(targets=InPlaceTargets(targets))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.load(targets, checkpoint_id=str(root / "dcp_save" / f"round{rnd}"))
            seconds = time.perf_counter() - t0
            samples.append({"round": rnd, "method": method, "rank": rank, "restore_s": seconds})
        dist.barrier()
        if rank == 0:
            for method in ("dcp_save", "dcp_async_save"):
                shutil.rmtree(root / method, ignore_errors=True)
    for mgr in managers.values():
        mgr.close()
    print("SAMPLES " + json.dumps(samples), flush=True)
    dist.barrier()
    os._exit(0)


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    rounds = sorted({s["round"] for s in samples if s["round"] > 0})
    out: dict[str, Any] = {}
    for method in SAVES:
        rows = [[s for s in samples if s["round"] == r and s["method"] == method] for r in rounds]
        out[method] = {
            "blocking_s": statistics.median(max(x["blocking_s"] for x in row) for row in rows),
            "durable_s": statistics.median(max(x["durable_s"] for x in row) for row in rows),
            "written_over_owned": statistics.median(
                max(x["bytes"] / x["owned"] for x in row) for row in rows
            ),
            "busiest_rank_bytes": statistics.median(max(x["bytes"] for x in row) for row in rows),
        }
    for method in RESTORES:
        rows = [[s for s in samples if s["round"] == r and s["method"] == method] for r in rounds]
        out[method] = {
            "restore_s": statistics.median(max(x["restore_s"] for x in row) for row in rows)
        }
    return out


def report(results: dict[str, Any]) -> str:
    lines = [
        "| processes | method | blocking s | durable s | busiest rank: written / held |"
        " restore onto another layout s |",
        "|---|---|---|---|---|---|",
    ]
    for world, cell in results["worlds"].items():
        s = cell["summary"]
        for method in SAVES:
            m = s[method]
            lines.append(
                f"| {world} | {method} | {m['blocking_s']:.3f} | {m['durable_s']:.3f} "
                f"| {m['written_over_owned']:.3f} | |"
            )
        for method in RESTORES:
            lines.append(f"| {world} | {method} | | | | {s[method]['restore_s']:.3f} |")
        ratio = s["dcp_async_save"]["blocking_s"] / max(s["coci"]["blocking_s"], 1e-9)
        load = s["coci_restore"]["restore_s"] / max(s["dcp_load"]["restore_s"], 1e-9)
        lines.append(
            f"| {world} | ratios | DCP async_save / coci blocking: {ratio:.2f}x "
            f"| | | coci restore / DCP load: {load:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated process counts")
    parser.add_argument("--state-mb", type=int, default=512, help="total state in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: temporary)")
    parser.add_argument("--out", default=None, help="results JSON (default: in --dir)")
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return {}
    if args.state_mb < 1 or args.rounds < 1:
        parser.error("--state-mb and --rounds must be at least 1")
    directory = scratch(args.dir, "fsdp")
    cfg = {"dir": str(directory), "state_mb": args.state_mb, "rounds": args.rounds}
    results: dict[str, Any] = {"config": cfg, "load_before": loadavg(), "worlds": {}}
    for world in [int(w) for w in args.worlds.split(",")]:
        samples = run_ranks("benchmarks.fsdp_bench", world, cfg)
        results["worlds"][str(world)] = {"samples": samples, "summary": summarize(samples)}
        shutil.rmtree(Path(directory) / f"run-w{world}", ignore_errors=True)
    results["load_after"] = loadavg()
    out = Path(args.out) if args.out else Path(directory) / "fsdp.json"
    write_json(out, results)
    print(report(results))
    print(f"results: {out}")
    return results


if __name__ == "__main__":
    main()
