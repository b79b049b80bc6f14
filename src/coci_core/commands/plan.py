"""The ``coci plan`` and ``coci simulate`` subcommands: their arguments and what they run.

Importing this module imports neither numpy, scipy nor the planner (``coci --help`` answers at
once); the runners import them when they run.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable
from typing import Any

from coci_core.errors import CociError, ConfigError
from coci_core.planner.objectives import OBJECTIVES

__all__ = ["OBJECTIVE_NAMES", "POLICY_NAMES", "add_subcommands", "run_plan", "run_simulate"]

#: The built-in objectives' names (those of coci_core.planner.objectives.OBJECTIVES, which
#: imports no numpy); the policies' names are coci_core.planner.policies.POLICIES's (a test
#: keeps them equal).
OBJECTIVE_NAMES = tuple(OBJECTIVES)
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
        choices=tuple(OBJECTIVES),
        default="time",
        help="what the plan minimises (default: time): "
        + "; ".join(f"{name}: {o.description}" for name, o in OBJECTIVES.items()),
    )
    p.add_argument("--asha-rungs", help="comma-separated rung steps (ASHA early stopping)")
    p.add_argument("--asha-eta", type=float, default=3.0, help="ASHA reduction factor")
    p.add_argument("--start-step", type=int, default=0, help="the step the plan starts from")
    p.add_argument("--every-n-steps", type=int, help="the interval of the every_n_steps policy")
    p.add_argument(
        "--every-n-seconds", type=float, help="the interval of the every_n_seconds policy"
    )
    p.add_argument("--steps-per-epoch", type=int, help="the epoch length of the epoch policy")


def _loss_from_expr(expr: str) -> Callable[[Any], Any]:
    """A loss callable from a numpy expression in ``k`` (the user's own command line)."""
    import numpy as np

    safe = {
        "np": np,
        "exp": np.exp,
        "log": np.log,
        "sqrt": np.sqrt,
        "minimum": np.minimum,
        "maximum": np.maximum,
        "where": np.where,
    }
    try:
        code = compile(expr, "<--loss>", "eval")
    except SyntaxError as e:
        raise ConfigError(f"'--loss' is not a valid expression in k: {expr!r} ({e.msg})") from e

    def fn(k: Any) -> Any:
        return eval(code, {"__builtins__": {}}, {**safe, "k": np.asarray(k, dtype=np.float64)})

    try:  # numbers for a vector of steps and for one step, as the planner asks
        for k in (np.arange(3.0), np.float64(5.0)):
            out = np.asarray(fn(k), dtype=np.float64)
            np.broadcast_to(out, np.shape(k))
    except Exception as e:
        raise ConfigError(
            f"'--loss' is not an expression of numbers in k: {expr!r} ({type(e).__name__}: {e})"
        ) from e
    return fn


def _loss_from_csv(path: str) -> tuple[list[float], list[float]]:
    """Observed ``(steps, losses)`` from a CSV of ``step,loss`` (a header row is allowed)."""
    import os

    import numpy as np

    from coci_core.errors import StorageError
    from coci_core.storage.local import open_regular

    steps: list[float] = []
    losses: list[float] = []
    try:
        # a regular file only: a FIFO would wait for a writer, /dev/zero never end
        fd = open_regular(path)
    except StorageError as e:
        raise ConfigError(f"'--loss-csv' cannot be read as CSV text: {path!r} ({e})") from e
    try:
        with os.fdopen(fd, newline="") as f:
            for row in csv.reader(f):
                if len(row) < 2:
                    continue
                try:
                    k, v = float(row[0]), float(row[1])
                except ValueError:
                    continue  # header or junk
                if np.isfinite(v):
                    steps.append(k)
                    losses.append(v)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"'--loss-csv' cannot be read as CSV text: {path!r} ({e})") from e
    if not steps:
        raise ConfigError(f"'--loss-csv' has no step,loss rows: {path!r}")
    return steps, losses


