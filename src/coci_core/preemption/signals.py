"""Notices by signal: SIGTERM and a grace period before SIGKILL (Kubernetes, torchelastic,
SLURM's KillWait), or a signal a set time before the end (SLURM ``--signal=USR1@90``)."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

from coci_core.errors import ConfigError
from coci_core.preemption.notice import Notice, NoticeBoard, NoticeSource, check_lead_s

__all__ = ["SIGNALS", "SignalNotice"]

#: The signals a notice may come by.
SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


class SignalNotice(NoticeSource):
    """A notice by signal ``signame``, ``lead_s`` seconds before the process is killed.

    SIGUSR1 and SIGUSR2 announce the end (SLURM's ``--signal=USR1@90``): training goes on
    until the last step at which the save still fits (see :class:`Notice`'s ``known_end``).
    SIGTERM and SIGINT ask the process to stop: the next step boundary saves and stops.

    The handler records the notice and nothing else. A Python handler that was installed
    before (Lightning's, a user's) is called after it; the default action (ending the
    process) is not: the loop stops at its next step boundary instead. :meth:`stop` puts the
    previous handler back. Handlers can only be installed from the main thread; elsewhere
    :meth:`start` returns False and the signal keeps its handler.
    """

    def __init__(self, signame: str = "SIGTERM", lead_s: float = 30.0) -> None:
        signame = signame.upper()
        if not signame.startswith("SIG"):
            signame = "SIG" + signame
        if signame not in SIGNALS:
            raise ConfigError(
                f"the preemption signal must be one of {', '.join(SIGNALS)}: {signame!r}"
            )
        self.name = signame
        self.signum = signal.Signals[signame]
        self.lead_s = check_lead_s(lead_s, signame)
        self._previous: Any = None
        self._installed = False
        self._handler: Any = None
        self.received = False  # this signal came (set in the handler)

    def __repr__(self) -> str:
        return f"SignalNotice({self.name!r}, lead_s={self.lead_s:g})"

    def start(self, board: NoticeBoard) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(self.signum)
        chained = previous if callable(previous) else None
        name, lead = self.name, self.lead_s
        known_end = name in ("SIGUSR1", "SIGUSR2")

        def handler(signum: int, frame: FrameType | None) -> None:
            self.received = True
            now = time.monotonic()
            board.post(Notice(name, now, now + lead, f"{name} received", known_end))
            if chained is not None:
                chained(signum, frame)

        signal.signal(self.signum, handler)
        self._previous = previous
        self._handler = handler
        self._installed = True
        return True

    def stop(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            # a handler installed after this one (the user's) stays
            if signal.getsignal(self.signum) is self._handler:
                signal.signal(
                    self.signum, self._previous if self._previous is not None else signal.SIG_DFL
                )
            self._installed = False

    def unanswered(self) -> bool:
        """Whether this signal asked the process to stop, and without coci the default action
        would have ended it (no Python handler was installed before coci's: one that was has
        been called already, and what it did stands)."""
        return (
            self.received
            and self.name in ("SIGTERM", "SIGINT")
            and self._previous in (None, signal.SIG_DFL)
        )
