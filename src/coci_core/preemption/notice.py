"""A preemption notice, the board that records notices, and the base class of their sources.

A source posts a :class:`Notice` on a :class:`NoticeBoard`; the training loop reads the board
at its step boundaries. A signal handler may post: posting only appends to a list (no lock, no
I/O), so a handler that interrupts the loop while it reads the board cannot deadlock it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from coci_core.errors import ConfigError
from coci_core.knobs import MAX_LEAD_S

__all__ = ["Notice", "NoticeBoard", "NoticeSource", "check_lead_s"]


def check_lead_s(lead_s: object, what: str) -> float:
    """``lead_s`` as seconds, or a ConfigError naming ``what`` unless it is a number in
    (0, MAX_LEAD_S] (``inf`` would never stop training; 1e308 overflows a deadline)."""
    if (
        isinstance(lead_s, bool)
        or not isinstance(lead_s, int | float)
        or not 0 < lead_s <= MAX_LEAD_S
    ):
        raise ConfigError(
            f"the lead time of {what} must be a number of seconds in (0, {MAX_LEAD_S}] "
            f"(a day at most): {lead_s!r}"
        )
    return float(lead_s)


@dataclasses.dataclass(frozen=True)
class Notice:
    """The machine (or this process) will be stopped.

    Attributes:
        source: what told it (``"SIGTERM"``, ``"SIGUSR1"``, ``"aws"``, ``"gce"``, ``"azure"``).
        received: when it was received (``time.monotonic()``).
        deadline: when the process will be killed (``time.monotonic()``).
        detail: what the source said, for the log.
        known_end: the deadline is the announced end of the machine (a signal a set time
            before the end, a cloud notice with a time), so training may go on until the
            last save that fits; False for a request to stop now within a grace period
            (SIGTERM), whose deadline only bounds the time a save may take.
    """

    source: str
    received: float
    deadline: float
    detail: str = ""
    known_end: bool = False

    def time_left(self, now: float | None = None) -> float:
        """Seconds until the deadline (negative once past)."""
        return self.deadline - (time.monotonic() if now is None else now)


class NoticeBoard:
    """The notices received so far (by any source, from any thread or signal handler)."""

    def __init__(self) -> None:
        self._notices: list[Notice] = []
        self._posted = threading.Event()  # set by threads only (see post_from_thread)

    def post(self, notice: Notice) -> None:
        """Record ``notice``; safe in a signal handler (one list append)."""
        self._notices.append(notice)

    def post_from_thread(self, notice: Notice) -> None:
        """Record ``notice`` from a thread, waking :meth:`wait` (never from a signal handler:
        setting an event takes a lock)."""
        self._notices.append(notice)
        self._posted.set()

    def first(self) -> Notice | None:
        """The notice with the earliest deadline, or None."""
        notices = list(self._notices)
        return min(notices, key=lambda n: n.deadline) if notices else None

    def all(self) -> list[Notice]:
        """Every notice received so far."""
        return list(self._notices)

    def wait(self, timeout_s: float) -> Notice | None:
        """Wait up to ``timeout_s`` for a notice posted by a thread; the earliest one."""
        self._posted.wait(timeout_s)
        return self.first()

    def clear(self) -> None:
        self._notices.clear()
        self._posted.clear()


class NoticeSource:
    """Something that tells of a coming preemption: :meth:`start` it with a board to post on,
    :meth:`stop` it at the end. ``name`` names it in options and logs."""

    name: str = "source"

    def start(self, board: NoticeBoard) -> bool:
        """Begin posting notices on ``board``; False when this source cannot run here."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop (idempotent); a signal's previous handler is put back."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
