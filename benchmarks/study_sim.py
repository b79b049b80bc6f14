"""The termination-aware plan on a study whose trials span several Daly intervals (simulated).

Run:  python -m benchmarks.study_sim [--trials 30] [--seeds 0 1 ... 9] [--mtbf-h 1 1.5 ...]
      [--pruner sha|median] [--policies coci+term daly] [--quick]

A real Optuna study (random sampler seeded by the seed; a successive-halving or median pruner)
of ``--trials`` trials of a synthetic training curve (the loss falls to a floor set by the
sampled learning rate, plus seeded noise; the curve of ``benchmarks.rank_weighting``), eight
reports of 250 steps each. The study runs once per seed with no failures: what each trial
reported, where it was pruned, and the termination model ``study_termination`` gives it before
its first report and after each one (rank-weighted once it has reported), as coci's Optuna
helpers would. Trials run one after the other, so these do not depend on failures or timing.

Each policy then runs the same trials on a simulated clock: a step takes ``--step-s``, a save
stalls ``--stall-s`` and becomes durable ``--persist-s`` later (one persist in flight: the next
save waits for it); failures come at exponential times on each trial's busy clock, drawn from the
seed and the trial's number (the same failure times in each trial for every policy); each rolls
the trial back to its newest durable checkpoint, or its start, and costs ``--restart-s`` (a
failure during a restart starts it again).
The plan is the online ``Planner``'s, objective ``"time"``, given the true costs and MTBF:
``coci+term`` with the trial's termination model (replaced after each report, and kept by a
resumed trial), ``coci`` with none, ``daly``. A resumed trial's planner is a new one loaded from
the checkpoint's planner state, as the adapters do. No policy takes a final save: a trial ends at
the report that pruned or completed it.

Cost per study (seconds of the busy clock over the study with no checkpoints and no failures):
stall (the saves' stalls and waits for the persist in flight), lost work (work done again after
a failure), restart; total, their sum. Beside it, without sampling noise, the planner's exact
expected cost of the saves each trial takes with no failure, for the stop it met.

The defaults: trials of 2000 steps x 2 s (67 min), a save stalling 45 s with a 60 s persist
(a large state), a restart 120 s; the successive-halving pruner stops most trials at its rungs,
after 500 and 1000 steps. Where Daly's interval falls against the rungs decides what the
termination hazard can save, so the study runs for MTBFs from 1 to 12 h: Daly's interval then
goes from 270 to 970 steps (7.4 to 2.1 per unpruned trial).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import optuna

from benchmarks._lib.results import log, run_recorded
from coci_core.hpo.optuna import per_epoch, report, study_termination
from coci_core.planner import (
    FailureModel,
    Planner,
    Problem,
    Termination,
    daly_interval_s,
    expected_cost,
)

POLICIES = ("coci+term", "coci", "daly")
REPORTS = 8
#: Daly's interval from 270 to 970 steps (1.1 to 3.9 per 500-step rung period), log-spaced
MTBFS_H = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)


@dataclass(frozen=True)
class Job:
    """The simulated costs (seconds) and the study's shape."""

    steps_per_report: int = 250
    step_s: float = 2.0
    stall_s: float = 45.0
    persist_s: float = 60.0
    restart_s: float = 120.0
    mtbf_s: float = 1.5 * 3600.0
    grid_points: int = 250

    @property
    def total_steps(self) -> int:
        return REPORTS * self.steps_per_report


@dataclass
class TrialPlan:
    """One trial as the study ran it: where it stopped and the termination model it had
    before its first report (``models[0]``) and after each report ``r`` (``models[r + 1]``)."""

    stop_step: int
    pruned: bool
    models: list[Termination]


@dataclass
class Costs:
    """One study's costs under one policy."""

    stall_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    saves: int = 0
    kills: int = 0
    busy_s: float = 0.0
    ideal_s: float = 0.0
    planning_s: float = 0.0
    per_trial_saves: list[int] = field(default_factory=list)
    save_steps: list[list[int]] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.busy_s - self.ideal_s


