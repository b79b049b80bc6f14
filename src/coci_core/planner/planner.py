"""The online Planner: observes a training run and answers ``should_save(step)``.

Called as (every rank may hold one, but only rank 0's decisions should be used):
1) ``Planner(...)`` (bad arguments raise ConfigError here);
2) each step: ``observe(step, loss=..., step_time_s=...)`` then ``should_save(step)``;
3) after a save: ``record_save(stall_s=..., persist_s=...)`` (any thread; persist may come
   later as ``record_save(persist_s=...)``); after a restore: ``record_restore(seconds)``;
4) ``state_dict()`` into the checkpoint manifest, ``load_state_dict()`` on resume.

Re-planning happens inside ``observe`` on a doubling schedule of steps (skipped when it would
remake the same plan), when a measured cost or the MTBF estimate moves by more than 20% from
the value planned with, after a restore, and when the loss leaves its fitted curve (a regime
change); never on every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

from coci_core.errors import ConfigError
from coci_core.planner.checks import check_int
from coci_core.planner.costs import (
    DEFAULT_RESTART_S,
    DEFAULT_STALL_S,
    CostEstimator,
    CostInputs,
)
from coci_core.planner.fixed_interval import is_fixed_save
from coci_core.planner.model import DEFAULT_MTBF_S, Termination, make_termination, nodes_at
from coci_core.planner.observations import RunObservations
from coci_core.planner.optimize import Problem
from coci_core.planner.planner_state import load_planner_state, planner_state
from coci_core.planner.policies import SavePolicy, make_policy
from coci_core.planner.replanning import MAX_HORIZON_STEPS as MAX_HORIZON_STEPS  # re-exported
from coci_core.planner.replanning import Replanner
from coci_core.planner.report import PlannerReport, build_report, explain_step
from coci_core.planner.settings import PlannerConfig, PlannerSettings, make_settings
from coci_core.planner.two_level import TierCosts, TwoLevelPlan, plan_two_levels
from coci_core.planner.upload_costs import UploadCosts

__all__ = ["Planner", "PlannerConfig", "PlannerReport", "check_planner_state", "planner_config"]

T = TypeVar("T")


class _Setting(Generic[T]):
    """A Planner attribute kept in its shared :class:`PlannerSettings` (readable, writable)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Setting[T]: ...
    @overload
    def __get__(self, obj: Planner, objtype: type | None = None) -> T: ...
    def __get__(self, obj: Planner | None, objtype: type | None = None) -> T | _Setting[T]:
        if obj is None:
            return self
        value: T = getattr(obj._settings, self.name)
        return value

    def __set__(self, obj: Planner, value: T) -> None:
        setattr(obj._settings, self.name, value)


