"""The Planner's validated configuration: its arguments, the policy and a fixed interval.

One mutable :class:`PlannerSettings` is shared by the planner's parts, so that an attribute
set on the :class:`~coci_core.planner.Planner` (e.g. ``total_steps`` once an adapter knows it)
is seen by all of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from coci_core.errors import ConfigError
from coci_core.knobs import MAX_NODES, MAX_PLAN_STEP
from coci_core.planner.checks import check_int, check_optional_positive, check_positive
from coci_core.planner.costs import CostInputs
from coci_core.planner.fixed_interval import fixed_interval_of
from coci_core.planner.model import Termination, make_termination
from coci_core.planner.objectives import Objective, make_objective
from coci_core.planner.policies import (
    POLICIES,
    CheckFreq,
    Coci,
    Epoch,
    EveryNSeconds,
    EveryNSteps,
    SavePolicy,
    make_policy,
)

__all__ = ["PlannerConfig", "PlannerSettings", "make_settings", "policy_arguments"]


@dataclass(kw_only=True)
class PlannerSettings:
    """The validated arguments of a Planner (see its docstring), its policy and, for the
    ``every_n_steps`` and ``epoch`` policies, their fixed interval in steps."""

    policy_name: str
    objective: str
    total_steps: int | None
    mtbf_s: float | None
    default_mtbf_s: float
    nodes: int | Callable[[int], float]
    every_n_steps: int | None
    every_n_seconds: float | None
    start_step: int
    termination: Termination
    loss_breakpoints: tuple[int, ...]
    min_horizon_steps: int
    method: str
    policy: SavePolicy
    fixed_every: int | None
    node_loss_share: float = 0.5

    @property
    def goal(self) -> Objective:
        """The objective named by ``objective``."""
        return make_objective(self.objective)

    def cap_steps(self, step_time_s: float) -> int | None:
        """The longest interval (steps) that ``every_n_steps``/``every_n_seconds`` allow the
        ``coci``, ``daly`` and ``young`` policies, or None."""
        if self.policy_name not in _CAPPED:
            return None
        caps = []
        if self.every_n_steps is not None:
            caps.append(self.every_n_steps)
        if self.every_n_seconds is not None:
            caps.append(max(1, int(self.every_n_seconds / step_time_s)))
        return min(caps) if caps else None


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """A Planner's arguments, checked once (see :func:`~coci_core.planner.planner_config`);
    :meth:`~coci_core.planner.Planner.from_config` makes planners of it, each with its own
    copy of ``settings``."""

    settings: PlannerSettings
    costs: CostInputs

    def with_total_steps(self, total_steps: int | None) -> PlannerConfig:
        """The same arguments with another ``total_steps`` (checked against ``start_step``)."""
        start = self.settings.start_step
        if total_steps is not None:
            check_int("total_steps", total_steps, minimum=start + 1)
        settings = dataclasses.replace(self.settings, total_steps=total_steps)
        return dataclasses.replace(self, settings=settings)


def check_policy_name(policy: str) -> str:
    """``policy`` if it names a planner policy; else ConfigError."""
    if policy not in POLICIES:
        raise ConfigError(f"'policy' must be one of {', '.join(POLICIES)}: {policy!r}")
    return policy


def policy_arguments(policy: object) -> tuple[str, dict[str, Any]]:
    """A policy given by name (``"every_n_steps"``) or as a policy object of
    :mod:`coci_core.planner` (``EveryNSteps(every_n_steps=500)``, ``Daly()``, ...): its name,
    and the Planner arguments that the object carries (its interval).

    Raises:
        ConfigError: ``policy`` is neither.
    """
    if isinstance(policy, str):
        return check_policy_name(policy), {}
    name = getattr(policy, "name", None)
    if not isinstance(name, str) or not isinstance(policy, POLICIES.get(name, ())):  # type: ignore[arg-type]
        raise ConfigError(
            f"'policy' must be one of {', '.join(POLICIES)} or a policy object of "
            f"coci_core.planner (e.g. EveryNSteps(every_n_steps=500), Daly()): {policy!r}"
        )
    if isinstance(policy, EveryNSteps):
        return name, {"every_n_steps": policy.every_n_steps}
    if isinstance(policy, EveryNSeconds):
        return name, {"every_n_seconds": policy.every_n_seconds}
    if isinstance(policy, Epoch):
        return name, {"steps_per_epoch": policy.steps_per_epoch}
    if isinstance(policy, Coci):
        return name, {"method": policy.method}
    if isinstance(policy, CheckFreq):
        return name, {"checkfreq_overhead_bound": policy.overhead_bound}
    return name, {}


# the policies whose interval every_n_steps/every_n_seconds cap (PlannerSettings.cap_steps)
_CAPPED = ("coci", "daly", "young")


def make_settings(
    *,
    policy: str | SavePolicy,
    objective: str,
    total_steps: int | None,
    mtbf_s: float | None,
    nodes: int | Callable[[int], float],
    default_mtbf_s: float,
    termination: Termination | Sequence[int] | None,
    every_n_steps: int | None,
    every_n_seconds: float | None,
    steps_per_epoch: int | None,
    checkfreq_overhead_bound: float,
    start_step: int,
    loss_breakpoints: Sequence[int],
    method: str,
    grid_points: int,
    min_horizon_steps: int,
    node_loss_share: float = 0.5,
) -> PlannerSettings:
    """Check the Planner's arguments (in the order of its signature) and make its policy.

    Raises:
        ConfigError: on any bad argument, naming it, the rule and the value.
    """
    policy_object = None if isinstance(policy, str) else policy
    policy, carried = policy_arguments(policy)
    bound = checkfreq_overhead_bound
    given = {
        "every_n_steps": every_n_steps,
        "every_n_seconds": every_n_seconds,
        "steps_per_epoch": steps_per_epoch,
        "method": None if method == "dp" else method,
        # the default stands for "not given" (as "dp" for method)
        "checkfreq_overhead_bound": None if bound == CheckFreq.overhead_bound else bound,
    }
    for name, value in carried.items():
        if given[name] is not None and given[name] != value:
            raise ConfigError(
                f"'{name}' is given twice, {given[name]!r} and {value!r} in the policy object "
                f"{policy_object!r}: give it once"
            )
    every_n_steps = carried.get("every_n_steps", every_n_steps)
    every_n_seconds = carried.get("every_n_seconds", every_n_seconds)
    steps_per_epoch = carried.get("steps_per_epoch", steps_per_epoch)
    method = carried.get("method", method)
    checkfreq_overhead_bound = carried.get("checkfreq_overhead_bound", checkfreq_overhead_bound)
    for name, value in (("every_n_steps", every_n_steps), ("every_n_seconds", every_n_seconds)):
        if value is not None and policy not in (*_CAPPED, name):
            raise ConfigError(
                f"'{name}' is the interval of policy {name!r} (and a cap on the interval of "
                f"{', '.join(map(repr, _CAPPED))}); policy {policy!r} does not use it: "
                f"{value!r:.100}"
            )
    checked_objective = make_objective(objective).name
    total = (
        None
        if total_steps is None
        else check_int("total_steps", total_steps, minimum=1, maximum=MAX_PLAN_STEP)
    )
    checked_mtbf = check_optional_positive("mtbf_s", mtbf_s)
    checked_default_mtbf = check_positive("default_mtbf_s", default_mtbf_s)
    if not callable(nodes):
        check_int("nodes", nodes, minimum=1, maximum=MAX_NODES)
    every_steps = (
        None if every_n_steps is None else check_int("every_n_steps", every_n_steps, minimum=1)
    )
    every_seconds = check_optional_positive("every_n_seconds", every_n_seconds)
    if steps_per_epoch is not None:  # else refused only once the epoch policy is made
        check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    start = check_int("start_step", start_step, minimum=0, maximum=MAX_PLAN_STEP)
    if total is not None and total <= start:
        raise ConfigError(f"'total_steps' must be > start_step: {total_steps!r}")
    checked_termination = make_termination(termination)
    if isinstance(loss_breakpoints, (str, bytes)) or not isinstance(loss_breakpoints, Iterable):
        raise ConfigError(f"'loss_breakpoints' must be a list of steps: {loss_breakpoints!r:.100}")
    breakpoints = tuple(check_int("loss_breakpoints", b, minimum=0) for b in loss_breakpoints)
    min_horizon = check_int("min_horizon_steps", min_horizon_steps, minimum=1)
    if (
        type(node_loss_share) not in (int, float)
        or not math.isfinite(node_loss_share)
        or not 0 <= node_loss_share <= 1
    ):
        raise ConfigError(f"'node_loss_share' must be a number in [0, 1]: {node_loss_share!r}")
    options: dict[str, Any] = {}
    if policy == "every_n_steps":
        if every_steps is None:
            raise ConfigError("'every_n_steps' must be given for policy 'every_n_steps': None")
        options["every_n_steps"] = every_steps
    elif policy == "every_n_seconds":
        if every_seconds is None:
            raise ConfigError("'every_n_seconds' must be given for policy 'every_n_seconds': None")
        options["every_n_seconds"] = every_seconds
    elif policy == "epoch":
        if steps_per_epoch is None:
            raise ConfigError("'steps_per_epoch' must be given for policy 'epoch': None")
        options["steps_per_epoch"] = steps_per_epoch
    elif policy == "checkfreq":
        options["overhead_bound"] = checkfreq_overhead_bound
    elif policy == "coci":
        options["method"] = method
        options["grid_points"] = grid_points
    return PlannerSettings(
        policy_name=policy,
        objective=checked_objective,
        total_steps=total,
        mtbf_s=checked_mtbf,
        default_mtbf_s=checked_default_mtbf,
        nodes=nodes,
        every_n_steps=every_steps,
        every_n_seconds=every_seconds,
        start_step=start,
        termination=checked_termination,
        loss_breakpoints=breakpoints,
        min_horizon_steps=min_horizon,
        method=method,
        policy=policy_object if policy_object is not None else make_policy(policy, **options),
        fixed_every=fixed_interval_of(policy, options),
        node_loss_share=float(node_loss_share),
    )
