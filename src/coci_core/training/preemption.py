"""Acting on preemption notices: every rank learns of any rank's notice at the next step
boundary (one collective: the minimum of the ranks' time left), rank 0 decides whether a save
fits the time left (from the measured time a save takes to be durable, less a safety margin)
and tells every rank, so that all save the same step, or none; then the loop stops.

The notices themselves come from :mod:`coci_core.preemption`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from coci_core.preemption import NoticeBoard, NoticeSource, Preemption

__all__ = ["PreemptionDecision", "PreemptionWatch", "fit_save", "min_over_ranks"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreemptionDecision:
    """What the ranks agreed on at a notice.

    Attributes:
        step: the step boundary at which every rank learned of it.
        source: the notice's source (``"another rank"`` on a rank that got none).
        time_left_s: seconds until the earliest deadline of any rank, at ``step``.
        save: whether ``step`` is saved (the save fits the time left).
        needed_s: the save's measured time to durable (None: none measured yet).
        margin_s: the reserve kept before the deadline.
        reason: the decision in words, for the log.
        deadline: this process's ``time.monotonic()`` at the deadline.
        noticed_after_s: seconds from the notice's arrival (on this rank) to ``step``.
    """

    step: int
    source: str
    time_left_s: float
    save: bool
    needed_s: float | None
    margin_s: float
    reason: str
    deadline: float
    noticed_after_s: float = 0.0

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def fit_save(time_left_s: float, needed_s: float | None, margin_s: float) -> tuple[bool, str]:
    """Whether a save that takes ``needed_s`` (None: not measured) fits ``time_left_s`` with
    ``margin_s`` to spare, and why. An unmeasured save is tried when any time is left: its
    commit is atomic, so one cut short leaves the previous checkpoint the newest."""
    usable = time_left_s - margin_s
    if needed_s is None:
        if usable > 0:
            return True, f"{time_left_s:.1f} s left; the save's time is not measured yet: tried"
        return False, f"{time_left_s:.1f} s left, within the {margin_s:g} s margin: not started"
    if needed_s <= usable:
        return True, (
            f"the save takes {needed_s:.2f} s, {time_left_s:.1f} s left "
            f"({margin_s:g} s margin): it fits"
        )
    return False, (
        f"the save takes {needed_s:.2f} s, only {time_left_s:.1f} s left "
        f"({margin_s:g} s margin): not started, the newest checkpoint stays the previous one"
    )


def min_over_ranks() -> Callable[[float], float]:
    """A collective over torch.distributed's default group: the minimum of a number over
    all ranks. Gloo carries it (a group of its own when the default backend is another,
    made now: every rank must call this at the same point), so that it never waits for a
    device."""
    import torch
    import torch.distributed as dist

    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def reduce(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return float(t.item())

    return reduce


class PreemptionWatch:
    """The notice sources of one process and the ranks' agreement on a notice.

    Args:
        config: the checked ``preemption`` option.
        rank: this process's global rank (rank 0 decides whether the save fits).
        min_over_ranks: the collective that gives every rank the minimum of a number over
            the ranks (called at every step boundary); None for one process.
        broadcast: sends rank 0's object to every rank; None for one process.
    """

    def __init__(
        self,
        config: Preemption,
        *,
        rank: int = 0,
        min_over_ranks: Callable[[float], float] | None = None,
        broadcast: Callable[[Any], Any] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.min_over_ranks = min_over_ranks
        self.broadcast = broadcast
        self.board = NoticeBoard()
        self.sources: list[NoticeSource] = []
        self.decision: PreemptionDecision | None = None

    def start(self) -> list[NoticeSource]:
        """Start the sources; the ones that started (a signal handler needs the main
        thread)."""
        for source in self.config.make_sources():
            if source.start(self.board):
                self.sources.append(source)
            else:
                logger.info("coci: %r not watched (not on the main thread)", source)
        return list(self.sources)

    def stop(self) -> None:
        """Stop the sources (signal handlers put back)."""
        sources, self.sources = self.sources, []
        for source in sources:
            try:
                source.stop()
            except Exception:
                logger.exception("coci: stopping %r failed", source)

    def check(self, step: int, needed_s: Callable[[], float | None]) -> PreemptionDecision | None:
        """At a step boundary, on every rank: the decision once any rank has a notice (the
        same on every rank; made once), else None."""
        if self.decision is not None:
            return self.decision
        notice = self.board.first()
        now = time.monotonic()
        left = notice.time_left(now) if notice is not None else math.inf
        if self.min_over_ranks is not None:
            left = self.min_over_ranks(left)
        if math.isinf(left):
            return None
        payload: dict[str, Any] | None = None
        if self.rank == 0:
            needed = needed_s()
            save, reason = fit_save(left, needed, self.config.margin_s)
            payload = {"save": save, "reason": reason, "needed_s": needed}
        if self.broadcast is not None:
            payload = self.broadcast(payload)
        assert payload is not None
        self.decision = PreemptionDecision(
            step=step,
            source=notice.source if notice is not None else "another rank",
            time_left_s=left,
            save=bool(payload["save"]),
            needed_s=payload["needed_s"],
            margin_s=self.config.margin_s,
            reason=str(payload["reason"]),
            deadline=now + left,
            noticed_after_s=now - notice.received if notice is not None else 0.0,
        )
        return self.decision
