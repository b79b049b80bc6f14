"""Benchmark: work lost per preemption, coci's notice handling against a save on SIGTERM
without a budget (the frameworks' behaviour) and against no notice handling.

Run:  python -m benchmarks.preemption_bench [--trials N] [--seed S] [--no-real]

Simulated (a clock, with coci's real code): a run of ``STEPS`` steps of ``STEP_S`` s; the periodic
checkpoints are the steps :func:`coci_core.planner.plan_schedule` plans for the state size (the
copy to host at ``COPY_GBPS`` blocks training, the write at ``WRITE_GBPS`` runs in the
background; each save's duration varies by a factor lognormal(0, ``JITTER``)). One preemption
per trial, at a uniformly random time: a notice, then the kill ``grace`` seconds later. The
notice is acted on at the next step boundary. Policies:

* ``none``: no notice handling; training goes on until the kill.
* ``naive``: a save starts at the notice, with no budget (the frameworks' save on SIGTERM).
  Two variants of what a save cut short by the kill leaves: ``atomic`` (the newest checkpoint
  stays the previous one) and ``in place`` (the cut-short save is the newest by name and is
  unusable: the resume goes back to the periodic checkpoint before the newest; Lightning writes
  its checkpoint file in place and the Trainer resumes from the highest-numbered directory).
* ``coci``: :func:`coci_core.training.preemption.fit_save` decides, from the last four measured
  saves, the wait for a periodic save still being written and the time left: taken when the
  slowest fits with coci's default margin to spare, tried when only the fastest fits (on the
  local disk, with no upload waiting, a save cut short costs nothing: the commit is atomic),
  not started when even the fastest cannot fit.

Lost work: the training seconds to redo after the restart (steps trained past the step
restored, times the step time). A save queued behind a periodic save that is still being
written starts when that one is durable.

Real (one run of each case, a tiny model on the local disk): a training child with coci's
Checkpointer and ``preemption="TERM@<grace>"`` gets SIGTERM and is SIGKILLed ``grace`` s later
by this process; the steps lost are the steps it trained past the step the directory restores.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from coci_core.knobs import PREEMPTION_MARGIN_S
from coci_core.planner import plan_schedule
from coci_core.training.preemption import fit_save, plan_save_step

STEPS = 43_200  # 24 h at 2 s/step
STEP_S = 2.0
RESTART_S = 120.0
MTBF_S = 6 * 3600.0  # spot machines: a preemption every 6 h
COPY_GBPS = 20.0  # device to host (blocks training)
WRITE_GBPS = 1.0  # to durable storage (in the background)
JITTER = 0.1
SIZES_GB = (5.0, 20.0, 40.0, 100.0, 400.0)
GRACES_S = (30.0, 120.0)
POLICIES = ("none", "naive atomic", "naive in place", "coci")


@dataclass(frozen=True)
class Run:
    """One simulated run: its periodic saves and when each is durable."""

    steps: list[int]  # the periodic checkpoint steps
    step_end: np.ndarray  # time at which step k (index k) ends, stalls included
    durable: list[float]  # time at which each periodic save is durable
    measured: list[float]  # each periodic save's time to durable (as coci measures it)
    stall_s: float
    write_s: float


def simulate_run(
    size_gb: float, rng: np.random.Generator, *, steps: int = STEPS, step_s: float = STEP_S
) -> Run:
    """The planner's periodic schedule for a state of ``size_gb``, on the simulated clock."""
    stall = size_gb / COPY_GBPS
    write = size_gb / WRITE_GBPS
    plan = plan_schedule(
        total_steps=steps,
        step_time_s=step_s,
        stall_s=stall,
        persist_s=write,
        restart_s=RESTART_S,
        mtbf_s=MTBF_S,
    )
    saves = list(plan.steps)
    durations = np.full(steps + 1, step_s)
    for k in saves:
        durations[k] += stall  # the copy blocks the step that saves
    step_end = np.cumsum(durations) - step_s  # step 0 ends at 0
    durable: list[float] = []
    measured: list[float] = []
    free = 0.0  # when the writer is free
    for k in saves:
        w = write * float(rng.lognormal(0.0, JITTER))
        start = max(float(step_end[k]), free)
        free = start + w
        durable.append(free)
        measured.append(stall + w)
    return Run(saves, step_end, durable, measured, stall, write)