def run_study(seed: int, trials: int, pruner_name: str, job: Job) -> list[TrialPlan]:
    """The study with no failures: each trial's stop and its termination models."""
    pruner: optuna.pruners.BasePruner = (
        optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1)
        if pruner_name == "median"
        else optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed), pruner=pruner)
    spr = job.steps_per_report
    plans: list[TrialPlan] = []

    def model(trial: optuna.trial.BaseTrial) -> Termination:
        return study_termination(
            study,
            trial=trial,
            train_step_of=per_epoch(spr),
            min_trials=3,
            max_report_step=REPORTS - 1,
        )

    for _ in range(trials):
        trial = study.ask()
        lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
        rng = np.random.default_rng([seed, trial.number])
        floor = abs(math.log10(lr) + 1.5)
        models = [model(trial)]
        value = math.nan
        stop, pruned = job.total_steps, False
        for r in range(REPORTS):
            value = floor + 2.0 * math.exp(-0.4 * r) + float(rng.normal(0, 0.15))
            report(trial, value, r, train_step=(r + 1) * spr)
            if trial.should_prune():
                stop, pruned = (r + 1) * spr, True
                break
            models.append(model(trial))
        if pruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, value)
        plans.append(TrialPlan(stop_step=stop, pruned=pruned, models=models))
    return plans


