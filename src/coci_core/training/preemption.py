"""Acting on preemption notices: every rank learns of any rank's notice at the next step
boundary (one collective: the minimum of the ranks' time left), rank 0 decides whether a save
fits the time left (from the measured time a save takes to be durable, less a safety margin)
and tells every rank, so that all save the same step, or none; then the loop stops.

Between "fits" and "cannot fit" (the last few saves' slowest would not fit, their fastest would)
the save is tried when a cut-short save costs nothing: the commit is atomic, so the previous
checkpoint stays the newest, and no upload to a remote tier waits for the time it takes. A save
that cannot fit even at the pace of the fastest of the last few, after the save still being
written, is never started.

A notice of a known end (a signal a set time before the end, a cloud notice with a time) far
enough ahead for more steps does not stop training at once: the save is planned at the last
step boundary before the deadline at which it still fits (from the median of the last few
steps' times), checked again at every boundary (moved earlier when steps slow down, taken at once
when a rank is asked to stop now), and the loop stops after it.

The notices themselves come from :mod:`coci_core.preemption`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

from coci_core.errors import CociError
from coci_core.knobs import NOTICE_PLAN_RESAY, NOTICE_PLAN_RESERVE
from coci_core.preemption import NoticeBoard, NoticeSource, Preemption
from coci_core.preemption.signals import SignalNotice, launcher_warnings

__all__ = [
    "NoticePlan",
    "PreemptionDecision",
    "SaveTimes",
    "PreemptionWatch",
    "fit_save",
    "min_over_ranks",
    "plan_changed",
    "plan_save_step",
]

logger = logging.getLogger(__name__)

#: how many of the last steps' times a notice's plan takes the longest of
STEP_TIMES_KEPT = 8
#: how many steps after a notice's plan their pace is checked against it
PACE_MIN_STEPS = 4
#: how much sooner an end must come than the plan's for the plan to be made again at once
#: (another source's notice; less is the ranks' skew at a step boundary)
END_MOVED_S = 1.0


@dataclasses.dataclass(frozen=True)
class SaveTimes:
    """What a notice's save will take, as measured.

    Attributes:
        longest_s: the longest of the last few saves' time to durable (None: none measured).
        fastest_s: the fastest of them (None: none measured).
        wait_s: until the save still being written is durable (estimated; 0: none is).
        try_uncertain: a save that may not fit is tried (cut short, it costs nothing: the
            commit is atomic and no upload to a remote tier waits for the time).
    """

    longest_s: float | None
    fastest_s: float | None
    wait_s: float = 0.0
    try_uncertain: bool = True


@dataclasses.dataclass(frozen=True)
class PreemptionDecision:
    """What the ranks agreed on at a notice.

    Attributes:
        step: the step boundary at which the save is taken (or not): where the ranks learned
            of the notice, or, for a notice of a known end, the last step boundary before it
            at which the save still fits (see ``noticed_at``).
        source: the notice's source (``"another rank"`` on a rank that got none).
        time_left_s: seconds until the earliest deadline of any rank, at ``step``.
        save: whether ``step`` is saved (the save fits the time left).
        needed_s: the save's measured time to durable (None: none measured yet).
        margin_s: the reserve kept before the deadline.
        reason: the decision in words, for the log.
        deadline: this process's ``time.monotonic()`` at the deadline.
        noticed_after_s: seconds from the notice's arrival (on this rank) to ``step``.
        noticed_at: the step boundary at which every rank learned of the notice (``step``,
            unless the save was moved later).
        noticed_left_s: seconds until the deadline at ``noticed_at``.
        noticed_source: the source of the notice the ranks learned of at ``noticed_at``
            (``source`` names the one in force at ``step``: a SIGTERM after a notice of a
            known end, say).
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
    noticed_at: int | None = None
    noticed_left_s: float | None = None
    noticed_source: str | None = None

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def moved(self) -> bool:
        """Whether the save was moved from the notice's step to a later one."""
        return self.noticed_at is not None and self.noticed_at != self.step