def _newest_durable(run: Run, at: float, known: int) -> int:
    """Index in ``run.steps`` of the newest periodic save durable at ``at`` among the first
    ``known`` (-1: none)."""
    i = min(bisect.bisect_right(run.durable, at), known) - 1
    return i


def one_preemption(
    run: Run, notice_at: float, grace: float, rng: np.random.Generator, *, known_end: bool = False
) -> dict[str, float]:
    """Each policy's loss for a notice at ``notice_at`` and the kill ``grace`` later: the
    training seconds to redo (``<policy>``) and the seconds of the job before the kill whose
    training the restored state does not hold (``<policy> wall``: the work to redo and the time
    the job stood still after its save). ``known_end``: the notice gives the time of the kill
    (a signal a set time before the end, a cloud notice with its time): coci trains on and
    saves at the step :func:`~coci_core.training.preemption.plan_save_step` plans; the
    frameworks save at the notice either way."""
    kill = notice_at + grace
    ends = run.step_end
    last = len(ends) - 1
    b = min(int(np.searchsorted(ends, notice_at, side="left")), last)  # the next step boundary
    k_kill = max(int(np.searchsorted(ends, kill, side="right")) - 1, 0)  # last step done
    known = bisect.bisect_right(run.steps, b)  # periodic saves taken by step b
    newest = _newest_durable(run, kill, known)
    newest_step = run.steps[newest] if newest >= 0 else 0
    restored: dict[str, tuple[int, int]] = {}  # policy: (step restored, step trained to)
    restored["none"] = (_step_at(run, kill), k_kill)
    # the notice's save, taken at step b: queued behind a periodic save still being written
    write = run.write_s * float(rng.lognormal(0.0, JITTER))
    free = run.durable[known - 1] if known else 0.0
    done = max(float(ends[b]) + run.stall_s, free) + write
    fits = done <= kill
    restored["naive atomic"] = (b if fits else newest_step, b)
    if fits or done - write >= kill:  # saved, or never started writing
        restored["naive in place"] = restored["naive atomic"]
    else:
        restored["naive in place"] = (run.steps[newest - 1] if newest >= 1 else 0, b)
    recent = run.measured[max(0, known - 4) : known]
    at = b
    if known_end:
        at = min(
            plan_save_step(
                b,
                kill - float(ends[b]),
                STEP_S,
                max(recent) if recent else None,
                PREEMPTION_MARGIN_S,
            ),
            last,
        )
        done = max(float(ends[at]) + run.stall_s, free) + write
    take, _ = fit_save(
        kill - float(ends[at]),
        max(recent) if recent else None,
        PREEMPTION_MARGIN_S,
        fastest_s=min(recent) if recent else None,
        wait_s=max(0.0, free - float(ends[at]) - run.stall_s),
        try_uncertain=True,  # the local disk, nothing uploading
    )
    restored["coci"] = (at if take and done <= kill else newest_step, at)
    out: dict[str, float] = {}
    for policy, (step, trained) in restored.items():
        out[policy] = (trained - step) * STEP_S
        out[f"{policy} wall"] = kill - float(ends[step])
    out["naive fits"] = float(fits)
    return out


def _step_at(run: Run, t: float) -> int:
    """The newest periodic step durable at ``t`` (0: none)."""
    i = bisect.bisect_right(run.durable, t) - 1
    return run.steps[i] if i >= 0 else 0