class FailureClock:
    """Failures at exponential times from ``start`` on the busy clock (seeded)."""

    def __init__(self, mtbf_s: float, seed: list[int], start: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.mtbf_s = mtbf_s
        self.next = start + float(self.rng.exponential(mtbf_s))

    def advance(self) -> None:
        self.next += float(self.rng.exponential(self.mtbf_s))


@dataclass
class _Save:
    step: int
    durable_at: float
    state: dict[str, Any]


class _Run:
    """One policy's pass over the study's trials on the simulated clock."""

    def __init__(self, policy: str, job: Job, seed: int, *, failures: bool = True) -> None:
        self.policy = policy
        self.job = job
        self.seed = seed
        self.mtbf_s = job.mtbf_s if failures else math.inf  # the failures met; planned with
        self.failures = FailureClock(self.mtbf_s, [seed], 0.0)
        self.costs = Costs()
        self.clock = 0.0
        self.durable: _Save | None = None  # the trial's newest durable checkpoint
        self.pending: _Save | None = None  # the checkpoint whose persist is in flight

    def _advance(self, seconds: float) -> bool:
        """Move the clock on by ``seconds``; False (the clock at the failure) if one came."""
        if self.failures.next < self.clock + seconds:
            self.clock = self.failures.next
            self.failures.advance()
            return False
        self.clock += seconds
        return True

    def _planner(self, trial: TrialPlan, reports: int, state: dict[str, Any] | None) -> Planner:
        job = self.job
        t0 = time.perf_counter()
        planner = Planner(
            policy="daly" if self.policy == "daly" else "coci",
            objective="time",
            total_steps=job.total_steps,
            mtbf_s=job.mtbf_s,
            step_time_s=job.step_s,
            stall_s=job.stall_s,
            persist_s=job.persist_s,
            restart_s=job.restart_s,
            grid_points=job.grid_points,
        )
        if state is not None:
            planner.load_state_dict(state)
        if self.policy == "coci+term":
            planner.set_termination(trial.models[reports])
        self.costs.planning_s += time.perf_counter() - t0
        return planner

    def _recover(self, trial: TrialPlan) -> tuple[int, Planner]:
        """After a failure (the clock at it): back to the newest durable checkpoint (the one in
        flight if its persist ended before the failure), or the trial's start, after a
        restart; the step resumed from and the resumed trial's planner."""
        job, costs = self.job, self.costs
        if self.pending is not None and self.pending.durable_at <= self.clock:
            self.durable = self.pending
        self.pending = None
        costs.kills += 1
        while True:
            start = self.clock
            done = self._advance(job.restart_s)
            costs.restart_s += self.clock - start
            if done:
                break
            costs.kills += 1  # killed again while restarting
        saved = self.durable
        step = saved.step if saved is not None else 0
        # the reports made before the checkpoint's step are kept by the study
        planner = self._planner(trial, step // job.steps_per_report, saved and saved.state)
        t0 = time.perf_counter()
        planner.record_restore(job.restart_s)
        costs.planning_s += time.perf_counter() - t0
        return step, planner

    def trial(self, number: int, trial: TrialPlan) -> None:
        """Run one trial to its stop (no final save); its failures are drawn from the seed
        and its number on its own clock, so that every policy meets the same ones."""
        self.failures = FailureClock(self.mtbf_s, [self.seed, number, 19], self.clock)
        job, costs = self.job, self.costs
        spr = job.steps_per_report
        costs.ideal_s += trial.stop_step * job.step_s
        planner = self._planner(trial, 0, None)
        self.durable = self.pending = None
        step, saves = 0, 0
        steps: list[int] = []
        while step < trial.stop_step:
            if self.pending is not None and self.pending.durable_at <= self.clock:
                self.durable, self.pending = self.pending, None
            if not self._advance(job.step_s):
                step, planner = self._recover(trial)
                continue
            step += 1
            t0 = time.perf_counter()
            planner.observe(step, step_time_s=job.step_s)
            if step % spr == 0 and step < trial.stop_step and self.policy == "coci+term":
                planner.set_termination(trial.models[step // spr])
            save = step < trial.stop_step and planner.should_save(step)
            costs.planning_s += time.perf_counter() - t0
            if not save:
                continue
            if self.pending is not None:  # one persist in flight: wait for it
                start = self.clock
                done = self._advance(max(0.0, self.pending.durable_at - self.clock))
                costs.stall_s += self.clock - start
                if not done:
                    step, planner = self._recover(trial)
                    continue
                self.durable, self.pending = self.pending, None
            start = self.clock
            done = self._advance(job.stall_s)
            costs.stall_s += self.clock - start
            if not done:
                step, planner = self._recover(trial)
                continue
            planner.record_save(stall_s=job.stall_s, persist_s=job.persist_s)
            self.pending = _Save(step, self.clock + job.persist_s, planner.state_dict())
            saves += 1
            steps.append(step)
        costs.saves += saves
        costs.per_trial_saves.append(saves)
        costs.save_steps.append(steps)


def expected_cost_s(policy: str, plans: list[TrialPlan], job: Job, seed: int) -> float:
    """The planner's exact expected overhead (stall, lost work, restart) of the saves each
    trial takes with no failure, for the stop the trial met: the study's cost with the
    failures integrated out (no sampling noise; the plans of resumed trials are left out)."""
    saved = simulate_policy(policy, plans, job, seed, failures=False).save_steps
    total = 0.0
    for trial, steps in zip(plans, saved, strict=True):
        pb = Problem(
            start_step=0,
            end_step=trial.stop_step,
            step_time_s=job.step_s,
            stall_s=job.stall_s,
            persist_s=job.persist_s,
            restart_s=job.restart_s,
            failure=FailureModel(mtbf_s=job.mtbf_s),
        )
        total += expected_cost(pb, np.array(steps, dtype=np.int64)).wall_s
    return total


def simulate_policy(
    policy: str, plans: list[TrialPlan], job: Job, seed: int, *, failures: bool = True
) -> Costs:
    """One policy over the study's trials, with the seed's failures (or none)."""
    run = _Run(policy, job, seed, failures=failures)
    for number, trial in enumerate(plans):
        run.trial(number, trial)
    run.costs.busy_s = run.clock
    run.costs.lost_s = run.costs.total_s - run.costs.stall_s - run.costs.restart_s
    return run.costs


def _spread(xs: list[float]) -> str:
    return (
        f"{statistics.mean(xs):.0f} ± {statistics.stdev(xs):.0f}" if len(xs) > 1 else f"{xs[0]:.0f}"
    )


def _pct(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):+.0f} ± {sd:.0f}%"


def _versus(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> list[float]:
    return [100 * (a[key] / b[key] - 1) for a, b in zip(rows, base, strict=True)]


def table(res: dict[str, Any]) -> str:
    """Per MTBF: each policy's costs, mean ± standard deviation over the seeds, and against
    Daly seed by seed (simulated, and the model's expectation)."""
    lines = [
        "| MTBF (h) | Daly's interval (steps) | policy | total cost (s) | stall (s) "
        "| lost work (s) | restart (s) | kills | saves | total vs Daly, seed by seed "
        "| all seeds' total vs Daly's | expected vs Daly (the model) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for block in res["mtbfs"]:
        runs = block["runs"]
        seeds = sorted({r["seed"] for r in runs})
        by = {(r["policy"], r["seed"]): r for r in runs}
        for p in res["policies"]:
            rs = [by[(p, s)] for s in seeds]
            vs = ["-", "-", "-"]
            if "daly" in res["policies"]:
                d = [by[("daly", s)] for s in seeds]
                pooled = sum(r["total_s"] for r in rs) / sum(r["total_s"] for r in d) - 1
                vs = [
                    _pct(_versus(rs, d, "total_s")),
                    f"{100 * pooled:+.0f}%",
                    _pct(_versus(rs, d, "expected_s")),
                ]
            lines.append(
                f"| {block['mtbf_h']:g} | {block['daly_interval_steps']:.0f} | {p} "
                f"| {_spread([r['total_s'] for r in rs])} | {_spread([r['stall_s'] for r in rs])} "
                f"| {_spread([r['lost_s'] for r in rs])} "
                f"| {_spread([r['restart_s'] for r in rs])} "
                f"| {statistics.mean(r['kills'] for r in rs):.1f} "
                f"| {statistics.mean(r['saves'] for r in rs):.1f} | {' | '.join(vs)} |"
            )
    return "\n".join(lines)


def summary(res: dict[str, Any]) -> str:
    """coci+term against Daly over every MTBF and seed (each MTBF weighs alike)."""
    if not {"coci+term", "daly"} <= set(res["policies"]):
        return ""
    sim: list[float] = []
    model: list[float] = []
    for block in res["mtbfs"]:
        by = {(r["policy"], r["seed"]): r for r in block["runs"]}
        seeds = sorted({r["seed"] for r in block["runs"]})
        term = [by[("coci+term", s)] for s in seeds]
        daly = [by[("daly", s)] for s in seeds]
        sim += _versus(term, daly, "total_s")
        model += _versus(term, daly, "expected_s")
    return (
        f"coci+term vs Daly over {len(res['mtbfs'])} MTBFs x {len(sim) // len(res['mtbfs'])} "
        f"seeds: total cost {_pct(sim)} (simulated), {_pct(model)} (expected)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every seed: the study once, then each policy on its trials, for each MTBF."""
    base = Job(
        steps_per_report=args.steps_per_report,
        step_s=args.step_s,
        stall_s=args.stall_s,
        persist_s=args.persist_s,
        restart_s=args.restart_s,
    )
    if args.quick:
        base = replace(base, steps_per_report=50, step_s=10.0, grid_points=100)
    studies = {seed: run_study(seed, args.trials, args.pruner, base) for seed in args.seeds}
    for seed, plans in studies.items():
        stops = [p.stop_step for p in plans]
        log(
            f"seed {seed}: {sum(p.pruned for p in plans)} of {len(plans)} trials pruned; "
            f"trials of {statistics.mean(stops):.0f} steps on average"
        )
    blocks = []
    for mtbf_h in args.mtbf_h:
        job = replace(base, mtbf_s=mtbf_h * 3600.0)
        daly_steps = daly_interval_s(job.stall_s, job.mtbf_s) / job.step_s
        log(
            f"MTBF {mtbf_h:g} h: trials of {job.total_steps} steps x {job.step_s:g} s, Daly's "
            f"interval {daly_steps:.0f} steps ({job.total_steps / daly_steps:.1f} per trial)"
        )
        runs = []
        for seed, plans in studies.items():
            for policy in args.policies:
                expected = expected_cost_s(policy, plans, job, seed)
                c = simulate_policy(policy, plans, job, seed)
                log(
                    f"  seed {seed} {policy}: total {c.total_s:.0f} s (stall {c.stall_s:.0f}, "
                    f"lost {c.lost_s:.0f}, restart {c.restart_s:.0f}), {c.kills} kills, "
                    f"{c.saves} saves (planning {c.planning_s:.1f} s); expected {expected:.0f} s"
                )
                runs.append(
                    {
                        "policy": policy,
                        "seed": seed,
                        "total_s": c.total_s,
                        "expected_s": expected,
                        **{k: v for k, v in c.__dict__.items() if k != "save_steps"},
                    }
                )
        blocks.append({"mtbf_h": mtbf_h, "daly_interval_steps": daly_steps, "runs": runs})
    return {
        "job": base.__dict__,
        "trials": args.trials,
        "reports": REPORTS,
        "pruner": args.pruner,
        "policies": list(args.policies),
        "stops": {str(seed): [p.stop_step for p in plans] for seed, plans in studies.items()},
        "mtbfs": blocks,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--pruner", choices=("sha", "median"), default="sha")
    ap.add_argument("--policies", nargs="+", default=["coci+term", "daly"], choices=POLICIES)
    default = Job()
    ap.add_argument("--steps-per-report", type=int, default=default.steps_per_report)
    ap.add_argument("--step-s", type=float, default=default.step_s, help="seconds per step")
    ap.add_argument("--stall-s", type=float, default=default.stall_s, help="a save's stall")
    ap.add_argument("--persist-s", type=float, default=default.persist_s, help="its persist")
    ap.add_argument("--restart-s", type=float, default=default.restart_s)
    ap.add_argument(
        "--mtbf-h", type=float, nargs="+", default=list(MTBFS_H), help="MTBFs, in hours"
    )
    ap.add_argument(
        "--quick", action="store_true", help="a smoke test: short trials (checks it runs)"
    )
    ap.add_argument("--out-dir", default=None, help="where the result file goes")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    res, path = run_recorded("study-sim", lambda _: run(args), out_dir=args.out_dir)
    print(table(res))
    print(summary(res))
    log(f"results: {path}")
    return res


if __name__ == "__main__":
    main()
