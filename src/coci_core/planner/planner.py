"""The online Planner: observes a training run and answers ``should_save(step)``.

Called as (every rank may hold one, but only rank 0's decisions should be used):
1) ``Planner(...)`` (bad arguments raise ConfigError here);
2) each step: ``observe(step, loss=..., step_time_s=...)`` then ``should_save(step)``;
3) after a save: ``record_save(stall_s=..., persist_s=...)`` (any thread; persist may come
   later as ``record_save(persist_s=...)``); after a restore: ``record_restore(seconds)``;
4) ``state_dict()`` into the checkpoint manifest, ``load_state_dict()`` on resume.

Re-planning happens inside ``observe`` on a doubling schedule of steps, when a measured cost or
the MTBF estimate moves by more than 20% from the value planned with, after a restore, and
when the loss leaves its fitted curve (a regime change); never on every step.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coci_core.errors import ConfigError
from coci_core.planner._checks import (
    check_int,
    check_optional_positive,
    check_positive,
)
from coci_core.planner.costs import COST_NAMES, CostEstimator
from coci_core.planner.curve import (
    FLAT,
    LossCurve,
    curve_from_dict,
    fit_loss_curve,
    value_density,
)
from coci_core.planner.model import (
    DEFAULT_MTBF_S,
    FailureModel,
    NoTermination,
    Termination,
    estimate_mtbf_s,
    make_termination,
)
from coci_core.planner.optimize import Problem, check_objective, daly_interval_s
from coci_core.planner.policies import POLICIES, PlanContext, SavePolicy, make_policy
from coci_core.planner.schedule import ExpectedOverhead, compare_with_daly

__all__ = ["Planner", "PlannerReport"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAX_CHUNKS = 1024
_COST_CHECK_EVERY = 64
_REGIME_CHECK_EVERY = 256
_UNTRUSTED_CHECK_EVERY = 128
_CHANGE = 0.2
_MAX_CHARGED_STEPS = 256  # a persist that does not end within this many steps is not charged
#: the longest horizon planned at once (per-step arrays); longer runs are planned in windows
MAX_HORIZON_STEPS = 2_000_000


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


class _LossBuffer:
    """Losses aggregated in chunks of a doubling width (bounded memory, JSON state)."""

    def __init__(self) -> None:
        self.width = 1
        self.origin: int | None = None
        self.chunks: list[list[float]] = []  # [chunk index, sum step, sum loss, count]

    def add(self, step: int, loss: float) -> None:
        if self.origin is None:
            self.origin = step
        idx = (step - self.origin) // self.width
        if self.chunks and self.chunks[-1][0] == idx:
            c = self.chunks[-1]
            c[1] += step
            c[2] += loss
            c[3] += 1
            return
        self.chunks.append([float(idx), float(step), loss, 1.0])
        if len(self.chunks) > _MAX_CHUNKS:
            self._merge()

    def _merge(self) -> None:
        self.width *= 2
        merged: dict[int, list[float]] = {}
        for idx, ss, sl, n in self.chunks:
            key = int(idx) // 2
            if key in merged:
                m = merged[key]
                m[1] += ss
                m[2] += sl
                m[3] += n
            else:
                merged[key] = [float(key), ss, sl, n]
        self.chunks = [merged[k] for k in sorted(merged)]

    def arrays(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        if not self.chunks:
            return np.zeros(0), np.zeros(0)
        arr = np.asarray(self.chunks)
        return arr[:, 1] / arr[:, 3], arr[:, 2] / arr[:, 3]

    def count(self) -> int:
        return int(sum(c[3] for c in self.chunks))

    def state_dict(self) -> dict[str, object]:
        return {
            "width": self.width,
            "origin": self.origin,
            "chunks": [list(c) for c in self.chunks],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.width = int(state["width"])
        self.origin = None if state["origin"] is None else int(state["origin"])
        self.chunks = [[float(x) for x in c] for c in state["chunks"]]


class Planner:
    """Decides when to checkpoint a running job (see the module docstring for the call order).

    Args:
        policy: ``"coci"`` (default, optimal for the objective) or a baseline: ``"young"``,
            ``"daly"``, ``"checkfreq"``, ``"every_n_steps"``, ``"every_n_seconds"``,
            ``"epoch"``, ``"coci_paper"``.
        objective: ``"time"``, ``"convergence"`` (default) or ``"progress"``.
        total_steps: the job's last step; None plans over a rolling horizon of
            ``max(min_horizon_steps, 2 x steps so far)`` ahead, re-planned as it goes.
        mtbf_s: MTBF of one node; None estimates it from the run's restarts with a prior of
            ``default_mtbf_s`` (job level).
        nodes: number of nodes, or a function of the step (the failure rate scales with it).
        step_time_s: a user-given step time in s (overrides the measurements).
        stall_s: a user-given stall per save in s (overrides the measurements).
        persist_s: a user-given persist time per save in s (overrides the measurements).
        restart_s: a user-given restart time in s (overrides the measurements).
        default_restart_s: restart time assumed before the first measured restore.
        default_stall_s: stall time assumed before the first measured save.
        default_mtbf_s: prior MTBF when ``mtbf_s`` is None.
        termination: None, a Termination model, or ASHA rung steps.
        every_n_steps: the interval of that policy; with ``coci``, ``daly`` or ``young`` it
            caps the interval (save at least that often).
        every_n_seconds: the interval of that policy; with ``coci``, ``daly`` or ``young`` it
            caps the interval.
        steps_per_epoch: the interval of the ``epoch`` policy.
        checkfreq_overhead_bound: CheckFreq's overhead bound.
        start_step: the first step of this run.
        loss_breakpoints: known regime changes (learning-rate drops), as steps.
        method: ``"dp"`` or ``"closed_form"`` for ``coci``.
        grid_points: DP grid size (bounds re-planning time).
        min_horizon_steps: the shortest rolling horizon.

    Raises:
        ConfigError: on any bad argument, naming it, the rule and the value.
    """

    def __init__(
        self,
        *,
        policy: str = "coci",
        objective: str = "convergence",
        total_steps: int | None = None,
        mtbf_s: float | None = None,
        nodes: int | Callable[[int], float] = 1,
        step_time_s: float | None = None,
        stall_s: float | None = None,
        persist_s: float | None = None,
        restart_s: float | None = None,
        default_restart_s: float = 60.0,
        default_stall_s: float = 1.0,
        default_mtbf_s: float = DEFAULT_MTBF_S,
        termination: Termination | Sequence[int] | None = None,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        steps_per_epoch: int | None = None,
        checkfreq_overhead_bound: float = 0.05,
        start_step: int = 0,
        loss_breakpoints: Sequence[int] = (),
        method: str = "dp",
        grid_points: int = 1000,
        min_horizon_steps: int = 1000,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"'policy' must be one of {', '.join(POLICIES)}: {policy!r}")
        self.objective = check_objective(objective)
        self.policy_name = policy
        self.total_steps = (
            None if total_steps is None else check_int("total_steps", total_steps, minimum=1)
        )
        self.mtbf_s = check_optional_positive("mtbf_s", mtbf_s)
        self.default_mtbf_s = check_positive("default_mtbf_s", default_mtbf_s)
        if not callable(nodes):
            check_int("nodes", nodes, minimum=1)
        self.nodes = nodes
        self.every_n_steps = (
            None if every_n_steps is None else check_int("every_n_steps", every_n_steps, minimum=1)
        )
        self.every_n_seconds = check_optional_positive("every_n_seconds", every_n_seconds)
        self.start_step = check_int("start_step", start_step, minimum=0)
        if self.total_steps is not None and self.total_steps <= self.start_step:
            raise ConfigError(f"'total_steps' must be > start_step: {total_steps!r}")
        self.termination = make_termination(termination)
        self.loss_breakpoints = tuple(
            check_int("loss_breakpoints", b, minimum=0) for b in loss_breakpoints
        )
        self.min_horizon_steps = check_int("min_horizon_steps", min_horizon_steps, minimum=1)
        options: dict[str, Any] = {}
        if policy == "every_n_steps":
            if self.every_n_steps is None:
                raise ConfigError("'every_n_steps' must be given for policy 'every_n_steps': None")
            options["every_n_steps"] = self.every_n_steps
        elif policy == "every_n_seconds":
            if self.every_n_seconds is None:
                raise ConfigError(
                    "'every_n_seconds' must be given for policy 'every_n_seconds': None"
                )
            options["every_n_seconds"] = self.every_n_seconds
        elif policy == "epoch":
            if steps_per_epoch is None:
                raise ConfigError("'steps_per_epoch' must be given for policy 'epoch': None")
            options["steps_per_epoch"] = steps_per_epoch
        elif policy == "checkfreq":
            options["overhead_bound"] = checkfreq_overhead_bound
        elif policy == "coci":
            options["method"] = method
            options["grid_points"] = grid_points
        self._policy: SavePolicy = make_policy(policy, **options)
        # A fixed interval (every_n_steps, epoch) needs no measurement: it saves at exactly
        # the multiples of N from step 1, the run's last step included.
        self._fixed_every: int | None = (
            int(options["every_n_steps"])
            if policy == "every_n_steps"
            else int(options["steps_per_epoch"])
            if policy == "epoch"
            else None
        )
        self._costs = CostEstimator(
            step_time_s=step_time_s,
            stall_s=stall_s,
            persist_s=persist_s,
            restart_s=restart_s,
            default_restart_s=default_restart_s,
            default_stall_s=default_stall_s,
        )
        self._lock = threading.Lock()
        self._losses = _LossBuffer()
        self._first_losses: list[list[float]] = []  # raw, for coci_paper
        self._skipped = 0
        self._observed = 0
        self._last_step: int | None = None
        self._elapsed_s = 0.0
        self._failures = 0
        self._schedule: list[int] = []
        self._ptr = 0
        self._last_true = -1
        self._exclude_next = False
        # The save being charged for its cost to the loop: [its stall (None until its persist
        # ended), excess step time so far, steps counted].
        self._charge: list[Any] | None = None
        self._next_replan: int | None = None
        self._force_replan = False
        self._replans = 0
        self._last_replan_s = 0.0
        self._plan_inputs: dict[str, float] = {}
        self._horizon_end: int | None = None
        self._curve: LossCurve = FLAT
        self._pending_curve: LossCurve | None = None
        self._regime_flagged = False
        self._problem: Problem | None = None
        self._overhead: ExpectedOverhead | None = None
        self._plan_method = "no plan yet" if self._fixed_every is None else f"the {policy} policy"
        self._warned = False
        self._method = method

    # ------------------------------------------------------------------ hot path

    def observe(
        self, step: int, *, loss: float | None = None, step_time_s: float | None = None
    ) -> None:
        """Record one training step; may re-plan (bounded time). Never raises on odd values.

        NaN/inf losses are skipped and counted (see ``report().skipped_losses``).
        """
        try:
            k = int(step)
        except (TypeError, ValueError, OverflowError):
            return
        self._observed += 1
        if loss is not None:
            try:
                x = float(loss)
            except (TypeError, ValueError):
                x = math.nan
            if math.isfinite(x):
                self._losses.add(k, x)
                if len(self._first_losses) < 64:
                    self._first_losses.append([float(k), x])
            else:
                self._skipped += 1
        if step_time_s is not None:
            with self._lock:
                exclude = self._exclude_next
                self._exclude_next = False
            try:
                st = float(step_time_s)
            except (TypeError, ValueError):
                st = math.nan
            if math.isfinite(st) and st >= 0:
                with self._lock:
                    self._elapsed_s += st
                if self._charge is not None:
                    self._charge_step(st)
                if not exclude:
                    self._costs.add("step_time_s", st)
        self._last_step = k
        try:
            if self._should_replan(k):
                self._replan(k)
        except Exception:  # the planner must never crash training
            if not self._warned:
                logger.exception("checking for a re-plan at step %d failed", k)
                self._warned = True

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Set the ``epoch`` policy's interval once the run knows it (a Lightning Trainer
        knows its batches per epoch only when training starts)."""
        if self.policy_name != "epoch":
            raise ConfigError(
                f"'steps_per_epoch' is the interval of policy 'epoch', not {self.policy_name!r}"
            )
        steps = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        with self._lock:
            self._policy = make_policy("epoch", steps_per_epoch=steps)
            self._fixed_every = steps

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint after ``step``: O(1), never raises (False on odd input)."""
        try:
            k = int(step)
            if k == self._last_true:
                return True
            n = self._fixed_every
            if n is not None:
                if k > 0 and k % n == 0:
                    self._mark_save(k)
                    return True
                return False
            sched = self._schedule
            i = self._ptr
            if i > 0 and k < sched[i - 1]:
                i = bisect.bisect_left(sched, k)
            if i < len(sched) and k >= sched[i]:
                i = bisect.bisect_right(sched, k, lo=i)
                self._ptr = i
                self._mark_save(k)
                return True
            self._ptr = i
            return False
        except Exception:
            return False

    def _mark_save(self, k: int) -> None:
        """``should_save(k)`` answered True: remember it, and charge the save's cost."""
        self._last_true = k
        self._exclude_next = True
        with self._lock:
            self._charge = [None, 0.0, 0]

    def _fixed_ahead(self, n: int, count: int) -> list[int]:
        """The next ``count`` multiples of ``n`` after the current step (to the last step)."""
        now = max(self.start_step, self._last_true, self._last_step or 0)
        first = (now // n + 1) * n
        last = first + (count - 1) * n
        if self.total_steps is not None:
            last = min(last, self.total_steps)
        return list(range(first, last + 1, n))

    def record_save(
        self,
        *,
        stall_s: float | None = None,
        persist_s: float | None = None,
        unobserved_stall_s: float | None = None,
    ) -> None:
        """Record a save's measured stall and/or persist time (thread-safe).

        ``unobserved_stall_s``: the part of the stall that the step times given to
        :meth:`observe` do not include (default: all of it; a wait inside the next step, as
        in ``before_update``, is already in that step's time).
        """
        if stall_s is not None:
            self._costs.add("stall_s", stall_s)
            with contextlib.suppress(TypeError, ValueError), self._lock:
                self._elapsed_s += max(0.0, float(stall_s))
        if persist_s is not None:
            self._costs.add("persist_s", persist_s)
        with self._lock:
            self._exclude_next = True
            if self._charge is not None and self._charge[0] is None:
                outside = stall_s if unobserved_stall_s is None else unobserved_stall_s
                with contextlib.suppress(TypeError, ValueError):
                    self._charge[0] = max(0.0, float(outside or 0.0))

    def _charge_step(self, step_time_s: float) -> None:
        """Charge a step that overlapped a save's persist with its excess over the usual step
        time; once the persist has ended (this step included), record the save's loop cost."""
        tau = self._costs.get("step_time_s").value
        with self._lock:
            charge = self._charge
            if charge is None or tau is None:
                return
            charge[1] += step_time_s - tau
            charge[2] += 1
            if charge[0] is None and charge[2] < _MAX_CHARGED_STEPS:
                return
            self._charge = None
        if charge[0] is not None:  # else the save never committed: nothing to learn
            self._costs.add("loop_cost_s", max(charge[0], charge[0] + charge[1]))

    def record_restore(self, seconds: float) -> None:
        """Record a restore after a failure: one more failure, and its measured duration."""
        if self._costs.add("restart_s", seconds):
            self._elapsed_s += float(seconds)
        self._failures += 1
        self._force_replan = True

    # ------------------------------------------------------------------ planning

    def cost_source(self, name: str) -> str:
        """Where cost ``name`` comes from: ``"user"``, ``"measured"``, ``"default"`` or
        ``"unknown"`` (cheap)."""
        return self._costs.get(name).source

    def overhead_inputs(self) -> tuple[Problem, tuple[int, ...]] | None:
        """The current plan's problem and steps, so that its expected overhead against Daly
        (``schedule.compare_with_daly``) can be computed off the training thread."""
        if self._problem is None:
            return None
        return self._problem, tuple(self._schedule)

    @property
    def replans(self) -> int:
        """How many plans have been made (cheap: tells telemetry when the plan changed)."""
        return self._replans

    @property
    def schedule(self) -> tuple[int, ...]:
        """The planned checkpoint steps still ahead (for a fixed interval, the next 64,
        known from the start: no measurement is needed to plan them)."""
        if self._fixed_every is not None:
            return tuple(self._fixed_ahead(self._fixed_every, 64))
        return tuple(self._schedule[self._ptr :])

    def _mtbf(self) -> tuple[float, str]:
        """MTBF planned with: per node if ``nodes`` is a function, else for the whole job."""
        if self.mtbf_s is not None:
            nodes = 1 if callable(self.nodes) else self.nodes
            return self.mtbf_s / nodes, "user"
        src = "estimated" if self._failures else "default"
        return estimate_mtbf_s(
            failures=self._failures, elapsed_s=self._elapsed_s, prior_mtbf_s=self.default_mtbf_s
        ), src

    def _inputs(self) -> dict[str, float] | None:
        snap = self._costs.snapshot()
        step_t = snap["step_time_s"].value
        if step_t is None or step_t <= 0:
            return None
        stall = snap["stall_s"].value
        loop_cost = snap["loop_cost_s"].value
        if stall is not None and loop_cost is not None and snap["stall_s"].source != "user":
            # what a checkpoint costs is the training time it takes, not only its stall
            stall = max(stall, loop_cost)
        persist = snap["persist_s"].value
        return {
            "step_time_s": step_t,
            "stall_s": stall if stall else 1e-6,
            "persist_s": persist if persist is not None else 0.0,
            "restart_s": snap["restart_s"].value or 0.0,
            "mtbf_s": self._mtbf()[0],
        }

    def _should_replan(self, k: int) -> bool:
        if self._force_replan:
            return True
        if self._next_replan is None:
            return self._costs.get("step_time_s").value is not None and (
                self._observed >= 3 or self._costs.get("step_time_s").source == "user"
            )
        if k >= self._next_replan:
            return True
        if self._observed % _COST_CHECK_EVERY == 0:
            now = self._inputs()
            if now is not None:
                for name, old in self._plan_inputs.items():
                    new = now[name]
                    if old > 0 and abs(new - old) > _CHANGE * old:
                        return True
        if self._observed % _REGIME_CHECK_EVERY == 0 and self._curve.trusted:
            return self._regime_changed(k)
        if (
            self.policy_name == "coci"
            and self.objective != "time"
            and not self._curve.trusted
            and self._observed % _UNTRUSTED_CHECK_EVERY == 0
            and self._losses.count() >= 64
        ):
            # the value only matters once the curve is trusted: re-plan as soon as it is
            curve = self._fit()
            if curve.trusted:
                self._pending_curve = curve
                return True
        horizon_cut = self._horizon_end is not None and (
            self.total_steps is None or self._horizon_end < self.total_steps
        )
        return horizon_cut and k >= (self._horizon_end or 0) - 1

    def _regime_changed(self, k: int) -> bool:
        if self._regime_flagged:
            return False
        steps, losses = self._losses.arrays()
        recent = steps >= k - _REGIME_CHECK_EVERY
        if recent.sum() < 8:
            return False
        with np.errstate(all="ignore"):
            resid = losses[recent] - self._curve.predict(steps[recent])
            se = float(np.std(resid)) / math.sqrt(int(recent.sum())) + 1e-12
            shift = float(np.mean(resid))
        if not (math.isfinite(se) and math.isfinite(shift)):
            return False
        if abs(shift) > max(6 * se, 0.05 * self._curve.scale):
            self._regime_flagged = True
            return True
        return False

    def _replan(self, k: int) -> None:
        """Re-plan from the newest checkpoint; on any error keep the previous plan."""
        try:
            self._replan_unsafe(k)
        except Exception:  # planning must never crash training
            if not self._warned:
                logger.exception("re-planning at step %d failed; keeping the previous plan", k)
                self._warned = True

    def _replan_unsafe(self, k: int) -> None:
        t0 = time.perf_counter()
        self._force_replan = False
        inputs = self._inputs()
        if inputs is None:
            return
        since = max(1, k - self.start_step)
        self._next_replan = self.start_step + max(64, 2 * since)
        # plan from the newest checkpoint: the work since then is already at risk
        start = max(self.start_step, min(k, self._last_true))
        tau = inputs["step_time_s"]
        if self.total_steps is not None:
            end = self.total_steps
        else:
            interval = self._fixed_every or (
                daly_interval_s(inputs["stall_s"], inputs["mtbf_s"]) / tau
            )
            end = start + max(self.min_horizon_steps, 2 * since, math.ceil(20 * interval))
        # per-step arrays bound the horizon; a longer run is planned in windows
        end = min(end, start + MAX_HORIZON_STEPS)
        if end - start < 2:
            self._schedule, self._ptr = [], 0
            return
        if self._pending_curve is not None:
            self._curve, self._pending_curve = self._pending_curve, None
        else:
            self._curve = self._fit() if self.policy_name == "coci" else FLAT
        self._regime_flagged = False
        cap = self._cap_steps(tau)
        # a per-node MTBF scales with the world size; an estimated one is already job-level
        nodes = self.nodes if callable(self.nodes) and self.mtbf_s is not None else 1
        pb = Problem(
            start_step=start,
            end_step=end,
            step_time_s=tau,
            stall_s=inputs["stall_s"],
            persist_s=inputs["persist_s"],
            restart_s=inputs["restart_s"],
            failure=FailureModel(mtbf_s=inputs["mtbf_s"], nodes=nodes),
            # normalised over the whole run, so late progress keeps its low weight
            value=value_density(self._curve, self.start_step, end)[start - self.start_step :],
            objective=self.objective,
            termination=self.termination,
        )
        ctx = PlanContext(
            loss_steps=np.array([r[0] for r in self._first_losses]) if self._first_losses else None,
            loss_values=np.array([r[1] for r in self._first_losses])
            if self._first_losses
            else None,
            value_is_flat=not self._curve.trusted,
            max_interval_steps=cap,
        )
        steps = self._policy.plan(pb, context=ctx)
        ahead = [int(s) for s in steps if s > k]
        if self._fixed_every is not None:
            # exact multiples: never moved (should_save answers them without the schedule)
            if end % self._fixed_every == 0 and end > k:
                ahead.append(end)
        elif len(ahead) < len(steps):
            # a checkpoint is already overdue: take it at the next step, and plan the rest
            # from there (not from the overdue point, which would bunch two checkpoints)
            if end - (k + 1) >= 2:
                pb = dataclasses.replace(pb, start_step=k + 1, value=pb.v[k + 1 - start :])
                steps = self._policy.plan(pb, context=ctx)
            ahead = [k + 1, *(int(s) for s in steps if s > k + 1)]
        if (
            self.policy_name == "coci"
            and self.objective == "convergence"
            and isinstance(self.termination, NoTermination)
            and self._costs.get("stall_s").source == "default"
        ):
            # no save measured yet: take one early to measure stall and persist, then re-plan
            # (only for "convergence": under "progress" an early stall is weighted by the high
            # early value and costs more than it teaches)
            # (from the plan's start, so that re-plans before it do not push it back)
            # (with nothing planned yet, e.g. a short job under the pessimistic defaults, a
            # quarter of the way to the horizon's end)
            first = ahead[0] if ahead else end
            profile = max(k + 1, start + max(1, (first - start) // 4))
            if profile < first:
                ahead.insert(0, profile)
        self._schedule = ahead
        self._ptr = 0
        self._plan_method = self._describe_method(pb)
        self._problem = pb
        self._overhead = None
        self._horizon_end = end
        self._plan_inputs = inputs
        self._replans += 1
        self._last_replan_s = time.perf_counter() - t0

    def _describe_method(self, pb: Problem) -> str:
        if self.policy_name != "coci":
            return f"the {self.policy_name} policy"
        simple = isinstance(pb.termination, NoTermination) and pb.failure.is_constant
        if simple and (not self._curve.trusted or self.objective == "time"):
            why = "time objective" if self.objective == "time" else "flat value"
            return f"Daly's interval ({why}, no termination model)"
        return f"{self._method} for the {self.objective} objective"

    def _cap_steps(self, tau: float) -> int | None:
        if self.policy_name not in ("coci", "daly", "young"):
            return None
        caps = []
        if self.every_n_steps is not None:
            caps.append(self.every_n_steps)
        if self.every_n_seconds is not None:
            caps.append(max(1, int(self.every_n_seconds / tau)))
        return min(caps) if caps else None

    def _fit(self) -> LossCurve:
        steps, losses = self._losses.arrays()
        if steps.size == 0:
            return FLAT
        return fit_loss_curve(steps, losses, breakpoints=self.loss_breakpoints)

    # ------------------------------------------------------------------ reporting

    def explain(self, step: int) -> str:
        """Why ``step`` is (not) a checkpoint: the interval, the inputs and expected overhead."""
        try:
            k = int(step)
        except (TypeError, ValueError, OverflowError):
            return f"step {step!r} is not an integer step"
        sched = self._schedule
        planned = k in sched or k == self._last_true
        n = self._fixed_every
        if n is not None:
            near = max(1, k // n - 1) * n
            sched = list(range(near, k + 2 * n + 1, n))
            planned = k > 0 and k % n == 0
        before = [s for s in sched if s < k]
        after = [s for s in sched if s > k]
        rep = self.report()
        lines = [
            f"step {k}: {'checkpoint' if planned else 'no checkpoint'} "
            f"(policy {self.policy_name}, objective {self.objective})",
            f"  previous planned {before[-1] if before else '-'}, next planned "
            f"{after[0] if after else '-'}",
        ]
        if planned and before:
            lines.append(f"  interval {k - before[-1]} steps")
        lines.append(
            "  inputs: "
            + ", ".join(f"{n} {rep.costs[n]!s} ({rep.cost_sources[n]})" for n in COST_NAMES)
        )
        lines.append(
            f"  MTBF {rep.mtbf_s} s ({rep.mtbf_source}); loss curve: {rep.loss_fit_reason}"
        )
        lines.append(f"  plan: {rep.plan_method}")
        if self._problem is not None:
            i = int(np.clip(k - self._problem.start_step, 0, self._problem.horizon_steps - 1))
            lines.append(f"  value density here {float(self._problem.v[i]):.2f} (mean 1)")
        ov = rep.expected_overhead
        if ov is not None:
            lines.append(
                f"  expected overhead ({ov.objective}) {ov.objective_s:.1f} s vs Daly "
                f"{ov.daly_objective_s:.1f} s; wall-clock {ov.wall_s:.1f} s vs Daly "
                f"{ov.daly_wall_s:.1f} s (horizon to step {rep.horizon_end_step}"
                f"{', rolling' if rep.rolling else ''})"
            )
        return "\n".join(lines)

    def report(self, *, with_overhead: bool = True) -> PlannerReport:
        """A snapshot for telemetry.

        The plan-vs-Daly figures are computed on the first call after each plan and cached;
        on a horizon of thousands of checkpoints that takes seconds, so a caller on the
        training thread passes ``with_overhead=False`` and computes them elsewhere from
        :meth:`overhead_inputs`.
        """
        if with_overhead and self._overhead is None and self._problem is not None:
            self._overhead = compare_with_daly(self._problem, self._schedule)
        snap = self._costs.snapshot()
        ahead = list(self.schedule)
        k = self._last_step if self._last_step is not None else self.start_step
        interval = None
        if self._fixed_every is not None:
            interval = self._fixed_every
        elif len(self._schedule) >= 2:
            j = min(max(self._ptr, 1), len(self._schedule) - 1)
            interval = self._schedule[j] - self._schedule[j - 1]
        fitted = None
        if self._curve.trusted:
            fitted = float(self._curve.predict(np.array([k]))[0])
        mtbf, src = self._mtbf()
        return PlannerReport(
            step=k,
            policy=self.policy_name,
            objective=self.objective,
            next_steps=tuple(ahead[:10]),
            interval_steps=interval,
            horizon_end_step=self._horizon_end,
            rolling=self.total_steps is None,
            expected_overhead=self._overhead,
            loss_params=tuple(p.to_dict() for p in self._curve.pieces),
            loss_fit_reason=self._curve.reason,
            fitted_loss=fitted,
            mtbf_s=mtbf,
            mtbf_source=src,
            costs={n: e.value for n, e in snap.items()},
            cost_sources={n: e.source for n, e in snap.items()},
            replans=self._replans,
            last_replan_s=self._last_replan_s,
            skipped_losses=self._skipped,
            plan_method=self._plan_method,
        )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state: estimates, losses, the plan and counters."""
        with self._lock:
            exclude = self._exclude_next
        return {
            "format_version": FORMAT_VERSION,
            "policy": self.policy_name,
            "objective": self.objective,
            "costs": self._costs.state_dict(),
            "losses": self._losses.state_dict(),
            "first_losses": [list(r) for r in self._first_losses],
            "skipped_losses": self._skipped,
            "observed": self._observed,
            "last_step": self._last_step,
            "elapsed_s": self._elapsed_s,
            "failures": self._failures,
            "schedule": list(self._schedule),
            "ptr": self._ptr,
            "last_true": self._last_true,
            "exclude_next": exclude,
            "next_replan": self._next_replan,
            "force_replan": self._force_replan,
            "replans": self._replans,
            "plan_inputs": dict(self._plan_inputs),
            "horizon_end": self._horizon_end,
            "regime_flagged": self._regime_flagged,
            "curve": self._curve.to_dict(),
            "pending_curve": None if self._pending_curve is None else self._pending_curve.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (the plan is re-fitted from the losses).

        Raises:
            ConfigError: if the state is from another format version or policy.
        """
        if state.get("format_version") != FORMAT_VERSION:
            raise ConfigError(
                f"'state' format_version must be {FORMAT_VERSION}: {state.get('format_version')!r}"
            )
        if state.get("policy") != self.policy_name:
            raise ConfigError(
                f"'state' policy must be {self.policy_name!r}: {state.get('policy')!r}"
            )
        self._costs.load_state_dict(state["costs"])
        self._losses.load_state_dict(state["losses"])
        self._first_losses = [[float(a), float(b)] for a, b in state["first_losses"]]
        self._skipped = int(state["skipped_losses"])
        self._observed = int(state["observed"])
        self._last_step = None if state["last_step"] is None else int(state["last_step"])
        self._elapsed_s = float(state["elapsed_s"])
        self._failures = int(state["failures"])
        self._schedule = [int(s) for s in state["schedule"]]
        self._ptr = int(state["ptr"])
        self._last_true = int(state["last_true"])
        with self._lock:
            self._exclude_next = bool(state["exclude_next"])
        self._next_replan = None if state["next_replan"] is None else int(state["next_replan"])
        self._force_replan = bool(state["force_replan"])
        self._replans = int(state["replans"])
        self._plan_inputs = {str(k): float(v) for k, v in state["plan_inputs"].items()}
        self._horizon_end = None if state["horizon_end"] is None else int(state["horizon_end"])
        self._regime_flagged = bool(state["regime_flagged"])
        self._curve = curve_from_dict(state["curve"]) if state.get("curve") else FLAT
        pending = state.get("pending_curve")
        self._pending_curve = curve_from_dict(pending) if pending else None
        self._problem = None
        self._overhead = None
