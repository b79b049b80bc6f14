"""Re-planning: when to remake the plan, and making it (a Problem from the observations, solved
by the policy), plus the plan's cursor that ``should_save`` walks.

Re-planning happens on a doubling schedule of steps (skipped when it would remake the same
plan), when a measured cost or the MTBF estimate moves by more than 20% from the value planned
with, after a restore, and when the loss leaves its fitted curve (a regime change); never on
every step.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import numpy as np

from coci_core.knobs import (
    COST_CHECK_EVERY,
    FIXED_AHEAD_STEPS,
    MAX_HORIZON_STEPS,
    MAX_PLAN_STEP,
    REGIME_CHECK_EVERY,
    REPLAN_CHANGE,
    REPLAN_MIN_GAP_STEPS,
    REPLAN_SETTLED,
    UNTRUSTED_CHECK_EVERY,
    UNTRUSTED_MIN_LOSSES,
)
from coci_core.planner.curve import FLAT, LossCurve, fit_loss_curve, value_density
from coci_core.planner.fixed_interval import fixed_ahead
from coci_core.planner.model import FailureModel, NoTermination, alive_at
from coci_core.planner.observations import RunObservations
from coci_core.planner.optimize import Problem, daly_interval_s
from coci_core.planner.policies import PlanContext
from coci_core.planner.schedule import ExpectedOverhead
from coci_core.planner.settings import PlannerSettings

__all__ = ["MAX_HORIZON_STEPS", "Replanner"]

logger = logging.getLogger("coci_core.planner.planner")

#: the curve of a coci plan whose objective weighs every step alike: none is fitted
UNUSED = LossCurve(trusted=False, reason="not fitted: the time objective weighs every step alike")


class Replanner:
    """The current plan of a Planner and the logic that remakes it (never raises into training)."""

    def __init__(self, settings: PlannerSettings, obs: RunObservations) -> None:
        self.settings = settings
        self.obs = obs
        self.schedule: list[int] = []
        self.ptr = 0
        self.next_replan: int | None = None
        self.force_replan = False
        self.replans = 0
        self.last_replan_s = 0.0
        self.plan_inputs: dict[str, float] = {}
        self.horizon_end: int | None = None
        self.curve: LossCurve = self.no_curve()
        self.pending_curve: LossCurve | None = None
        self.regime_flagged = False
        self.problem: Problem | None = None
        self.context: PlanContext | None = None  # the current plan's context
        self.overhead: ExpectedOverhead | None = None
        policy = settings.policy_name
        self.plan_method = "no plan yet" if settings.fixed_every is None else f"the {policy} policy"
        self.warned = False
        self.cost_assumed = True  # the plan's cost of a save is not a measured loop cost
        self.notice: str | None = None  # a preemption notice's plan, in words (then no re-plan)

    # ------------------------------------------------------------------ the plan's cursor

    def take(self, k: int) -> bool:
        """Whether the plan has a checkpoint at or before ``k`` not yet taken (moves on)."""
        sched = self.schedule
        i = self.ptr
        if i > 0 and k < sched[i - 1]:
            i = bisect.bisect_left(sched, k)
        if i < len(sched) and k >= sched[i]:
            self.ptr = bisect.bisect_right(sched, k, lo=i)
            return True
        self.ptr = i
        return False

    def ahead(self) -> tuple[int, ...]:
        """See :attr:`Planner.schedule`."""
        n = self.settings.fixed_every
        if n is not None and self.notice is None:
            obs = self.obs
            now = max(self.settings.start_step, obs.last_true, obs.last_step or 0)
            return tuple(fixed_ahead(n, now, self.settings.total_steps, FIXED_AHEAD_STEPS))
        return tuple(self.schedule[self.ptr :])

    # ------------------------------------------------------------------ when

    def after_observe(self, k: int) -> None:
        """Re-plan if it is time to (step ``k`` was just observed)."""
        if self.notice is not None:
            return  # the run ends at a notice's save: nothing more to plan
        try:
            if self._should_replan(k):
                self.replan(k)
        except Exception:  # the planner must never crash training
            if not self.warned:
                logger.exception("checking for a re-plan at step %d failed", k)
                self.warned = True

    def _should_replan(self, k: int) -> bool:
        obs, s = self.obs, self.settings
        if self.force_replan:
            return True
        if self.next_replan is None:
            return obs.costs.get("step_time_s").value is not None and (
                obs.observed >= 3 or obs.costs.get("step_time_s").source == "user"
            )
        if k >= self.next_replan:
            if not self._settled():
                return True
            since = max(1, k - s.start_step)
            self.next_replan = s.start_step + max(REPLAN_MIN_GAP_STEPS, 2 * since)
        # the step time drifts (checked now and then); a save's cost arrives with the save,
        # and one assumed (before any measured) may be far off: checked as it arrives
        new_costs, obs.new_costs = obs.new_costs, False
        if (
            (new_costs and self.cost_assumed) or obs.observed % COST_CHECK_EVERY == 0
        ) and self._moved(REPLAN_CHANGE):
            return True
        if obs.observed % REGIME_CHECK_EVERY == 0 and self.curve.trusted:
            return self._regime_changed(k)
        if (
            s.policy_name == "coci"
            and s.goal.uses_value
            and not self.curve.trusted
            and obs.observed % UNTRUSTED_CHECK_EVERY == 0
            and obs.losses.count() >= UNTRUSTED_MIN_LOSSES
        ):
            # the value only matters once the curve is trusted: re-plan as soon as it is
            curve = self.fit()
            if curve.trusted:
                self.pending_curve = curve
                return True
        horizon_cut = self.horizon_end is not None and (
            s.total_steps is None or self.horizon_end < s.total_steps
        )
        return horizon_cut and k >= (self.horizon_end or 0) - 1

    def _moved(self, share: float) -> bool:
        """Whether a cost or the MTBF has moved by more than ``share`` since the plan."""
        now = self.obs.plan_inputs()
        if now is None:
            return False
        for name, old in self.plan_inputs.items():
            new = now[name]
            if old > 0 and abs(new - old) > share * old:
                return True
        return False

    def _settled(self) -> bool:
        """Whether a scheduled re-plan would remake the same plan: the whole run is planned
        (no horizon to extend), no loss curve to refit, and the inputs have not moved."""
        s = self.settings
        return (
            self.problem is not None
            and s.total_steps is not None
            and self.horizon_end == s.total_steps
            and not self.uses_curve
            and not self._moved(REPLAN_SETTLED)
        )

    def _regime_changed(self, k: int) -> bool:
        if self.regime_flagged:
            return False
        steps, losses = self.obs.losses.arrays()
        recent = steps >= k - REGIME_CHECK_EVERY
        if recent.sum() < 8:
            return False
        with np.errstate(all="ignore"):
            resid = losses[recent] - self.curve.predict(steps[recent])
            se = float(np.std(resid)) / math.sqrt(int(recent.sum())) + 1e-12
            shift = float(np.mean(resid))
        if not (math.isfinite(se) and math.isfinite(shift)):
            return False
        if abs(shift) > max(6 * se, 0.05 * self.curve.scale):
            self.regime_flagged = True
            return True
        return False

    # ------------------------------------------------------------------ how

    def replan(self, k: int) -> None:
        """Re-plan from the newest checkpoint; on any error keep the previous plan."""
        try:
            self._replan_unsafe(k)
        except Exception:  # planning must never crash training
            if not self.warned:
                logger.exception("re-planning at step %d failed; keeping the previous plan", k)
                self.warned = True

    def _replan_unsafe(self, k: int) -> None:
        t0 = time.perf_counter()
        s, obs = self.settings, self.obs
        self.force_replan = False
        inputs = obs.plan_inputs()
        if inputs is None:
            return
        since = max(1, k - s.start_step)
        self.next_replan = s.start_step + max(REPLAN_MIN_GAP_STEPS, 2 * since)
        # plan from the newest checkpoint: the work since then is already at risk
        start = max(s.start_step, min(k, obs.last_true))
        tau = inputs["step_time_s"]
        if s.total_steps is not None:
            end = s.total_steps
        else:
            interval = s.fixed_every or (daly_interval_s(inputs["stall_s"], inputs["mtbf_s"]) / tau)
            # an MTBF of 1e308 s makes the interval infinite: the horizon is bounded below anyway
            ahead_steps = 20 * interval if 20 * interval < MAX_HORIZON_STEPS else MAX_HORIZON_STEPS
            end = start + max(s.min_horizon_steps, 2 * since, math.ceil(ahead_steps))
        # per-step arrays bound the horizon; a longer run is planned in windows (and no step
        # is planned past the last a checkpoint can have)
        end = min(end, start + MAX_HORIZON_STEPS, MAX_PLAN_STEP)
        if end - start < 2:
            self.schedule, self.ptr = [], 0
            return
        if self.pending_curve is not None:
            self.curve, self.pending_curve = self.pending_curve, None
        else:
            self.curve = self.fit() if self.uses_curve else self.no_curve()
        self.regime_flagged = False
        # a per-node MTBF scales with the world size; an estimated one is already job-level
        nodes = s.nodes if callable(s.nodes) and s.mtbf_s is not None else 1
        pb = Problem(
            start_step=start,
            end_step=end,
            step_time_s=tau,
            stall_s=inputs["stall_s"],
            persist_s=inputs["persist_s"],
            restart_s=inputs["restart_s"],
            failure=FailureModel(mtbf_s=inputs["mtbf_s"], nodes=nodes),
            # normalised over the whole run, so late progress keeps its low weight
            value=value_density(self.curve, s.start_step, end)[start - s.start_step :],
            objective=s.objective,
            # the job is running at k: a stop between the checkpoint and k can no longer come
            termination=alive_at(s.termination, k),
        )
        first = obs.first_losses
        ctx = PlanContext(
            loss_steps=np.array([r[0] for r in first]) if first else None,
            loss_values=np.array([r[1] for r in first]) if first else None,
            value_is_flat=not self.curve.trusted,
            max_interval_steps=s.cap_steps(tau),
        )
        steps = s.policy.plan(pb, context=ctx)
        ahead = [int(x) for x in steps if x > k]
        if s.fixed_every is not None:
            # exact multiples: never moved (should_save answers them without the schedule)
            if end % s.fixed_every == 0 and end > k:
                ahead.append(end)
        elif len(ahead) < len(steps):
            # a checkpoint is already overdue: take it at the next step, and plan the rest
            # from there (not from the overdue point, which would bunch two checkpoints)
            if end - (k + 1) >= 2:
                pb = dataclasses.replace(pb, start_step=k + 1, value=pb.v[k + 1 - start :])
                steps = s.policy.plan(pb, context=ctx)
            ahead = [k + 1, *(int(x) for x in steps if x > k + 1)]
        if (
            s.policy_name == "coci"
            and (s.goal.early_profile_save or (s.goal.unplanned_profile_save and not ahead))
            and isinstance(s.termination, NoTermination)
            and obs.costs.get("stall_s").source == "default"
        ):
            # no save measured yet: take one early to measure stall and persist, then re-plan
            # (where the objective finds it worth it: Objective.early_profile_save, or
            # unplanned_profile_save when no save is planned to measure it)
            # (from the plan's start, so that re-plans before it do not push it back)
            # (with nothing planned yet, e.g. a short job under the pessimistic defaults, a
            # quarter of the way to the horizon's end)
            nxt = ahead[0] if ahead else end
            profile = max(k + 1, start + max(1, (nxt - start) // 4))
            if profile < nxt:
                ahead.insert(0, profile)
        self.context = ctx
        self.schedule = ahead
        self.ptr = 0
        self.plan_method = self._describe_method(pb)
        self.problem = pb
        self.overhead = None
        self.horizon_end = end
        self.plan_inputs = inputs
        self.cost_assumed = (
            obs.costs.get("loop_cost_s").source != "measured"
            and obs.costs.get("stall_s").source != "user"
        )
        self.replans += 1
        self.last_replan_s = time.perf_counter() - t0

    def plan_notice(self, save_at: int, why: str) -> None:
        """A preemption notice of a known end: the one save left is at ``save_at``; no
        re-plan after it (see :meth:`Planner.plan_notice`)."""
        self.schedule, self.ptr = [int(save_at)], 0
        self.notice = why
        self.plan_method = f"preemption notice: {why}"
        self.problem = None  # nothing to cost against Daly: the run ends at the save
        self.overhead = None
        self.horizon_end = int(save_at)
        self.replans += 1

    def plain_planner(self) -> Callable[[], tuple[int, ...]] | None:
        """A function (pure, for any thread) that plans the current problem again without its
        termination model: how much of the plan comes from the termination hazard. None
        without a termination model, or for a fixed-interval policy."""
        pb, ctx, s = self.problem, self.context, self.settings
        if pb is None or ctx is None or s.fixed_every is not None:
            return None
        if isinstance(pb.termination, NoTermination):
            return None
        policy = s.policy

        def plan() -> tuple[int, ...]:
            plain = dataclasses.replace(pb, termination=NoTermination())
            return tuple(int(x) for x in policy.plan(plain, context=ctx))

        return plan

    def _describe_method(self, pb: Problem) -> str:
        s = self.settings
        if s.policy_name != "coci":
            return f"the {s.policy_name} policy"
        simple = isinstance(pb.termination, NoTermination) and pb.failure.is_constant
        if simple and s.goal.plans_as_time(not self.curve.trusted):
            why = "flat value" if s.goal.uses_value else f"{s.objective} objective"
            return f"Daly's interval ({why}, no termination model)"
        return f"{s.method} for the {s.objective} objective"

    @property
    def uses_curve(self) -> bool:
        """Whether the plan weighs progress by a fitted loss curve (coci, except under the
        ``time`` objective, which counts every step alike: the fit would be wasted)."""
        return self.settings.policy_name == "coci" and self.settings.goal.uses_value

    def no_curve(self) -> LossCurve:
        """The curve of a plan that fits none, saying why."""
        return UNUSED if self.settings.policy_name == "coci" else FLAT

    def fit(self) -> LossCurve:
        """The loss curve fitted to the losses so far (flat before any)."""
        steps, losses = self.obs.losses.arrays()
        if steps.size == 0:
            return FLAT
        return fit_loss_curve(steps, losses, breakpoints=self.settings.loss_breakpoints)
