"""Every rank takes the same save decisions, with a broadcast only at a few known steps.

Rank 0's planner decides. The other ranks cannot see its re-plans, so all ranks meet at *sync
steps* that every rank can compute on its own: the next step of the last shared schedule and the
powers of two (so that a first or changed plan is picked up while the run is young). At a sync
step rank 0 broadcasts its decision and its schedule ahead; between sync steps no rank saves and
nothing is communicated. A re-plan therefore takes effect at the next sync step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coci_core.knobs import SCHEDULE_SENT
from coci_core.planner import Planner

__all__ = ["SharedDecision"]


def _next_power_of_two(step: int) -> int:
    return 1 << max(0, step).bit_length()


class SharedDecision:
    """Wraps a planner's ``should_save`` so that every rank answers the same.

    Args:
        planner: this rank's planner (only rank 0's decides).
        rank: this process's global rank.
        broadcast: sends rank 0's object to every rank and returns it (a collective: every rank
            calls it at the same steps). None for a single process.
    """

    def __init__(
        self, planner: Planner, *, rank: int, broadcast: Callable[[Any], Any] | None
    ) -> None:
        self.planner = planner
        self.rank = rank
        self.broadcast = broadcast
        self._next_sync = 0
        self.syncs = 0

    def should_save(self, step: int) -> bool:
        """Whether to save after ``step``; identical on every rank."""
        if self.broadcast is None:
            return self.planner.should_save(step)
        if step < self._next_sync:
            return False
        payload = None
        if self.rank == 0:
            payload = {
                "save": self.planner.should_save(step),
                "schedule": [int(s) for s in self.planner.schedule[:SCHEDULE_SENT]],
            }
        payload = self.broadcast(payload)
        self.syncs += 1
        upcoming = [s for s in payload["schedule"] if s > step]
        self._next_sync = min([*upcoming[:1], _next_power_of_two(step)])
        return bool(payload["save"])