@dataclasses.dataclass(frozen=True)
class NoticePlan:
    """A notice of a known end, far enough ahead for more steps: training goes on and the
    save is planned at ``save_at``, the last step boundary before the deadline at which it
    still fits (the same on every rank).

    Attributes:
        noticed_at: the step boundary at which every rank learned of the notice.
        source: the notice's source (``"another rank"`` on a rank that got none).
        save_at: the step the save is planned at.
        time_left_s: seconds until the deadline when the plan was made.
        step_s: the time a step was planned with (the median of the last few, or the pace
            since an earlier plan when slower).
        needed_s: the save's measured time to durable.
        reason: the plan in words.
        noticed_left_s: seconds until the deadline at ``noticed_at`` (kept when the plan is
            made again later; None: ``time_left_s``).
    """

    noticed_at: int
    source: str
    save_at: int
    time_left_s: float
    step_s: float
    needed_s: float
    reason: str
    noticed_left_s: float | None = None


def fit_save(
    time_left_s: float,
    needed_s: float | None,
    margin_s: float,
    *,
    fastest_s: float | None = None,
    wait_s: float = 0.0,
    try_uncertain: bool = False,
) -> tuple[bool, str]:
    """Whether a save that takes ``needed_s`` (the slowest of the last few; None: not
    measured), after ``wait_s`` for a save still being written, fits ``time_left_s`` with
    ``margin_s`` to spare, and why. An unmeasured save is tried when time beyond the margin is
    left: its commit is atomic, so one cut short leaves the previous checkpoint the newest.
    With ``try_uncertain``, an unmeasured save is tried when any time is left, and a measured
    one that fits at the pace of the fastest (``fastest_s``) of the last few, without the
    margin."""
    usable = time_left_s - margin_s
    behind = f" after {wait_s:.2f} s for the save being written" if wait_s > 0 else ""
    if needed_s is None:
        if usable > 0 or (try_uncertain and time_left_s - wait_s > 0):
            return True, "the save's time is not measured yet: tried"
        return False, f"{time_left_s:.1f} s left, within the {margin_s:g} s margin: not started"
    if wait_s + needed_s <= usable:
        return True, (
            f"the save takes {needed_s:.2f} s{behind}, {time_left_s:.1f} s left "
            f"({margin_s:g} s margin): it fits"
        )
    fastest = needed_s if fastest_s is None else min(fastest_s, needed_s)
    if try_uncertain and wait_s + fastest <= time_left_s:
        return True, (
            f"the save takes {fastest:.2f} to {needed_s:.2f} s{behind}, {time_left_s:.1f} s "
            "left: it may not finish; tried (if the kill cuts it short, the previous checkpoint "
            "stays the newest)"
        )
    return False, (
        f"the save takes {needed_s:.2f} s{behind}, only {time_left_s:.1f} s left "
        f"({margin_s:g} s margin): not started, the newest checkpoint stays the previous one"
    )


def plan_save_step(
    step: int, time_left_s: float, step_s: float | None, needed_s: float | None, margin_s: float
) -> int:
    """The last step boundary (``step`` or later) at which a save that takes ``needed_s``
    still fits before a deadline ``time_left_s`` away, ``margin_s`` kept and a reserve of
    :data:`~coci_core.knobs.NOTICE_PLAN_RESERVE` of ``needed_s`` besides, when a step takes
    ``step_s``. ``step`` itself when either time is unknown (nothing to plan with)."""
    if step_s is None or needed_s is None or not step_s > 0:
        return step
    spare = time_left_s - needed_s * (1 + NOTICE_PLAN_RESERVE) - margin_s
    steps = spare // step_s if spare > 0 else 0.0
    if not 0 < steps < 2**62:  # none, or beyond any run's length (a deadline that far: now)
        return step
    return step + int(steps)