def simulate(
    sizes_gb: tuple[float, ...] = SIZES_GB,
    graces_s: tuple[float, ...] = GRACES_S,
    *,
    trials: int = 2000,
    seed: int = 0,
    steps: int = STEPS,
    known_end: bool = False,
) -> list[dict[str, Any]]:
    """One row per (state size, grace period): each policy's lost work per preemption (median
    and mean, s; and the same of the job's seconds not kept, ``<policy> wall``) over
    ``trials`` preemptions, and the share of trials where the naive save fit."""
    rows = []
    for size in sizes_gb:
        for grace in graces_s:
            rng = np.random.default_rng([seed, int(size * 10), int(grace)])
            run = simulate_run(size, rng, steps=steps)
            end = float(run.step_end[-1]) - grace
            keys = [*POLICIES, *(f"{p} wall" for p in POLICIES)]
            lost: dict[str, list[float]] = {k: [] for k in keys}
            fit = 0.0
            for _ in range(trials):
                r = one_preemption(
                    run, float(rng.uniform(0.0, end)), grace, rng, known_end=known_end
                )
                for k in keys:
                    lost[k].append(r[k])
                fit += r["naive fits"]
            row: dict[str, Any] = {
                "size_gb": size,
                "grace_s": grace,
                "known_end": known_end,
                "save_s": run.stall_s + run.write_s,
                "interval_steps": int(np.median(np.diff([0, *run.steps]))) if run.steps else steps,
                "naive_fits": fit / trials,
            }
            for k in keys:
                row[f"{k} median"] = statistics.median(lost[k])
                row[f"{k} mean"] = statistics.fmean(lost[k])
            rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each a line ``ok``/``FAILS``: coci never loses more than the naive
    save (either variant, mean), and loses at least 50% less where the naive save does not fit
    the grace period (in most trials), against each variant."""
    lines = []
    for naive in ("naive atomic", "naive in place"):
        worse = [r for r in rows if r["coci mean"] > r[f"{naive} mean"] + 1e-9]
        lines.append(
            f"coci <= {naive} everywhere: "
            + ("ok" if not worse else "FAILS at " + ", ".join(_at(r) for r in worse))
        )
        nofit = [r for r in rows if r["naive_fits"] < 0.5]
        short = [r for r in nofit if r["coci mean"] > 0.5 * r[f"{naive} mean"]]
        lines.append(
            f"coci <= 50% of {naive} where the naive save does not fit ({len(nofit)} rows): "
            + ("ok" if not short else "FAILS at " + ", ".join(_at(r) for r in short))
        )
    return lines


def check_known_end(rows: list[dict[str, Any]]) -> list[str]:
    """With notices of a known end: coci never loses more work than the no-budget save, and
    keeps more of the job's time before the kill where that save fits with time to spare."""
    worse = [r for r in rows if r["coci mean"] > r["naive atomic mean"] + 1e-9]
    lines = [
        "known end: coci <= naive atomic (work to redo) everywhere: "
        + ("ok" if not worse else "FAILS at " + ", ".join(_at(r) for r in worse))
    ]
    for r in rows:
        naive, coci = r["naive atomic wall mean"], r["coci wall mean"]
        lines.append(
            f"known end, {_at(r)}: the job's seconds not kept, coci {coci:.0f} s against "
            f"{naive:.0f} s ({100 * (1 - coci / naive):.0f}% less)"
            if naive > 0
            else f"known end, {_at(r)}: nothing lost either way"
        )
    return lines


def _at(row: dict[str, Any]) -> str:
    return f"{row['size_gb']:g} GB/{row['grace_s']:g} s"


def _row_head(r: dict[str, Any]) -> str:
    """A table row's first cells: the state, its save, the grace period, how often it fit."""
    return (
        f"| {r['size_gb']:g} GB | {r['save_s']:.0f} s | {r['grace_s']:g} s "
        f"| {100 * r['naive_fits']:.0f}%"
    )


def known_end_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| state | save | notice | naive save fits | none | naive (atomic) | coci "
        "| coci: work to redo |\n|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        cells = " | ".join(
            f"{r[f'{p} wall median']:.0f} / {r[f'{p} wall mean']:.0f}"
            for p in ("none", "naive atomic", "coci")
        )
        body += f"{_row_head(r)} | {cells} | {r['coci median']:.0f} / {r['coci mean']:.0f} |\n"
    return head + body


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| state | save | grace | naive save fits | none | naive (atomic) | naive (in place) "
        "| coci |\n|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        cells = " | ".join(f"{r[f'{p} median']:.0f} / {r[f'{p} mean']:.0f}" for p in POLICIES)
        body += f"{_row_head(r)} | {cells} |\n"
    return head + body


# ---- the real run ------------------------------------------------------------------------


