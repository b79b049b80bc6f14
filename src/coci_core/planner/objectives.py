"""Planner objectives: what a plan minimises, one object per name, behind one registry.

An objective says how the value density (the progress a step makes toward convergence) weighs
each kind of overhead, and which figure of a
:class:`~coci_core.planner.optimize.CostBreakdown` it minimises. Users name one with a string
(``objective="time"``); :func:`make_objective` turns the name into its object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from coci_core.errors import ConfigError

if TYPE_CHECKING:
    from coci_core.planner.optimize import CostBreakdown

__all__ = [
    "OBJECTIVES",
    "ConvergenceObjective",
    "Objective",
    "ProgressObjective",
    "TimeObjective",
    "make_objective",
]


class Objective(ABC):
    """What a plan minimises.

    Attributes:
        name: the registry name users pass as ``objective``.
        lost_work_by_value: lost compute is weighted by the value density.
        stall_by_value: stalls and restarts are weighted by the value density too.
        early_profile_save: ``coci`` takes a save early, before any is measured, to measure the
            stall and persist, then re-plans (not under ``progress``, where an early stall is
            weighted by the high early value and costs more than it teaches).
        unplanned_profile_save: ``coci`` takes that early save only when the plan made with
            the assumed cost has no save before the horizon's end (otherwise the first planned
            save measures the cost, and an extra one would cost more than it teaches).
    """

    name: ClassVar[str]
    lost_work_by_value: ClassVar[bool] = False
    stall_by_value: ClassVar[bool] = False
    early_profile_save: ClassVar[bool] = False
    unplanned_profile_save: ClassVar[bool] = False

    @property
    def uses_value(self) -> bool:
        """Whether the value density (hence a fitted loss curve) changes the plan."""
        return self.lost_work_by_value or self.stall_by_value

    @abstractmethod
    def cost(self, breakdown: CostBreakdown) -> float:
        """The figure of ``breakdown`` this objective minimises."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TimeObjective(Objective):
    """Wall-clock overhead (``wall_s``): every step counts alike, as for Young and Daly."""

    name = "time"
    unplanned_profile_save = True

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.wall_s


class ConvergenceObjective(Objective):
    """Lost compute weighted by its value toward convergence, stall and restart unweighted
    (``convergence_s``)."""

    name = "convergence"
    lost_work_by_value = True
    early_profile_save = True

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.convergence_s


class ProgressObjective(Objective):
    """Everything weighted by value (``progress_s``): an early stall costs as much progress as
    early work."""

    name = "progress"
    lost_work_by_value = True
    stall_by_value = True

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.progress_s


#: The objectives by name. To add one: subclass :class:`Objective` above (its name, weights and
#: :meth:`~Objective.cost`), register an instance here, and add the name to
#: ``OBJECTIVE_NAMES`` in ``coci_core/commands/plan.py`` (the command line lists the names
#: without importing the planner; a test keeps the two equal).
OBJECTIVES: dict[str, Objective] = {
    o.name: o for o in (TimeObjective(), ConvergenceObjective(), ProgressObjective())
}


def make_objective(name: Any) -> Objective:
    """The objective named ``name``; unknown names raise ConfigError naming the allowed ones."""
    if not isinstance(name, str) or name not in OBJECTIVES:
        raise ConfigError(f"'objective' must be one of {', '.join(OBJECTIVES)}: {name!r}")
    return OBJECTIVES[name]
