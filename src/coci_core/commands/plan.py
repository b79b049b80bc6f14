"""The ``coci plan`` and ``coci simulate`` command lines, built without importing numpy, scipy
or the planner (``coci --help`` answers at once); they run ``coci_core.commands.simulate``."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["OBJECTIVE_NAMES", "POLICY_NAMES", "add_subcommands"]

# These are the names of coci_core.planner.optimize.OBJECTIVES and
# coci_core.planner.policies.POLICIES (a test keeps them equal).
OBJECTIVE_NAMES = ("time", "convergence", "progress")
POLICY_NAMES = (
    "coci",
    "young",
    "daly",
    "checkfreq",
    "every_n_steps",
    "every_n_seconds",
    "epoch",
    "coci_paper",
)
# the policies that need a parameter, and its option
_POLICY_OPTIONS = {
    "every_n_steps": "every_n_steps",
    "every_n_seconds": "every_n_seconds",
    "epoch": "steps_per_epoch",
}


# what simulate uses for a fixed-interval policy in --policies without its option
_SIMULATE_DEFAULTS: dict[str, Any] = {
    "every_n_steps": 1000,
    "every_n_seconds": 600.0,
    "steps_per_epoch": 1000,
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--total-steps", type=int, required=True, help="the step the job ends at")
    p.add_argument("--step-time-s", type=float, required=True, help="compute seconds per step")
    p.add_argument("--stall-s", type=float, required=True, help="blocking snapshot seconds")
    p.add_argument("--persist-s", type=float, default=0.0, help="background persist seconds")
    p.add_argument("--restart-s", type=float, default=60.0, help="restart+restore seconds")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--mtbf-s", type=float, help="mean time between failures (job), seconds")
    g.add_argument("--mtbf-h", type=float, help="mean time between failures (job), hours")
    lg = p.add_mutually_exclusive_group()
    lg.add_argument("--loss", help="loss formula in k, e.g. '1.5+5.4*(1+k/3000)**-0.5'")
    lg.add_argument("--loss-csv", help="CSV of step,loss from a real run's log")
    p.add_argument(
        "--objective",
        choices=OBJECTIVE_NAMES,
        default="convergence",
        help="what a lost step costs: its time, or its progress toward convergence "
        "(default: convergence)",
    )
    p.add_argument("--asha-rungs", help="comma-separated rung steps (ASHA early stopping)")
    p.add_argument("--asha-eta", type=float, default=3.0, help="ASHA reduction factor")
    p.add_argument("--start-step", type=int, default=0, help="the step the plan starts from")
    p.add_argument("--every-n-steps", type=int, help="the interval of the every_n_steps policy")
    p.add_argument(
        "--every-n-seconds", type=float, help="the interval of the every_n_seconds policy"
    )
    p.add_argument("--steps-per-epoch", type=int, help="the epoch length of the epoch policy")


def _run_plan(args: argparse.Namespace) -> int:
    from coci_core.commands.simulate import run_plan

    return run_plan(args)


def _run_simulate(args: argparse.Namespace) -> int:
    from coci_core.commands.simulate import run_simulate

    return run_simulate(args)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``plan`` and ``simulate`` to a ``coci`` command's subparsers."""
    plan = subparsers.add_parser("plan", help="print a checkpoint schedule and why")
    _common(plan)
    plan.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        help="default: the policy whose --every-n-steps / --every-n-seconds / "
        "--steps-per-epoch is given, else coci",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
    plan.add_argument("--show", type=int, default=20, help="how many steps to print")
    plan.set_defaults(func=_run_plan)
    sim = subparsers.add_parser("simulate", help="Monte Carlo of policies x metrics")
    _common(sim)
    sim.add_argument(
        "--policies",
        default="young,daly,checkfreq,coci:time,coci:convergence",
        help="comma-separated; coci:<objective> for the optimal plan",
    )
    sim.add_argument("--runs", type=int, default=20_000, help="simulated runs per policy")
    sim.add_argument("--seed", type=int, default=0, help="random seed of the simulation")
    sim.set_defaults(func=_run_simulate)
