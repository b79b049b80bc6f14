"""Benchmark of the convergence-aware planner on the ResNet-like setting of background.md §1.

Run:  python -m benchmarks.planner_bench [--quick] [--runs N] [--seed S]

Setting: 0.3 s/step, 50k steps, restart 60 s; stall/persist 0.5/2 s and 5/20 s; MTBF 2, 8 and
24 h; loss ``1.5 + 5.4*(1+k/3000)**-0.5`` with 10% multiplicative noise, fitted online by the
``Planner`` (the ``coci`` rows are the steps an online Planner actually chose while observing the
noisy run; the baselines are planned from the same costs). Every schedule is then simulated on
the same failures (common random numbers) and scored with the true value density. Metrics
(seconds per run): wall-clock overhead, convergence-weighted overhead without restart, and
progress-weighted overhead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit

import numpy as np

from coci_core.planner import (
    AshaRungs,
    FailureModel,
    Planner,
    Problem,
    Termination,
    expected_cost,
    make_policy,
    simulate,
    value_density,
)
from coci_core.planner.curve import curve_from_callable
from coci_core.planner.policies import PlanContext

TOTAL = 50_000
STEP_S = 0.3
RESTART_S = 60.0
NOISE = 0.10
CONV = "convergence_excl_restart_s"


def true_loss(k: np.ndarray) -> np.ndarray:
    """The ResNet-like power-law curve."""
    return 1.5 + 5.4 * (1 + k / 3000) ** -0.5


def noisy_losses(seed: int) -> np.ndarray:
    """One noisy run's losses (10% multiplicative Gaussian noise)."""
    rng = np.random.default_rng([seed, 7])
    k = np.arange(TOTAL, dtype=np.float64)
    return true_loss(k) * (1 + NOISE * rng.standard_normal(TOTAL))


def online_schedule(
    objective: str,
    stall: float,
    persist: float,
    mtbf_h: float,
    losses: np.ndarray,
    termination: Termination | None = None,
    costs_given: bool = False,
) -> tuple[list[int], list[float]]:
    """Drive a Planner through one run; return its save steps and its re-planning times.

    Costs are measured online (the first save's stall is unknown) unless ``costs_given``.
    """
    given = {"stall_s": stall, "persist_s": persist} if costs_given else {}
    p = Planner(
        policy="coci",
        objective=objective,
        total_steps=TOTAL,
        mtbf_s=mtbf_h * 3600,
        termination=termination,
        **given,
    )
    saves: list[int] = []
    replans: list[float] = []
    seen = 0
    for k in range(1, TOTAL):
        p.observe(k, loss=float(losses[k]), step_time_s=STEP_S)
        if p.replans != seen:
            seen = p.replans
            replans.append(p.report(with_overhead=False).last_replan_s)
        if p.should_save(k):
            saves.append(k)
            p.record_save(stall_s=stall, persist_s=persist)
    return saves, replans


def problem(
    stall: float,
    persist: float,
    mtbf_h: float,
    objective: str = "convergence",
    termination: Termination | None = None,
) -> Problem:
    """The true problem (exact value density) used to plan baselines and to score."""
    curve = curve_from_callable(lambda k: float(true_loss(np.asarray(k))), 0, TOTAL)
    kw = {} if termination is None else {"termination": termination}
    return Problem(
        start_step=0,
        end_step=TOTAL,
        step_time_s=STEP_S,
        stall_s=stall,
        persist_s=persist,
        restart_s=RESTART_S,
        failure=FailureModel(mtbf_s=mtbf_h * 3600),
        value=value_density(curve, 0, TOTAL),
        objective=objective,
        **kw,
    )


BASELINES = {
    "young": {},
    "daly": {},
    "checkfreq": {},
    "every_n_steps(1000)": {"every_n_steps": 1000},
    "every_n_seconds(600)": {"every_n_seconds": 600.0},
    "epoch(5005)": {"steps_per_epoch": 5005},
    "coci_paper": {},
}