class Planner:
    """Decides when to checkpoint a running job (see the module docstring for the call order).

    Args:
        policy: ``"coci"`` (default, optimal for the objective) or a baseline: ``"young"``,
            ``"daly"``, ``"checkfreq"``, ``"every_n_steps"``, ``"every_n_seconds"``,
            ``"epoch"``, ``"coci_paper"``; or a policy object of this package, which carries
            its own options (``EveryNSteps(every_n_steps=500)``, ``CheckFreq(overhead_bound=
            0.03)``, ``Coci(method="closed_form")``, ...).
        objective: ``"time"`` (default), ``"convergence"`` or ``"progress"``.
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
        node_loss_share: the share of failures that lose the node and its local disk
            (preemptions, hardware), against process crashes that keep it; with a remote tier
            it sets how often a save is also uploaded (:meth:`upload_every`).

    Raises:
        ConfigError: on any bad argument, naming it, the rule and the value.
    """

    def __init__(
        self,
        *,
        policy: str | SavePolicy = "coci",
        objective: str = "time",
        total_steps: int | None = None,
        mtbf_s: float | None = None,
        nodes: int | Callable[[int], float] = 1,
        step_time_s: float | None = None,
        stall_s: float | None = None,
        persist_s: float | None = None,
        restart_s: float | None = None,
        default_restart_s: float = DEFAULT_RESTART_S,
        default_stall_s: float = DEFAULT_STALL_S,
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
        node_loss_share: float = 0.5,
    ) -> None:
        arguments = dict(locals())  # exactly the parameters, at this point
        del arguments["self"]
        self._start(_checked(arguments))

    @classmethod
    def from_config(cls, config: PlannerConfig) -> Planner:
        """A new Planner from arguments checked once by :func:`planner_config` (nothing is
        checked again; the planner gets its own copy of the settings)."""
        planner = cls.__new__(cls)
        planner._start(config)
        return planner

    def _start(self, config: PlannerConfig) -> None:
        nodes = config.settings.nodes
        if callable(nodes):
            # a callable that fails, fails here (when training starts, for an adapter: it may
            # read the process group), not in each re-plan
            nodes_at(nodes, config.settings.start_step)
        self._settings: PlannerSettings = dataclasses.replace(config.settings)
        self._obs = RunObservations(self._settings, CostEstimator(config.costs))
        self._plan = Replanner(self._settings, self._obs)
        self._uploads = UploadCosts()
        # This planner's restores and restarts, in order: a state loaded after them (the
        # checkpoint's, taken before the failure) must not forget them. A state counts those
        # of its run (``session``) it holds; ``_recorded[0]`` is that count's ``_base``.
        self._session = uuid.uuid4().hex
        self._recorded: list[tuple[str, float]] = []
        self._base = 0

    policy_name = _Setting[str]()
    objective = _Setting[str]()
    total_steps = _Setting[int | None]()
    mtbf_s = _Setting[float | None]()
    default_mtbf_s = _Setting[float]()
    nodes = _Setting[int | Callable[[int], float]]()
    every_n_steps = _Setting[int | None]()
    every_n_seconds = _Setting[float | None]()
    start_step = _Setting[int]()
    termination = _Setting[Termination]()
    loss_breakpoints = _Setting[tuple[int, ...]]()
    min_horizon_steps = _Setting[int]()

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
        self._obs.observe(k, loss, step_time_s)
        if isinstance(step_time_s, (int, float)) and math.isfinite(step_time_s):
            self._uploads.step(float(step_time_s))
        self._plan.after_observe(k)

    def set_steps_per_epoch(self, steps_per_epoch: int) -> None:
        """Set the ``epoch`` policy's interval once the run knows it (a Lightning Trainer
        knows its batches per epoch only when training starts)."""
        if self.policy_name != "epoch":
            raise ConfigError(
                f"'steps_per_epoch' is the interval of policy 'epoch', not {self.policy_name!r}"
            )
        steps = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        with self._obs.lock:
            self._settings.policy = make_policy("epoch", steps_per_epoch=steps)
            self._settings.fixed_every = steps

    def set_termination(self, termination: Termination | Sequence[int] | None) -> None:
        """Replace the termination model (e.g. re-estimated from a study, or from an
        ``EarlyStopping`` callback's state) and re-plan at the next observed step (unless it
        equals the current one).

        Raises:
            ConfigError: ``termination`` is not None, a Termination model or rung steps.
        """
        model = make_termination(termination)
        if model == self._settings.termination:
            return  # the same estimate: the plan stands
        with self._obs.lock:
            self._settings.termination = model
            self._plan.force_replan = True

    def plan_notice(self, save_at: int, why: str) -> None:
        """A preemption notice of a known end: the next save moves to ``save_at`` (the last
        step boundary before the deadline at which it fits) and is the last one; the plan is
        not remade after it. ``why``: the plan in words (the report's ``plan_method``)."""
        with self._obs.lock:
            self._plan.plan_notice(int(save_at), str(why))

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint after ``step``: O(1), never raises (False on odd input)."""
        try:
            k = int(step)
            if k == self._obs.last_true:
                return True
            n = self._settings.fixed_every
            if self._plan.notice is not None:
                n = None
            save = is_fixed_save(k, n) if n is not None else self._plan.take(k)
            if save:
                self._obs.mark_save(k)
            return save
        except Exception:
            return False

    def take_save(self, step: int) -> None:
        """A save taken at ``step`` outside the plan's answer (a preemption notice's): it
        stands for any planned save up to ``step``, so the plan moves past them, as
        :meth:`should_save` answering True would have moved it (a run resumed from that save
        does not take a planned step it passed as still due)."""
        k = int(step)
        if self._settings.fixed_every is None or self._plan.notice is not None:
            self._plan.take(k)
        self._obs.mark_save(k)

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
        self._obs.record_save(stall_s, persist_s, unobserved_stall_s)

    def record_restore(self, seconds: float, *, tier: str = "local") -> None:
        """Record a restore after a failure: one more failure, and its measured duration
        (``tier="remote"``: from the remote tier, the restart time of a lost node)."""
        self._obs.record_restore(seconds)
        self._recorded.append(("restore", seconds))
        if tier == "remote":
            with contextlib.suppress(TypeError, ValueError):
                self._uploads.remote_restore(float(seconds))
        self._plan.force_replan = True

    def forgive_restore(self) -> bool:
        """The last restore recorded resumed the save a preemption notice asked for, the run's
        planned stop, or a step the user chose to go back to: not a failure for the MTBF (its
        time stays a restart cost). Whether there was one to forgive."""
        for i in range(len(self._recorded) - 1, -1, -1):
            kind, seconds = self._recorded[i]
            if kind == "restore":
                self._recorded[i] = ("resume", seconds)
                self._obs.failures = max(0, self._obs.failures - 1)
                self._plan.force_replan = True
                return True
        return False

    def record_restart(self, seconds: float) -> None:
        """Record the whole restart after the last :meth:`record_restore` (from the process's
        start to its first training step): it replaces that restore's time as the restart
        cost ``R`` the plan uses."""
        self._obs.record_restart(seconds)
        self._recorded.append(("restart", seconds))
        self._plan.force_replan = True

    def record_upload(self, seconds: float) -> None:
        """Record an upload to the remote tier that took ``seconds`` and ended now (any
        thread): its cost to the loop is the excess of the steps it overlapped."""
        with contextlib.suppress(TypeError, ValueError):
            usual = self._obs.costs.get("step_time_s").value
            self._uploads.upload(float(seconds), usual)

    def two_level_plan(self) -> TwoLevelPlan | None:
        """The two-level plan for the measured costs (see
        :func:`~coci_core.planner.two_level.plan_two_levels`): a local save costs the
        planner's loop cost per save, an upload its measured slowdown of the loop, failures
        split by ``node_loss_share``. None before an upload was measured."""
        costs = self._tier_costs()
        return None if costs is None else plan_two_levels(costs)

    def _tier_costs(self) -> TierCosts | None:
        remote_cost = self._uploads.loop_cost_s()
        inputs = self._obs.plan_inputs()
        if remote_cost is None or inputs is None:
            return None
        rate = 1.0 / inputs["mtbf_s"]
        share = self._settings.node_loss_share
        return TierCosts(
            local_cost_s=max(inputs["stall_s"], 1e-6),
            remote_cost_s=remote_cost,
            local_restart_s=inputs["restart_s"],
            remote_restart_s=self._uploads.remote_restart_s(inputs["restart_s"]),
            crash_rate=rate * (1 - share),
            node_loss_rate=rate * share,
        )

    def upload_every(self) -> int:
        """Every how many checkpoints one should also be uploaded to the remote tier: the
        two-level plan's period for the measured costs, 1 until an upload was measured."""
        plan = self.two_level_plan()
        return 1 if plan is None else plan.upload_every

    # ------------------------------------------------------------------ planning

    def cost_source(self, name: str) -> str:
        """Where cost ``name`` comes from: ``"user"``, ``"measured"``, ``"default"`` or
        ``"unknown"`` (cheap)."""
        return self._obs.costs.get(name).source

    def overhead_inputs(
        self,
    ) -> tuple[Problem, tuple[int, ...], Callable[[], tuple[int, ...]] | None] | None:
        """The current plan's problem, its steps and a function planning it without the
        termination model (or None), so that its expected overhead against Daly
        (``schedule.compare_with_daly``) can be computed off the training thread."""
        if self._plan.problem is None:
            return None
        return self._plan.problem, tuple(self._plan.schedule), self._plan.plain_planner()

    @property
    def failures(self) -> int:
        """The failures this planner counts (each restore after one): with ``mtbf_s`` None,
        the MTBF is ``(time run + default_mtbf_s) / (failures + 1)``."""
        return self._obs.failures

    @property
    def replans(self) -> int:
        """How many plans have been made (cheap: tells telemetry when the plan changed)."""
        return self._plan.replans

    @property
    def schedule(self) -> tuple[int, ...]:
        """The planned checkpoint steps still ahead (for a fixed interval, the next 64,
        known from the start: no measurement is needed to plan them)."""
        return self._plan.ahead()

    # ------------------------------------------------------------------ reporting

    def explain(self, step: int) -> str:
        """Why ``step`` is (not) a checkpoint: the interval, the inputs and expected overhead
        (and, once an upload was measured, the remote tier's period and why)."""
        text = explain_step(self._plan, step)
        costs = self._tier_costs()
        if costs is None:
            return text
        two = plan_two_levels(costs)
        return text + (
            f"\n  remote tier: upload every {two.upload_every} checkpoint(s); an upload costs "
            f"the loop {costs.remote_cost_s:.3g} s against {costs.local_cost_s:.3g} s for a "
            f"local save, a restart from it {costs.remote_restart_s:.3g} s (two-level model, "
            f"node losses {self._settings.node_loss_share:.0%} of failures; overhead "
            f"{two.expected_overhead:.3g} s/s against {two.remote_every_save_overhead:.3g} "
            "uploading every checkpoint)"
        )

    def report(self, *, with_overhead: bool = True) -> PlannerReport:
        """A snapshot for telemetry.

        The plan-vs-Daly figures are computed on the first call after each plan and cached;
        on a horizon of thousands of checkpoints that takes seconds, so a caller on the
        training thread passes ``with_overhead=False`` and computes them elsewhere from
        :meth:`overhead_inputs`.
        """
        return build_report(self._plan, with_overhead=with_overhead)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state: estimates, losses, the plan and counters."""
        return {
            **planner_state(self._plan),
            "session": self._session,
            "recorded": self._base + len(self._recorded),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (the plan is re-fitted from the losses).

        The restores and restarts this planner recorded that the state does not hold (as
        after ``restore()`` then ``load_state_dict()`` of the checkpoint's state) are
        recorded again: the failure is counted and its restart time kept.

        A state saved under another policy (the policy changed between runs) restores the
        measurements (costs, losses, failures, time run) and plans afresh under this
        planner's policy.

        Raises:
            ConfigError: if the state is from another format version, or a field of it is
                not what this version writes (the planner is then left as it was).
        """
        why = check_planner_state(state)
        if why is not None:
            raise ConfigError(f"'state' cannot be loaded as a planner's state ({why[:300]})")
        load_planner_state(self._plan, state)
        count = 0
        with contextlib.suppress(TypeError, ValueError):
            count = int(state.get("recorded", 0))
        held = count - self._base if state.get("session") == self._session else 0
        missing = self._recorded[max(0, held) :]
        # the planner continues the state's run, its count now holding what was replayed
        self._session = str(state.get("session") or self._session)
        self._base = count + len(missing) - len(self._recorded)
        for kind, seconds in missing:
            if kind in ("restore", "resume"):
                self._obs.record_restore(seconds, failure=kind == "restore")
            else:
                self._obs.record_restart(seconds)
        if missing:
            self._plan.force_replan = True


