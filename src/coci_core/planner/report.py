"""What the planner tells telemetry and people: :class:`PlannerReport` and ``explain``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coci_core.planner.costs import COST_NAMES
from coci_core.planner.fixed_interval import fixed_window, is_fixed_save
from coci_core.planner.model import NoTermination, describe_termination
from coci_core.planner.replanning import Replanner
from coci_core.planner.schedule import ExpectedOverhead, compare_with_daly

__all__ = ["PlannerReport", "build_report", "explain_step"]


@dataclass(frozen=True, kw_only=True)
class PlannerReport:
    """What the planner planned, for telemetry.

    Attributes:
        step: the last observed step.
        policy: the policy name; objective: the objective.
        next_steps: the next planned checkpoint steps (at most 10).
        interval_steps: steps between the last two planned checkpoints around now (or None).
        horizon_end_step: the end of the planning horizon; rolling: whether it is a rolling one.
        expected_overhead: plan vs Daly over the horizon (None before the first plan).
        loss_params: the fitted pieces (normalised units), loss_fit_reason: why (not) used.
        fitted_loss: the fitted loss at the current step (None if untrusted).
        mtbf_s: the MTBF planned with (job-level), mtbf_source: "user", "estimated" or "default".
        costs: cost name -> value planned with; cost_sources: cost name -> "user",
            "measured", "default" or "unknown".
        replans: number of plans made; last_replan_s: duration of the last one.
        skipped_losses: NaN/inf losses skipped.
        plan_method: how the current plan was made (e.g. Daly's interval because the value is
            flat, or the DP for the objective).
        termination: the termination model planned with, in words ("none" without one).
        stop_probability: P(the job is stopped on purpose before the horizon's end), seen
            from the plan's start (0 without a termination model).
    """

    step: int
    policy: str
    objective: str
    next_steps: tuple[int, ...]
    interval_steps: int | None
    horizon_end_step: int | None
    rolling: bool
    expected_overhead: ExpectedOverhead | None
    loss_params: tuple[dict[str, object], ...]
    loss_fit_reason: str
    fitted_loss: float | None
    mtbf_s: float | None
    mtbf_source: str
    costs: dict[str, float | None]
    cost_sources: dict[str, str]
    replans: int
    last_replan_s: float
    skipped_losses: int
    plan_method: str
    termination: str = "none"
    stop_probability: float = 0.0


def build_report(plan: Replanner, *, with_overhead: bool) -> PlannerReport:
    """See :meth:`Planner.report`."""
    s, obs = plan.settings, plan.obs
    if with_overhead and plan.overhead is None and plan.problem is not None:
        plan.overhead = compare_with_daly(plan.problem, plan.schedule, plan.plain_planner())
    snap = obs.costs.snapshot()
    ahead = list(plan.ahead())
    k = obs.last_step if obs.last_step is not None else s.start_step
    interval = None
    if s.fixed_every is not None:
        interval = s.fixed_every
    elif len(plan.schedule) >= 2:
        j = min(max(plan.ptr, 1), len(plan.schedule) - 1)
        interval = plan.schedule[j] - plan.schedule[j - 1]
    fitted = None
    if plan.curve.trusted:
        fitted = float(plan.curve.predict(np.array([k]))[0])
    mtbf, src = obs.mtbf()
    return PlannerReport(
        step=k,
        policy=s.policy_name,
        objective=s.objective,
        next_steps=tuple(ahead[:10]),
        interval_steps=interval,
        horizon_end_step=plan.horizon_end,
        rolling=s.total_steps is None,
        expected_overhead=plan.overhead,
        loss_params=tuple(p.to_dict() for p in plan.curve.pieces),
        loss_fit_reason=plan.curve.reason,
        fitted_loss=fitted,
        mtbf_s=mtbf,
        mtbf_source=src,
        costs={n: e.value for n, e in snap.items()},
        cost_sources={n: e.source for n, e in snap.items()},
        replans=plan.replans,
        last_replan_s=plan.last_replan_s,
        skipped_losses=obs.skipped,
        plan_method=plan.plan_method,
        termination=describe_termination(s.termination),
        stop_probability=_stop_probability(plan),
    )


def _stop_probability(plan: Replanner) -> float:
    pb = plan.problem
    if pb is None or isinstance(pb.termination, NoTermination):
        return 0.0
    steps, probs = pb.termination.atoms(pb.start_step, pb.end_step)
    return float(probs[steps < pb.end_step].sum())


def explain_step(plan: Replanner, step: int) -> str:
    """See :meth:`Planner.explain`."""
    try:
        k = int(step)
    except (TypeError, ValueError, OverflowError):
        return f"step {step!r} is not an integer step"
    s = plan.settings
    sched = plan.schedule
    planned = k in sched or k == plan.obs.last_true
    n = s.fixed_every
    if n is not None:
        sched = fixed_window(k, n)
        planned = is_fixed_save(k, n)
    before = [x for x in sched if x < k]
    after = [x for x in sched if x > k]
    rep = build_report(plan, with_overhead=True)
    lines = [
        f"step {k}: {'checkpoint' if planned else 'no checkpoint'} "
        f"(policy {s.policy_name}, objective {s.objective})",
        f"  previous planned {before[-1] if before else '-'}, next planned "
        f"{after[0] if after else '-'}",
    ]
    if planned and before:
        lines.append(f"  interval {k - before[-1]} steps")
    lines.append(
        "  inputs: "
        + ", ".join(f"{c} {rep.costs[c]!s} ({rep.cost_sources[c]})" for c in COST_NAMES)
    )
    planned_step = plan.plan_inputs.get("step_time_s")
    measured_step = rep.costs.get("step_time_s")
    if planned_step is not None and measured_step is not None and planned_step > measured_step:
        lines.append(
            f"  planned with {planned_step:.3g} s of wall time per step: the steps' median "
            f"{measured_step:.3g} s and the time between them (validation, logging, waits)"
        )
    lines.append(f"  MTBF {rep.mtbf_s} s ({rep.mtbf_source}); loss curve: {rep.loss_fit_reason}")
    lines.append(f"  plan: {rep.plan_method}")
    pb = plan.problem
    if pb is not None:
        i = int(np.clip(k - pb.start_step, 0, pb.horizon_steps - 1))
        lines.append(f"  value density here {float(pb.v[i]):.2f} (mean 1)")
    ov = rep.expected_overhead
    if ov is not None:
        lines.append(
            f"  expected overhead ({ov.objective}) {ov.objective_s:.1f} s vs Daly "
            f"{ov.daly_objective_s:.1f} s; wall-clock {ov.wall_s:.1f} s vs Daly "
            f"{ov.daly_wall_s:.1f} s (horizon to step {rep.horizon_end_step}"
            f"{', rolling' if rep.rolling else ''})"
        )
    if not isinstance(s.termination, NoTermination):
        lines.append(_termination_line(plan, rep))
    return "\n".join(lines)


def _termination_line(plan: Replanner, rep: PlannerReport) -> str:
    """What the termination hazard does to the plan: the stop probability, and the plan's
    interval and overhead with the hazard against the plan made without it."""
    text = (
        f"  termination hazard: {rep.termination}; P(stopped before step "
        f"{rep.horizon_end_step}) {rep.stop_probability:.0%}"
    )
    ov = rep.expected_overhead
    plain = None if ov is None else ov.without_termination_steps
    if ov is None or plain is None or ov.without_termination_objective_s is None:
        return text + " (a fixed-interval policy: the plan does not use it)"
    ahead = [x for x in plain if x > rep.step]
    first = ahead[0] if ahead else None
    share = ov.termination_share or 0.0
    return text + (
        f"; without it the first checkpoint would be at step {first if first else '-'} "
        f"({len(plain)} planned, here {len(plan.schedule)}), expected overhead "
        f"{ov.without_termination_objective_s:.1f} s against {ov.objective_s:.1f} s: the "
        f"hazard accounts for {share:.0%} of the plan's gain over Daly"
    )