def baseline_schedules(pb: Problem, losses: np.ndarray) -> dict[str, np.ndarray]:
    """Schedules of every baseline policy on the problem."""
    ctx = PlanContext(loss_steps=np.arange(0, 64, dtype=np.float64), loss_values=losses[:64])
    out = {}
    for label, opts in BASELINES.items():
        name = label.split("(")[0]
        out[label] = make_policy(name, **opts).plan(pb, context=ctx)
    return out


def fmt_pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.1f}%" if ref else "-"


def run_cell(
    stall: float, persist: float, mtbf_h: float, runs: int, seed: int
) -> dict[str, object]:
    """One cell: all policies x three metrics."""
    losses = noisy_losses(seed)
    pb = problem(stall, persist, mtbf_h)
    scheds: dict[str, np.ndarray] = baseline_schedules(pb, losses)
    replans: list[float] = []
    for objective in ("time", "convergence", "progress"):
        saves, rp = online_schedule(objective, stall, persist, mtbf_h, losses)
        scheds[f"coci[{objective}]"] = np.asarray(saves)
        replans += rp
    from coci_core.planner import dp_schedule

    scheds["coci[convergence] oracle"] = dp_schedule(pb)
    res = simulate(scheds, pb, runs=runs, seed=seed)
    print(f"\n### stall/persist {stall:g}/{persist:g} s, MTBF {mtbf_h:g} h ({runs} runs)\n")
    print(
        "| policy | ckpts | wall-clock s | vs Daly | conv. excl. restart s | vs Daly |"
        " progress s | analytic wall / conv |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    d = res.rows["daly"]
    for name, row in res.rows.items():
        c = expected_cost(pb, scheds[name])
        print(
            f"| {name} | {len(scheds[name])} | {row['wall_s']} | "
            f"{fmt_pct(row['wall_s'].mean, d['wall_s'].mean)} | "
            f"{row['convergence_excl_restart_s']} | "
            f"{fmt_pct(row[CONV].mean, d[CONV].mean)}"
            f" | {row['progress_s']} | {c.wall_s:.1f} / {c.convergence_excl_restart_s:.1f} |"
        )
    return {"rows": res.rows, "replans": replans}


def run_asha(
    runs: int, seed: int, mtbf_hours: list[float]
) -> list[tuple[str, float, float, float, float, float]]:
    """ASHA rungs known (1000·3^i), 5/20 s: objective='time' versus Daly."""
    term = AshaRungs.geometric(min_steps=1000, reduction_factor=3.0, max_steps=TOTAL)
    out = []
    print(f"\n### ASHA rungs {term.rung_steps}, eta 3, stall/persist 5/20 s ({runs} runs)\n")
    print("| MTBF h | policy | ckpts | wall-clock s | vs Daly | wall excl. restart s | vs Daly |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    losses = noisy_losses(seed)
    for mtbf_h in mtbf_hours:
        pb = problem(5.0, 20.0, mtbf_h, objective="time", termination=term)
        daly = make_policy("daly").plan(pb, context=PlanContext())
        saves, _ = online_schedule("time", 5.0, 20.0, mtbf_h, losses, termination=term)
        given, _ = online_schedule(
            "time", 5.0, 20.0, mtbf_h, losses, termination=term, costs_given=True
        )
        scheds = {
            "daly": daly,
            "coci[time]": np.asarray(saves),
            "coci[time] costs given": np.asarray(given),
        }
        res = simulate(scheds, pb, runs=runs, seed=seed)
        dw = res.rows["daly"]["wall_s"].mean
        dx = dw - res.rows["daly"]["restart_s"].mean
        for name, row in res.rows.items():
            wx = row["wall_s"].mean - row["restart_s"].mean
            print(
                f"| {mtbf_h:g} | {name} | {len(scheds[name])} | {row['wall_s']} | "
                f"{fmt_pct(row['wall_s'].mean, dw)} | {wx:.1f} | {fmt_pct(wx, dx)} |"
            )
        for name in ("coci[time]", "coci[time] costs given"):
            cw = res.rows[name]["wall_s"].mean
            out.append((name, mtbf_h, cw, dw, 1 - cw / dw, res.rows[name]["wall_s"].half_width))
    return out


def timing(replans: list[float]) -> None:
    """Re-planning and should_save timings."""
    print("\n### Timings (this machine)\n")
    if replans:
        print(
            f"- online re-plans in the runs above: {len(replans)}, median "
            f"{1000 * statistics.median(replans):.0f} ms, max {1000 * max(replans):.0f} ms"
        )
    # a re-plan at the worst point: 25k steps of losses fitted, 25k steps ahead (DP)
    losses = noisy_losses(1)
    # the convergence objective: the costliest re-plan (a fit and the DP; "time" plans Daly's)
    job = {"total_steps": TOTAL, "mtbf_s": 2 * 3600, "stall_s": 0.5, "persist_s": 2.0}
    p = Planner(objective="convergence", step_time_s=STEP_S, **job)
    for k in range(1, 25_000):
        p.observe(k, loss=float(losses[k]))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        p._plan.replan(25_000)  # a forced re-plan (no public call makes one)
        times.append(time.perf_counter() - t0)
    print(
        f"- forced re-plan at step 25,000 of 50,000 (fit + DP, MTBF 2 h): median "
        f"{1000 * statistics.median(times):.0f} ms, max {1000 * max(times):.0f} ms "
        f"(target < 500 ms)"
    )
    p2 = Planner(objective="convergence", step_time_s=STEP_S, **job)
    p2.observe(1, loss=5.0)
    n = 200_000
    steps = list(range(2, n + 2))
    t = timeit.timeit(lambda: [p2.should_save(k) for k in steps], number=1)
    print(f"- should_save: {1e6 * t / n:.2f} µs per call over {n:,} calls (target < 20 µs)")
    t = timeit.timeit(
        lambda: [p2.observe(k, loss=5.0, step_time_s=STEP_S) for k in range(2, 20_002)], number=1
    )
    print(f"- observe (amortised, incl. its re-plans): {1e6 * t / 20_000:.1f} µs per call")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2,000 runs and MTBF 8 h only")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    runs = args.runs or (2_000 if args.quick else 20_000)
    mtbfs = [8.0] if args.quick else [2.0, 8.0, 24.0]
    t0 = time.perf_counter()
    summary = []
    replans: list[float] = []
    for stall, persist in ((0.5, 2.0), (5.0, 20.0)):
        for mtbf_h in mtbfs:
            cell = run_cell(stall, persist, mtbf_h, runs, args.seed)
            rows = cell["rows"]
            replans += cell["replans"]  # type: ignore[operator]
            summary.append((stall, persist, mtbf_h, rows))
    asha = run_asha(runs, args.seed, mtbfs)
    print("\n### Targets\n")
    for stall, persist, mtbf_h, rows in summary:
        d, t, c, cf = rows["daly"], rows["coci[time]"], rows["coci[convergence]"], rows["checkfreq"]
        tw = t["wall_s"].mean / d["wall_s"].mean - 1
        vs_cf = 1 - t["wall_s"].mean / cf["wall_s"].mean
        cg = 1 - c["convergence_excl_restart_s"].mean / d["convergence_excl_restart_s"].mean
        price = c["wall_s"].mean / d["wall_s"].mean - 1
        print(
            f"- {stall:g}/{persist:g} s, MTBF {mtbf_h:g} h: time vs Daly wall {100 * tw:+.2f}% "
            f"({'met' if abs(tw) <= 0.02 else 'MISSED'}); time vs checkfreq "
            f"{100 * vs_cf:.1f}% below"
            + ("" if mtbf_h < 8 else f" ({'met' if vs_cf >= 0.40 else 'MISSED'})")
            + f"; convergence vs Daly (conv. excl. restart) {100 * cg:.1f}% below "
            f"({'met' if cg >= 0.14 else 'MISSED'}), wall-clock price {100 * price:+.1f}%"
        )
    for name, mtbf_h, cw, dw, gain, hw in asha:
        print(
            f"- ASHA, 5/20 s, MTBF {mtbf_h:g} h, {name}: {cw:.1f} ± {hw:.1f} s vs Daly {dw:.1f} s "
            f"= {100 * gain:.1f}% below ({'met' if gain >= 0.10 else 'MISSED'})"
        )
    timing(replans)
    print(f"\nbenchmark wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
