"""The engine benchmark's measurement loop: samples retried when other processes disturb them,
rotations of the methods, the cells of one state size and of the training loop."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import drop_file_cache, free, fsync_path, rm
from benchmarks._lib.machine import Idle, Others, loadavg, mem_available_gib, uptime
from benchmarks._lib.timing import perf
from benchmarks.engine.methods import RestoreCell, SaveCell
from benchmarks.engine.state import build_state, clone_tree, flat_tensors
from coci_core import CheckpointManager

IDLE: Idle | None = None  # set by the command line: waits for quiet cores within a budget
RETRIES = 2
DISTURBED = 0.3  # cores used by others during a sample above which it is retried


def sample(
    fn: Callable[[], dict[str, Any]], cleanup: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Run one measurement; if other processes used the cores meanwhile, wait and retry."""
    discarded: list[dict[str, Any]] = []
    for attempt in range(RETRIES + 1):
        la = loadavg()[0]
        with Others() as o:
            r = fn()
        r["load1_before"], r["others_cores"] = la, round(o.cores, 3)
        if (
            o.cores < DISTURBED
            or attempt == RETRIES
            or IDLE is None
            or IDLE.waited_s >= IDLE.budget_s
        ):
            break
        discarded.append(r)
        if cleanup is not None:
            cleanup()
        IDLE.wait(60)
    if discarded:
        r["discarded"] = discarded
    return r


# -- cells --------------------------------------------------------------------------------


def run_rotation(
    methods: list[str],
    reps: int,
    fn: Callable[[str], dict[str, Any]],
    log: Callable[[str], None],
    first_label: str = "first",
) -> dict[str, Any]:
    """Warm-up (first) pass in the listed order, then ``reps`` passes rotated by one each."""
    out: dict[str, Any] = {m: {first_label: None, "reps": []} for m in methods}
    if not methods:
        return out
    for m in methods:
        la = loadavg()
        with Others() as o:
            r = fn(m)  # the first save is never retried: it is the allocating one
        r["load1_before"], r["others_cores"] = la[0], round(o.cores, 3)
        out[m][first_label] = r
        log(f"    {first_label:>6} {m:<18} {fmt_sample(r)}")
    for rep in range(reps):
        if IDLE is not None:
            IDLE.wait(30)
        k = rep % len(methods)
        order = methods[k:] + methods[:k]
        for m in order:
            r = sample(lambda m=m: fn(m))
            r["rep"] = rep
            out[m]["reps"].append(r)
            log(f"    rep {rep:>2} {m:<18} {fmt_sample(r)}")
    return out


def fmt_sample(r: dict[str, Any]) -> str:
    keys = ("stall_s", "compute_s", "durable_s", "seconds")
    parts = [f"{k}={r[k]:.3f}" for k in keys if k in r]
    if "others_cores" in r:
        parts.append(
            f"others={r['others_cores']:.2f}"
            + (f" (retried {len(r['discarded'])}x)" if r.get("discarded") else "")
        )
    if "bytes" in r and ("durable_s" in r or "seconds" in r):
        t = r.get("durable_s", r.get("seconds"))
        parts.append(f"{r['bytes'] / t / 1e6:.0f} MB/s")
    return " ".join(parts)


def size_cell(
    size: int, args: argparse.Namespace, compute: Callable[[], None], log: Callable[[str], None]
) -> dict[str, Any]:
    root = Path(args.dir) / f"cell-{size}"
    rm(root)
    root.mkdir(parents=True)
    cell: dict[str, Any] = {
        "target_bytes": size,
        "uptime_before": uptime(),
        "mem_available_gib_before": mem_available_gib(),
    }
    t0 = perf()
    state, info = build_state(size)
    cell["state"] = info
    cell["build_s"] = perf() - t0
    log(f"  state: {info} (built in {cell['build_s']:.1f} s)")
    reps = args.reps if size < 2e9 else args.big_reps
    cell["reps"] = reps
    big = size >= 2e9
    methods = [
        "compute",
        "copy",
        "coci_block",
        "coci_nb",
        "torch_save",
        "safetensors",
        "raw_buffered",
        "raw_direct",
        "raw_direct_2t",
    ]
    dcp_methods = ["dcp_sync", "dcp_async"] if not args.no_dcp else []
    if args.quick:
        methods = [m for m in methods if m not in ("safetensors",)]
    groups = [methods + dcp_methods] if not big else [methods, ["compute", *dcp_methods]]
    cell["groups"] = groups
    saves: dict[str, Any] = {}
    for gi, group in enumerate(groups):
        if len(group) <= 1:
            continue
        sc = SaveCell(state, info, root, compute, args.dcp_threads)
        try:
            log(f"  save group {gi}: {group}, {reps} reps (load {loadavg()})")
            res = run_rotation(group, reps, lambda m, sc=sc: getattr(sc, f"run_{m}")(), log)
        finally:
            sc.close()
        for m, v in res.items():
            saves[m if m not in saves else f"{m}@g{gi}"] = v
    cell["saves"] = saves
    free()
    reference = flat_tensors(state)
    rc = RestoreCell(root, reference)
    try:
        rmethods = rc.available()
        log(f"  restore: {rmethods}, {reps} reps, each cold then warm")
        restores: dict[str, Any] = {m: {"cold": [], "warm": []} for m in rmethods}
        for rep in range(reps):
            k = rep % len(rmethods)
            for m in rmethods[k:] + rmethods[:k]:
                for kind in ("cold", "warm"):
                    r = sample(lambda m=m, kind=kind: rc.run(m, cold=kind == "cold"), cleanup=free)
                    r["rep"] = rep
                    restores[m][kind].append(r)
                    free()
                    log(f"    rep {rep:>2} {m:<18} {kind} {fmt_sample(r)}")
        cell["restores"] = restores
    finally:
        rc.close()
    del state, reference
    free()
    rm(root)
    cell["uptime_after"] = uptime()
    cell["seconds"] = perf() - t0
    return cell


