"""The ``coci plan`` and ``coci simulate`` subcommands
(``python -m coci_core.commands.simulate``)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from coci_core.commands.plan import (
    _POLICY_OPTIONS,
    _SIMULATE_DEFAULTS,
    OBJECTIVE_NAMES,
    POLICY_NAMES,
    add_subcommands,
)
from coci_core.errors import CociError, ConfigError

__all__ = ["OBJECTIVE_NAMES", "POLICY_NAMES", "add_subcommands", "main", "run_plan", "run_simulate"]


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

    try:
        fn(np.arange(3))
    except Exception as e:
        raise ConfigError(f"'--loss' is not a valid expression in k: {expr!r} ({e})") from e
    return fn


def _loss_from_csv(path: str) -> tuple[list[float], list[float]]:
    """Observed ``(steps, losses)`` from a CSV of ``step,loss`` (a header row is allowed)."""
    import numpy as np

    steps: list[float] = []
    losses: list[float] = []
    try:
        with open(path, newline="") as f:
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
    except OSError as e:
        raise ConfigError(f"'--loss-csv' cannot be read: {path!r} ({e})") from e
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
        scheds: dict[str, Any] = {}
        for name in names:
            base, _, obj = name.partition(":")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m coci_core.commands.simulate``."""
    parser = argparse.ArgumentParser(prog="coci", description="coci checkpoint planner")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