def _policy_options(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The parameter of a policy that needs one, from its option."""
    option = _POLICY_OPTIONS.get(name)
    if option is None:
        return {}
    value = getattr(args, option)
    if value is None:
        raise ConfigError(f"the {name} policy needs --{option.replace('_', '-')}")
    return {option: value}


def _plan_policy(args: argparse.Namespace) -> Any:
    """The policy ``coci plan`` follows: --policy, or the one whose option is given."""
    from coci_core.planner.policies import make_policy

    name = args.policy
    if name is None:
        given = [p for p, o in _POLICY_OPTIONS.items() if getattr(args, o) is not None]
        if len(given) > 1:
            raise ConfigError(
                "give one of --every-n-steps, --every-n-seconds, --steps-per-epoch (or --policy)"
            )
        name = given[0] if given else "coci"
    if name not in _POLICY_OPTIONS:
        return name
    return make_policy(name, **_policy_options(args, name))


def _inputs(args: argparse.Namespace) -> dict[str, Any]:
    from coci_core.planner.model import AshaRungs, Termination

    mtbf_s = args.mtbf_s if args.mtbf_s is not None else args.mtbf_h * 3600.0
    loss: Any = None
    if args.loss:
        loss = _loss_from_expr(args.loss)
    elif args.loss_csv:
        loss = _loss_from_csv(args.loss_csv)
    term: Termination | None = None
    if args.asha_rungs:
        try:
            rungs = tuple(int(x) for x in args.asha_rungs.split(",") if x.strip())
        except ValueError as e:
            raise ConfigError(f"'--asha-rungs' must be integers: {args.asha_rungs!r}") from e
        term = AshaRungs(rung_steps=rungs, reduction_factor=args.asha_eta)
    return {
        "total_steps": args.total_steps,
        "step_time_s": args.step_time_s,
        "stall_s": args.stall_s,
        "persist_s": args.persist_s,
        "restart_s": args.restart_s,
        "mtbf_s": mtbf_s,
        "loss": loss,
        "objective": args.objective,
        "termination": term,
        "start_step": args.start_step,
    }


def run_plan(args: argparse.Namespace) -> int:
    """``coci plan``: print the schedule and its explanation (or JSON)."""
    from coci_core.planner.schedule import plan_schedule

    if args.show < 0:
        print(f"coci plan: --show must be 0 or more: {args.show}", file=sys.stderr)
        return 2
    try:
        sched = plan_schedule(**_inputs(args), policy=_plan_policy(args))
    except CociError as e:
        print(f"coci plan: {e}", file=sys.stderr)
        return 2
    ov = sched.expected_overhead_s
    if args.json:
        print(
            json.dumps(
                {
                    "policy": sched.policy,
                    "objective": ov.objective,
                    "steps": list(sched.steps),
                    "expected_overhead_s": {
                        "objective_s": ov.objective_s,
                        "wall_s": ov.wall_s,
                        "daly_objective_s": ov.daly_objective_s,
                        "daly_wall_s": ov.daly_wall_s,
                    },
                }
            )
        )
        return 0
    print(sched.explain())
    shown = list(sched.steps[: args.show])
    more = "" if len(sched.steps) <= args.show else f" ... ({len(sched.steps)} in all)"
    print("steps: " + ", ".join(str(s) for s in shown) + more)
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    """``coci simulate``: print policies x metrics with confidence intervals."""
    import numpy as np

    from coci_core.planner.curve import value_density
    from coci_core.planner.model import FailureModel
    from coci_core.planner.optimize import Problem
    from coci_core.planner.policies import POLICIES, PlanContext, make_policy
    from coci_core.planner.schedule import build_curve, plan_schedule
    from coci_core.planner.simulate import simulate

    try:
        inp = _inputs(args)
        curve = build_curve(inp["loss"], inp["start_step"], inp["total_steps"])
        kw = {} if inp["termination"] is None else {"termination": inp["termination"]}
        pb = Problem(
            start_step=inp["start_step"],
            end_step=inp["total_steps"],
            step_time_s=inp["step_time_s"],
            stall_s=inp["stall_s"],
            persist_s=inp["persist_s"],
            restart_s=inp["restart_s"],
            failure=FailureModel(mtbf_s=inp["mtbf_s"]),
            value=value_density(curve, inp["start_step"], inp["total_steps"]),
            objective=inp["objective"],
            **kw,
        )
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        if not names:
            raise ConfigError(f"'--policies' names no policy: {args.policies!r}")
        scheds: dict[str, Any] = {}
        for name in names:
            base, colon, obj = name.partition(":")
            if colon and base != "coci":
                raise ConfigError(
                    f"'--policies' gives {name!r}: only coci takes a ':<objective>' "
                    f"(as in coci:time)"
                )
            if base == "coci":
                s = plan_schedule(**{**inp, "objective": obj or inp["objective"]})
                scheds[f"coci[{obj or inp['objective']}]"] = s.steps
                continue
            if base not in POLICIES:
                raise ConfigError(f"'--policies' has an unknown policy: {base!r}")
            opts = {
                o: getattr(args, o) if getattr(args, o) is not None else default
                for o, default in _SIMULATE_DEFAULTS.items()
                if _POLICY_OPTIONS.get(base) == o
            }
            ctx = PlanContext(value_is_flat=not curve.trusted)
            if isinstance(inp["loss"], tuple):
                ctx = PlanContext(
                    loss_steps=np.asarray(inp["loss"][0], dtype=np.float64),
                    loss_values=np.asarray(inp["loss"][1], dtype=np.float64),
                    value_is_flat=not curve.trusted,
                )
            elif inp["loss"] is not None:
                ks = np.arange(inp["start_step"], inp["start_step"] + 64, dtype=np.float64)
                ctx = PlanContext(
                    loss_steps=ks,
                    loss_values=np.asarray(inp["loss"](ks)),
                    value_is_flat=not curve.trusted,
                )
            scheds[base] = make_policy(base, **opts).plan(pb, context=ctx)
        res = simulate(scheds, pb, runs=args.runs, seed=args.seed)
    except CociError as e:
        print(f"coci simulate: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.runs} runs per policy, seed {args.seed}, 95% confidence; overheads in seconds "
        f"per run (convergence excludes restart)"
    )
    print(res.table())
    return 0


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``plan`` and ``simulate`` to a ``coci`` command's subparsers."""
    plan = subparsers.add_parser(
        "plan",
        help="print a checkpoint schedule and why",
        description="Print the steps a policy checkpoints at for a job's costs (step time, "
        "stall, persist, restart, MTBF), its expected overhead and Daly's for comparison.",
    )
    _common(plan)
    plan.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        help="default: the policy whose --every-n-steps / --every-n-seconds / "
        "--steps-per-epoch is given, else coci",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
    plan.add_argument("--show", type=int, default=20, help="how many steps to print")
    plan.set_defaults(func=run_plan)
    sim = subparsers.add_parser(
        "simulate",
        help="Monte Carlo of policies x metrics",
        description="Simulate random failures of a job (Monte Carlo) under each policy and "
        "print each one's overheads in seconds per run, with 95% confidence intervals.",
    )
    _common(sim)
    sim.add_argument(
        "--policies",
        default="young,daly,checkfreq,coci:time,coci:convergence",
        help="comma-separated; coci:<objective> for the optimal plan",
    )
    sim.add_argument("--runs", type=int, default=20_000, help="simulated runs per policy")
    sim.add_argument("--seed", type=int, default=0, help="random seed of the simulation")
    sim.set_defaults(func=run_simulate)