def child(args: dict[str, Any]) -> None:
    """The training child: a tiny model, coci's Checkpointer watching ``TERM@<grace>``; one
    save after step 5 (waited for), then a step every 20 ms until the notice."""
    import torch

    from coci_core import LocalStorage, Preempted
    from coci_core.preemption import Preemption
    from coci_core.training import Checkpointer

    class SlowDisk(LocalStorage):
        def write_file(self, path: str, chunks: Any, *, aligned: bool = False) -> int:
            if path.endswith(".bin"):
                time.sleep(float(args["write_delay_s"]))  # the disk's speed
            return super().write_file(path, chunks, aligned=aligned)

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ckpt = Checkpointer(
        SlowDisk(args["dir"]),
        policy="every_n_steps",
        every_n_steps=10**9,
        keep_last=None,
        preemption=Preemption((f"TERM@{args['grace_s']:g}",), margin_s=0.5),
    )
    ckpt.watch_preemption()
    step = 0
    try:
        while True:
            model(torch.randn(8, 64)).pow(2).mean().backward()
            time.sleep(0.02)
            step += 1
            print(f"STEP {step}", flush=True)
            if ckpt.should_save(step) or step == 5:
                ckpt.save(step, {"step": step, "model": model.state_dict()})
                if step == 5:
                    ckpt.wait()
                    print("READY", flush=True)
            ckpt.stop_if_preempted()
    except Preempted as stop:
        d = ckpt.preempted
        assert d is not None
        print(
            "DECISION " + json.dumps({"step": d.step, "save": d.save, "saved": stop.step}),
            flush=True,
        )
        raise SystemExit(stop.code) from None


def real_run(grace_s: float, write_delay_s: float) -> dict[str, Any]:
    """One real preemption: SIGTERM, SIGKILL ``grace_s`` later; what the directory restores."""
    from coci_core.training import Checkpointer

    with tempfile.TemporaryDirectory() as d:
        args = {"dir": d, "grace_s": grace_s, "write_delay_s": write_delay_s}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.preemption_bench", "--child", json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("READY"):
                break
        time.sleep(0.3)  # a few more steps
        proc.send_signal(signal.SIGTERM)
        term = time.monotonic()
        killed = False
        try:
            out, _ = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            killed = True
            out, _ = proc.communicate()
        stopped_s = time.monotonic() - term
        lines += out.splitlines()
        trained = max((int(x.split()[1]) for x in lines if x.startswith("STEP ")), default=0)
        decision = next((json.loads(x[9:]) for x in lines if x.startswith("DECISION ")), None)
        restored = int(
            Checkpointer(d, policy="every_n_steps", every_n_steps=10**9).restore()["step"]
        )
    return {
        "grace_s": grace_s,
        "write_s": write_delay_s,
        "trained": trained,
        "restored": restored,
        "lost_steps": trained - restored,
        "notice_step": decision["step"] if decision else None,
        "saved": bool(decision and decision["saved"] is not None),
        "killed": killed,
        "stopped_s": stopped_s,
    }


def real_table(runs: list[dict[str, Any]]) -> str:
    out = (
        "| grace | save writes | notice at step | saved | trained to | restores | steps lost "
        "| exited |\n|---|---|---|---|---|---|---|---|\n"
    )
    for r in runs:
        out += (
            f"| {r['grace_s']:g} s | {r['write_s']:g} s | {r['notice_step']} "
            f"| {'yes' if r['saved'] else 'no'} | {r['trained']} | {r['restored']} "
            f"| {r['lost_steps']} | {'SIGKILL' if r['killed'] else 'itself'} "
            f"after {r['stopped_s']:.1f} s |\n"
        )
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-real", action="store_true", help="only the simulation")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return []
    t0 = time.perf_counter()
    rows = simulate(trials=a.trials, seed=a.seed)
    print(
        f"Simulated: {STEPS} steps of {STEP_S:g} s, MTBF {MTBF_S / 3600:g} h, copy "
        f"{COPY_GBPS:g} GB/s, write {WRITE_GBPS:g} GB/s, jitter {JITTER:g}, margin "
        f"{PREEMPTION_MARGIN_S:g} s, {a.trials} preemptions per row (seed {a.seed}); lost work "
        "per preemption, median / mean, s\n"
    )
    print(table(rows))
    for line in check_targets(rows):
        print("- " + line)
    known = simulate(trials=a.trials, seed=a.seed, known_end=True)
    print(
        "\nNotices of a known end (the kill's time announced, as by a SLURM signal a set time "
        "before the end or a cloud notice with its time): the job's seconds before the kill "
        "whose training the restored state does not hold, median / mean, s\n"
    )
    print(known_end_table(known))
    for line in check_known_end(known):
        print("- " + line)
    rows = rows + known
    if not a.no_real:
        runs = [real_run(2.0, 0.0), real_run(2.0, 3.0)]
        print("\nReal runs (tiny model, local disk, SIGTERM then SIGKILL after the grace):\n")
        print(real_table(runs))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