def planner_config(options: Mapping[str, Any]) -> PlannerConfig:
    """Check a Planner's keyword arguments once (e.g. when an adapter is constructed, long
    before its run starts); :meth:`Planner.from_config` makes planners from the result.

    Raises:
        ConfigError: on an argument the Planner does not take, or a bad value, naming it.
    """
    try:
        bound = _SIGNATURE.bind(**options)
    except TypeError as e:
        raise ConfigError(
            f"the Planner takes none of these arguments: {sorted(set(options) - _ARGUMENTS)} "
            f"(it takes {', '.join(sorted(_ARGUMENTS))})"
        ) from e
    bound.apply_defaults()
    return _checked(bound.arguments)


def _checked(arguments: Mapping[str, Any]) -> PlannerConfig:
    settings = {k: v for k, v in arguments.items() if k not in _COST_ARGUMENTS}
    costs = {k: v for k, v in arguments.items() if k in _COST_ARGUMENTS}
    return PlannerConfig(settings=make_settings(**settings), costs=CostInputs.check(**costs))


_SIGNATURE = inspect.signature(Planner)
_ARGUMENTS = frozenset(_SIGNATURE.parameters)
_COST_ARGUMENTS = frozenset(inspect.signature(CostInputs.check).parameters)


def check_planner_state(state: Any) -> str | None:
    """Why a saved planner state (a checkpoint's, read as untrusted) cannot be loaded, or
    None: it is loaded into a scratch planner, under that planner's policy so that every
    field is read."""
    if not isinstance(state, dict):
        return f"not a dict: {type(state).__name__}"
    scratch = Planner()
    probe = {**state, "policy": scratch._plan.settings.policy_name}
    if not isinstance(state.get("policy"), str):
        probe["policy"] = state.get("policy")
    try:
        load_planner_state(scratch._plan, probe)
    except (
        ConfigError,
        TypeError,
        ValueError,
        KeyError,
        AttributeError,
        IndexError,
        OverflowError,
        RecursionError,
    ) as e:
        return f"{type(e).__name__}: {e}"
    return None