# -- training loop ------------------------------------------------------------------------


def training_cell(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    root = Path(args.dir) / "train"
    rm(root)
    root.mkdir(parents=True)
    torch.manual_seed(0)
    width, layers, batch = args.train_width, args.train_layers, args.train_batch
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(batch, width)
    target = torch.randn(batch, width)
    params = sum(p.numel() for p in model.parameters())
    cell: dict[str, Any] = {
        "uptime_before": uptime(),
        "model": {"width": width, "layers": layers, "batch": batch, "params": params},
    }
    mgr = CheckpointManager(root / "coci", keep_last=1)
    bg: dict[str, threading.Thread | None] = {"thread": None}
    global_step = [0]

    def sd() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": global_step[0]}

    def save(method: str) -> None:
        if method == "coci_block":
            mgr.save(global_step[0], sd(), block=True)
        elif method == "coci_nb":
            mgr.save(global_step[0], sd(), block=False)
        elif method == "torch_save":
            torch.save(sd(), root / "ckpt.pt")
        elif method == "clone_bg_torch_save":
            if bg["thread"] is not None:
                bg["thread"].join()
            snapshot = clone_tree(sd())
            th = threading.Thread(target=torch.save, args=(snapshot, root / "ckpt-bg.pt"))
            th.start()
            bg["thread"] = th

    def settle() -> None:
        mgr.wait()
        if bg["thread"] is not None:
            bg["thread"].join()
            bg["thread"] = None
        for p in root.glob("*.pt"):
            fsync_path(p)
            drop_file_cache(p)

    def block(method: str, nsteps: int, save_at: set[int]) -> dict[str, Any]:
        times, save_steps, save_calls = [], [], []
        for i in range(nsteps):
            global_step[0] += 1
            t0 = perf()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            if method == "coci_nb":
                mgr.before_update()
            opt.step()
            if i in save_at:
                s0 = perf()
                save(method)
                save_calls.append(perf() - s0)
            times.append(perf() - t0)
            save_steps.append(i in save_at)
        settle()
        return {"step_s": times, "save_step": save_steps, "save_call_s": save_calls}

    methods = ["none", "coci_block", "coci_nb", "torch_save", "clone_bg_torch_save"]
    n = args.train_steps
    save_at = {i for i in range(n) if i % args.train_every == args.train_every // 2}
    cell.update(
        steps_per_block=n,
        save_every=args.train_every,
        save_at=sorted(save_at),
        rounds=args.train_rounds,
    )
    res: dict[str, Any] = {m: {"warmup": None, "rounds": []} for m in methods}
    log(
        f"  training: {params / 1e6:.1f} M params, batch {batch}, {n} steps per block, saves at "
        f"{sorted(save_at)}"
    )
    try:
        warm_n = args.train_every + 1
        for m in methods:
            la = loadavg()
            r = block(m, warm_n, {args.train_every // 2})
            r["load1_before"] = la[0]
            res[m]["warmup"] = r
            log(f"    warmup {m:<20} steps {[round(t, 3) for t in r['step_s']]}")
        for rnd in range(args.train_rounds):
            if IDLE is not None:
                IDLE.wait(30)
            k = rnd % len(methods)
            for m in methods[k:] + methods[:k]:
                la = loadavg()
                r = sample(lambda m=m: block(m, n, save_at))
                r["round"] = rnd
                res[m]["rounds"].append(r)
                log(
                    f"    round {rnd} {m:<20} mean {statistics.fmean(r['step_s']):.3f} s, "
                    f"steps {[round(t, 2) for t in r['step_s']]} load {la[0]} others "
                    f"{r['others_cores']:.2f}"
                    + (f" (retried {len(r['discarded'])}x)" if r.get("discarded") else "")
                )
    finally:
        mgr.close()
    cell["methods"] = res
    cell["state_bytes"] = 0
    with contextlib.suppress(Exception):
        m = CheckpointManager(root / "coci", keep_last=1)
        cell["state_bytes"] = sum(t.nbytes for t in m.manifest(m.latest_step()).tensors)
        m.close()
    cell["uptime_after"] = uptime()
    rm(root)
    return cell
