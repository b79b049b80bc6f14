"""The planner's own time in a short trial process, as in ``benchmarks/hpo_bench.py``.

Run:  python -m benchmarks.planning_cost [--runs 11] [--steps 160] [--profile]

One trial process of the HPO benchmark without its training: a ``Checkpointer`` (objective
``"time"``, the true MTBF, ``total_steps`` known, the stall measured once as its default; a
2 MB state saved when it says so), ``observe()`` and ``should_save()`` at every step, and at
each epoch end ``set_termination()`` with the study's estimate (usually unchanged). Two
processes, each forked as the benchmark forks its trials: a new trial from step 0, killed
halfway, and the trial resumed from its newest checkpoint to the end. Timed as the
benchmark times it: those calls, not the construction or the saves. Prints the median over
``--runs`` runs per policy; with ``--profile``, the functions that take coci+term's time
(in this process, not forked).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coci_core.planner import StopDistribution
from coci_core.training import Checkpointer

STEPS_PER_EPOCH = 20
STEP_S = 0.005
STALL_S = 0.004
MTBF_S = 1.6
TERMINATION = StopDistribution(
    steps=(20, 40, 60, 80, 100, 120, 140),
    probabilities=(0.0, 0.25, 0.15, 0.1, 0.05, 0.05, 0.05),
    source="a study's history",
)


def trial(policy: str, directory: str, total: int, stop: int, seed: int) -> tuple[float, int]:
    """One trial process from its newest checkpoint (if any) to step ``stop``: the
    planner's time in seconds and the plans it made."""
    name = "coci" if policy == "coci+term" else policy
    options: dict[str, Any] = {"total_steps": total, "default_stall_s": STALL_S}
    if name == "epoch":
        options["steps_per_epoch"] = STEPS_PER_EPOCH
    if policy == "coci+term":
        options["termination"] = TERMINATION
    ckpt = Checkpointer(
        directory,
        policy=name,
        objective="time",
        mtbf_s=MTBF_S,
        keep_last=2,
        compression="none",
        planner_options=options,
    )
    weights = torch.zeros(512 * 1024)  # 2 MB
    start = 0
    if ckpt.latest_step() is not None:
        state = ckpt.restore()
        ckpt.load_state_dict(state.get("coci", {}))
        start = int(ckpt.resumed_from or 0)
    plans = ckpt.planner.replans
    rng = np.random.default_rng([seed, start])
    spent = 0.0
    for k in range(start + 1, stop + 1):
        loss = 2.3 * (1 + k / 30) ** -0.7 * (1 + 0.1 * float(rng.standard_normal()))
        step_s = STEP_S * (1 + 0.2 * float(rng.random()))
        t = time.perf_counter()
        ckpt.observe(k, loss=loss, step_time_s=step_s)
        if policy == "coci+term" and k % STEPS_PER_EPOCH == 0:
            ckpt.planner.set_termination(TERMINATION)
        save = ckpt.should_save(k)
        spent += time.perf_counter() - t
        if save:
            weights += 1
            ckpt.save(k, {"weights": weights, "coci": ckpt.state_dict()}).wait()
    plans = ckpt.planner.replans - plans
    ckpt.close()
    return spent, plans


def _child(conn: Any, *args: Any) -> None:
    conn.send(trial(*args))


def forked(*args: Any) -> tuple[float, int]:
    """:func:`trial` in a process of its own (forked, as the benchmark's trials are)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, *args))
    proc.start()
    out: tuple[float, int] = parent.recv()
    proc.join()
    return out


def run_once(policy: str, total: int, seed: int, *, fork: bool = True) -> list[tuple[float, int]]:
    """A new trial stopped halfway, then resumed to its end."""
    run = forked if fork else trial
    with tempfile.TemporaryDirectory() as tmp:
        directory = str(Path(tmp) / "trial")
        return [
            run(policy, directory, total, total // 2, seed),
            run(policy, directory, total, total, seed),
        ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--policies", nargs="+", default=["coci+term", "coci", "daly"])
    ap.add_argument("--profile", action="store_true", help="profile coci+term's runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run_once("coci+term", args.steps, 0, fork=False)  # warm: lazy imports before the forks
    print(f"planner time per trial process ({args.steps} steps), median of {args.runs} runs")
    print("| policy | new trial (ms) | resumed trial (ms) | plans (new, resumed) |")
    print("|---|---|---|---|")
    for policy in args.policies:
        runs = [run_once(policy, args.steps, seed) for seed in range(args.runs)]
        new, resumed = ([r[i][0] * 1e3 for r in runs] for i in (0, 1))
        plans = [statistics.median(r[i][1] for r in runs) for i in (0, 1)]
        print(
            f"| {policy} | {statistics.median(new):.2f} | {statistics.median(resumed):.2f} "
            f"| {plans[0]:g}, {plans[1]:g} |"
        )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for seed in range(args.runs):
            run_once("coci+term", args.steps, seed, fork=False)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
        print(out.getvalue())


if __name__ == "__main__":
    main()
