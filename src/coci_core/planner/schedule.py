"""The pure entry point: ``plan_schedule`` turns costs, failures and a loss curve into steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from coci_core.errors import ConfigError
from coci_core.knobs import MAX_SCHEDULE_STEPS
from coci_core.planner.checks import check_int, check_nonnegative, check_positive
from coci_core.planner.curve import (
    FLAT,
    LossCurve,
    curve_from_callable,
    fit_loss_curve,
    value_density,
)
from coci_core.planner.model import FailureModel, Termination, make_termination
from coci_core.planner.objectives import make_objective
from coci_core.planner.optimize import (
    CostBreakdown,
    Problem,
    daly_interval_s,
    expected_cost,
)
from coci_core.planner.policies import PlanContext, SavePolicy, make_policy
from coci_core.planner.solvers import uniform_schedule

__all__ = ["ExpectedOverhead", "Schedule", "build_curve", "plan_schedule"]

LossSpec = Callable[[int], float] | tuple[Sequence[float], Sequence[float]] | None


@dataclass(frozen=True, kw_only=True)
class ExpectedOverhead:
    """Expected overhead of a plan and of Daly's uniform plan on the same problem, in seconds.

    Attributes:
        objective: the objective planned for.
        objective_s: the plan's expected overhead as that objective counts it.
        wall_s: the plan's expected wall-clock overhead (stall + lost work + restart).
        daly_objective_s: Daly's expected overhead as the objective counts it.
        daly_wall_s: Daly's expected wall-clock overhead.
        plan: the plan's full breakdown.
        daly: Daly's full breakdown.
        without_termination_objective_s: the objective's overhead of the plan made ignoring
            the termination model, costed with it (None without a termination model).
        without_termination_wall_s: its wall-clock overhead.
        without_termination_steps: that plan's checkpoint steps.
    """

    objective: str
    objective_s: float
    wall_s: float
    daly_objective_s: float
    daly_wall_s: float
    plan: CostBreakdown
    daly: CostBreakdown
    without_termination_objective_s: float | None = None
    without_termination_wall_s: float | None = None
    without_termination_steps: tuple[int, ...] | None = None

    @property
    def gain_vs_daly(self) -> float:
        """Relative reduction of the objective versus Daly (positive is better)."""
        return 1.0 - self.objective_s / self.daly_objective_s if self.daly_objective_s else 0.0

    @property
    def termination_share(self) -> float | None:
        """The share of the plan's gain over Daly that the termination hazard brings: the
        plan made without it costs ``without_termination_objective_s``; None without one."""
        plain = self.without_termination_objective_s
        if plain is None:
            return None
        return termination_share(self.objective_s, plain, self.daly_objective_s)

    def __getitem__(self, key: str) -> float:
        """Mapping-style access: ``overhead["wall_s"]``."""
        value = getattr(self, key)
        if not isinstance(value, float):
            raise KeyError(key)
        return value


def termination_share(objective_s: float, without_s: float, daly_s: float) -> float:
    """The share of a plan's gain over Daly (``daly_s - objective_s``) that its termination
    hazard brings, given the plan made without the hazard costs ``without_s``: 0 to 1 (1 when
    the plan made without the hazard is no better than Daly's: the whole gain is the
    hazard's)."""
    gain = daly_s - objective_s
    if gain <= 1e-12:
        return 0.0
    return min(1.0, max(0.0, without_s - objective_s) / gain)


@dataclass(frozen=True, kw_only=True, eq=False)
class Schedule:
    """A plan: checkpoint steps and what they are expected to cost.

    Attributes:
        steps: sorted checkpoint steps in ``(start_step, total_steps)``.
        expected_overhead_s: plan vs Daly, for the objective and wall-clock.
        policy: the policy name.
        problem: the cost problem the plan was made for.
        curve: the loss curve used (flat if untrusted).
    """

    steps: tuple[int, ...]
    expected_overhead_s: ExpectedOverhead
    policy: str
    problem: Problem
    curve: LossCurve

    def intervals(self) -> npt.NDArray[np.int64]:
        """Steps between consecutive checkpoints (from ``start_step``)."""
        pts = np.array([self.problem.start_step, *self.steps], dtype=np.int64)
        return np.diff(pts)

    def explain(self) -> str:
        """A human-readable summary of the plan and its inputs."""
        pb, ov = self.problem, self.expected_overhead_s
        iv = self.intervals()
        daly_steps = daly_interval_s(pb.stall_s, 1.0 / pb.mean_rate(pb.start_step, pb.end_step))
        lines = [
            f"policy {self.policy}, objective {ov.objective}: {len(self.steps)} checkpoints in "
            f"steps ({pb.start_step}, {pb.end_step})",
            f"  intervals: first {iv[0] if iv.size else '-'}, median "
            f"{int(np.median(iv)) if iv.size else '-'}, last {iv[-1] if iv.size else '-'} steps "
            f"(Daly: {daly_steps / pb.step_time_s:.0f} steps = {daly_steps:.1f} s)",
            f"  inputs: step {pb.step_time_s:g} s, stall {pb.stall_s:g} s, persist "
            f"{pb.persist_s:g} s, restart {pb.restart_s:g} s, MTBF "
            f"{1.0 / pb.mean_rate(pb.start_step, pb.end_step):.0f} s, termination "
            f"{pb.termination.to_dict()['kind']}",
            f"  loss curve: {self.curve.reason} ({'used' if self.curve.trusted else 'flat value'})",
            f"  expected overhead ({ov.objective}): {ov.objective_s:.1f} s vs Daly "
            f"{ov.daly_objective_s:.1f} s ({100 * ov.gain_vs_daly:+.1f}% gain)",
            f"  expected wall-clock overhead: {ov.wall_s:.1f} s vs Daly {ov.daly_wall_s:.1f} s",
        ]
        return "\n".join(lines)


def build_curve(loss: Any, start_step: int, end_step: int) -> LossCurve:
    """Turn the ``loss`` argument (None, a callable, or ``(steps, losses)``) into a curve."""
    if loss is None:
        return FLAT
    if callable(loss):
        return curve_from_callable(loss, start_step, end_step)
    if isinstance(loss, (tuple, list)) and len(loss) == 2:
        steps = np.asarray(loss[0], dtype=np.float64)
        losses = np.asarray(loss[1], dtype=np.float64)
        if not np.all(np.isfinite(losses)):
            bad = int(np.sum(~np.isfinite(losses)))
            raise ConfigError(f"'loss' must not contain NaN or infinite values: {bad} found")
        return fit_loss_curve(steps, losses)
    raise ConfigError(f"'loss' must be None, a callable or (steps, losses): {type(loss)!r}")


def compare_with_daly(
    pb: Problem,
    steps: npt.ArrayLike,
    without_termination: Callable[[], Sequence[int]] | None = None,
) -> ExpectedOverhead:
    """Expected overhead of ``steps`` and of Daly's interval on the same problem (and of the
    plan that ``without_termination()`` makes ignoring the problem's termination model,
    costed with it)."""
    plan = expected_cost(pb, steps)
    plain_steps = None if without_termination is None else tuple(without_termination())
    plain = None if plain_steps is None else expected_cost(pb, plain_steps)
    daly_t = daly_interval_s(pb.stall_s, 1.0 / pb.mean_rate(pb.start_step, pb.end_step))
    daly = expected_cost(pb, uniform_schedule(pb, daly_t / pb.step_time_s))
    return ExpectedOverhead(
        objective=pb.objective,
        objective_s=plan.objective(pb.objective),
        wall_s=plan.wall_s,
        daly_objective_s=daly.objective(pb.objective),
        daly_wall_s=daly.wall_s,
        plan=plan,
        daly=daly,
        without_termination_objective_s=None if plain is None else plain.objective(pb.objective),
        without_termination_wall_s=None if plain is None else plain.wall_s,
        without_termination_steps=plain_steps,
    )


def plan_schedule(
    *,
    total_steps: int,
    step_time_s: float,
    stall_s: float,
    persist_s: float,
    restart_s: float,
    mtbf_s: float,
    loss: LossSpec = None,
    objective: str = "time",
    termination: Termination | Sequence[int] | None = None,
    start_step: int = 0,
    policy: str | SavePolicy = "coci",
    nodes: int | Callable[[int], float] = 1,
) -> Schedule:
    """Plan checkpoint steps for a job.

    Args:
        total_steps: the step the job ends at.
        step_time_s: compute time per step (any time unit, used consistently).
        stall_s: blocking snapshot time per checkpoint (> 0).
        persist_s: background persist time per checkpoint (0 for a synchronous save).
        restart_s: restart + restore time after a failure.
        mtbf_s: mean time between failures of one node.
        loss: a callable ``loss(step)``, observed ``(steps, losses)``, or None (flat value).
        objective: ``"time"`` (default), ``"convergence"`` or ``"progress"``.
        termination: None, a Termination model, or ASHA rung steps (reduction factor 3).
        start_step: the step the plan starts from.
        policy: a policy name (see :data:`~coci_core.planner.policies.POLICIES`) or object.
        nodes: the number of nodes (or a function of the step).

    Returns:
        The :class:`Schedule`; ``.steps`` and ``.expected_overhead_s`` (plan vs Daly).

    Raises:
        ConfigError: on any bad argument, naming it.
    """
    check_int("total_steps", total_steps, minimum=1)
    check_int("start_step", start_step, minimum=0)
    if total_steps <= start_step:
        raise ConfigError(f"'total_steps' must be > start_step ({start_step}): {total_steps!r}")
    if total_steps - start_step > MAX_SCHEDULE_STEPS:  # per-step arrays: time and memory
        raise ConfigError(
            f"'total_steps' - 'start_step' must be at most {MAX_SCHEDULE_STEPS:,} for one "
            f"schedule (a Planner plans a longer run in windows): {total_steps - start_step:,}"
        )
    check_positive("step_time_s", step_time_s)
    check_positive("stall_s", stall_s)
    check_nonnegative("persist_s", persist_s)
    check_nonnegative("restart_s", restart_s)
    check_positive("mtbf_s", mtbf_s)
    make_objective(objective)
    term = make_termination(termination)
    curve = build_curve(loss, start_step, total_steps)
    pb = Problem(
        start_step=start_step,
        end_step=total_steps,
        step_time_s=float(step_time_s),
        stall_s=float(stall_s),
        persist_s=float(persist_s),
        restart_s=float(restart_s),
        failure=FailureModel(mtbf_s=float(mtbf_s), nodes=nodes),
        value=value_density(curve, start_step, total_steps),
        objective=objective,
        termination=term,
    )
    pol = make_policy(policy) if isinstance(policy, str) else policy
    ctx = _context(loss, curve, start_step)
    steps = pol.plan(pb, context=ctx)
    return Schedule(
        steps=tuple(int(s) for s in steps),
        expected_overhead_s=compare_with_daly(pb, steps),
        policy=pol.name,
        problem=pb,
        curve=curve,
    )


def _context(loss: Any, curve: LossCurve, start_step: int) -> PlanContext:
    if callable(loss):
        ks = np.arange(start_step, start_step + 64, dtype=np.float64)
        values = np.array([float(loss(int(k))) for k in ks])
        return PlanContext(loss_steps=ks, loss_values=values, value_is_flat=not curve.trusted)
    if isinstance(loss, (tuple, list)) and len(loss) == 2:
        return PlanContext(
            loss_steps=np.asarray(loss[0], dtype=np.float64),
            loss_values=np.asarray(loss[1], dtype=np.float64),
            value_is_flat=not curve.trusted,
        )
    return PlanContext(value_is_flat=not curve.trusted)