def plan_changed(said: NoticePlan | None, plan: NoticePlan, step: int) -> bool:
    """Whether ``plan``, made at ``step``, changes what the user was last told (``said``,
    None: nothing yet): the notice of another source is in force (an earlier end), or the
    save comes sooner by more than :data:`~coci_core.knobs.NOTICE_PLAN_RESAY` of the steps
    that ``said`` left ahead of ``step``. A plan made again a few steps earlier because the
    steps' pace was measured again is not news (it moves again and again, by a little)."""
    if said is None or said.source != plan.source:
        return True
    ahead = said.save_at - step
    if ahead <= 0:
        return True
    return said.save_at - plan.save_at > NOTICE_PLAN_RESAY * ahead


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
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        except RuntimeError as e:  # gloo's "Connection closed by peer" and the like
            raise CociError(
                "the ranks could not compare preemption notices at this step boundary: "
                "another rank has most likely exited or been killed (see its error; a "
                f"launcher such as torchrun restarts the job) ({type(e).__name__}: "
                f"{str(e)[:200]})"
            ) from e
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
        #: the save planned before a known end, while training goes on to it
        self.plan: NoticePlan | None = None
        self._boundary: float | None = None  # time.monotonic() at the last step boundary
        self._step_times: list[float] = []  # the last few steps' times, boundary to boundary
        self._plan_from: tuple[int, float] | None = None  # rank 0: the plan's step and time
        self._plan_end: float | None = None  # rank 0: the end the plan was made for

    def start(self) -> list[NoticeSource]:
        """Start the sources; the ones that started (a signal handler needs the main
        thread)."""
        for source in self.config.make_sources():
            if source.start(self.board):
                self.sources.append(source)
            else:
                logger.info("coci: %r not watched (not on the main thread)", source)
        if self.rank == 0:
            for line in launcher_warnings(self.sources):
                warnings.warn(line, UserWarning, stacklevel=2)
        return list(self.sources)

    def stop(self) -> list[signal.Signals]:
        """Stop the sources (signal handlers put back); the signals that asked the process to
        stop and that no step boundary acted on (they came after the last one), for the
        caller to act on (see ``Checkpointer.close``)."""
        sources, self.sources = self.sources, []
        unanswered: list[signal.Signals] = []
        for source in sources:
            try:
                source.stop()
            except Exception:
                logger.exception("coci: stopping %r failed", source)
            if self.decision is None and isinstance(source, SignalNotice) and source.unanswered():
                unanswered.append(source.signum)
        return unanswered

    def _go_on_left(self, now: float) -> float:
        """Seconds this rank's notices let training go on: until the earliest known end, 0
        once a notice asks to stop now (SIGTERM), infinite without a notice."""
        notices = self.board.all()
        if not notices:
            return math.inf
        return min(n.time_left(now) if n.known_end else 0.0 for n in notices)

    def _pace(self, step: int, now: float) -> float | None:
        """The mean time of the steps since the plan was made (None: fewer than
        ``PACE_MIN_STEPS``, too few to tell a slower pace from one slow step)."""
        if self._plan_from is None or step - self._plan_from[0] < PACE_MIN_STEPS:
            return None
        return (now - self._plan_from[1]) / (step - self._plan_from[0])

    def _planned_step(
        self, step: int, now: float, usable_s: float, needed_s: float | None
    ) -> int | None:
        """The plan's step while it still holds: the steps left to it, at the pace of the
        steps since it was made (once there are ``PACE_MIN_STEPS``), leave time for the save
        (None: no plan, or it no longer holds)."""
        plan = self.plan
        if plan is None or needed_s is None:
            return None
        pace = self._pace(step, now)
        ahead = plan.save_at - step
        # right after the plan, one step's time says little: the plan holds while the save
        # fits (the margin covers a slow step)
        steps_s = 0.0 if pace is None else ahead * pace
        if ahead > 0 and steps_s + needed_s + self.config.margin_s <= usable_s:
            return plan.save_at
        return None

    def check(
        self, step: int, needed_s: Callable[[], float | SaveTimes | None]
    ) -> PreemptionDecision | NoticePlan | None:
        """At a step boundary, on every rank: None while no rank has a notice; a
        :class:`NoticePlan` while training goes on to a save planned before a known end; then
        the decision (the same on every rank; made once)."""
        if self.decision is not None:
            return self.decision
        now = time.monotonic()
        if self._boundary is not None:
            self._step_times = [*self._step_times[1 - STEP_TIMES_KEPT :], now - self._boundary]
        self._boundary = now
        notice = self.board.first()
        left = notice.time_left(now) if notice is not None else math.inf
        if self.min_over_ranks is not None:
            left = self.min_over_ranks(left)
        if math.isinf(left):
            return None
        own_go_on = go_on = self._go_on_left(now)
        if self.min_over_ranks is not None:  # every rank got the notice at the same boundary
            go_on = self.min_over_ranks(go_on)
        source = notice.source if notice is not None else "another rank"
        if go_on <= 0:  # a rank was asked to stop now (SIGTERM): that notice is in force
            stop = [n for n in self.board.all() if not n.known_end]
            source = stop[0].source if stop and own_go_on <= 0 else source
            source = "another rank" if own_go_on > 0 else source
        margin = self.config.margin_s
        payload: dict[str, Any] | None = None
        if self.rank == 0:
            measured = needed_s()
            times = (
                measured
                if isinstance(measured, SaveTimes)
                else SaveTimes(measured, measured, try_uncertain=False)
            )
            needed = times.longest_s
            # a step's time: the median of the last few (one that waited for a save is not
            # the pace), or the pace since the plan when that was slower
            step_s = statistics.median(self._step_times) if self._step_times else None
            usable = min(left, go_on)
            # a notice of an earlier end (another source) makes the plan again at once
            sooner = self._plan_end is not None and now + usable < self._plan_end - END_MOVED_S
            target = None if sooner else self._planned_step(step, now, usable, needed)
            if target is None:  # no plan, an earlier end, or steps too slow for the plan
                self._plan_end = now + usable
                pace = self._pace(step, now)
                if step_s is not None and pace is not None:
                    step_s = max(step_s, pace)
                target = plan_save_step(step, usable, step_s, needed, margin)
                if self.plan is not None:  # the plan moves earlier, never later
                    target = min(target, self.plan.save_at)
                self._plan_from = (step, now)
            if target > step:
                payload = {"save_at": target, "step_s": step_s, "needed_s": needed}
            else:
                save, reason = fit_save(
                    left,
                    times.longest_s,
                    margin,
                    fastest_s=times.fastest_s,
                    wait_s=times.wait_s,
                    try_uncertain=times.try_uncertain,
                )
                payload = {"save": save, "reason": reason, "needed_s": needed}
        if self.broadcast is not None:
            payload = self.broadcast(payload)
        assert payload is not None
        plan = self.plan
        if "save_at" in payload:
            target, step_s, needed = payload["save_at"], payload["step_s"], payload["needed_s"]
            if plan is None or plan.save_at != target:
                # the notice in force: this one, or another source's with an earlier end
                noticed_at, noticed_left_s = (
                    (step, left)
                    if plan is None or plan.source != source
                    else (plan.noticed_at, plan.noticed_left_s)
                )
                self.plan = NoticePlan(
                    noticed_at=noticed_at,
                    noticed_left_s=noticed_left_s,
                    source=source,
                    save_at=int(target),
                    time_left_s=left,
                    step_s=float(step_s),
                    needed_s=float(needed),
                    reason=(
                        f"{left:.1f} s left at step {step}: the save moves to step {target}, the "
                        f"last step before the deadline at which it fits (a step takes "
                        f"{step_s:.3g} s, the save {needed:.2f} s, {margin:g} s margin)"
                    ),
                )
            return self.plan
        self.decision = PreemptionDecision(
            step=step,
            source=source,
            time_left_s=left,
            save=bool(payload["save"]),
            needed_s=payload["needed_s"],
            margin_s=margin,
            reason=str(payload["reason"]),
            deadline=now + left,
            noticed_after_s=now - notice.received if notice is not None else 0.0,
            noticed_at=plan.noticed_at if plan is not None else step,
            noticed_left_s=plan.noticed_left_s if plan is not None else left,
            noticed_source=plan.source if plan is not None else source,
        )
        return self.decision
