"""Notices by signal: SIGTERM and a grace period before SIGKILL (Kubernetes, torchelastic,
SLURM's KillWait), or a signal a set time before the end (SLURM ``--signal=USR1@90``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from coci_core.errors import ConfigError
from coci_core.preemption.notice import Notice, NoticeBoard, NoticeSource, check_lead_s

__all__ = ["SIGNALS", "SignalNotice", "agent_options", "launcher_warnings"]

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


#: torchelastic's agent (``torchrun``, ``accelerate launch``) handles these unless told others
_AGENT_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
_AGENT_SHUTDOWN_S = 30.0


def agent_options() -> tuple[bool, bool]:
    """Whether this torch's torchelastic launcher can be told which signals to handle
    (``--signals-to-handle``, torch 2.9) and how long to wait before it SIGKILLs its workers
    (``--shutdown-timeout``, a later torch): an earlier one handles SIGTERM, SIGINT, SIGHUP and
    SIGQUIT only, and waits 30 s, whatever the environment says."""
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:
        return False, False
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    return "signals_to_handle" in names, "shutdown_timeout" in names


def launcher_warnings(
    sources: Sequence[Any],
    environ: Mapping[str, str] | None = None,
    options: tuple[bool, bool] | None = None,
) -> list[str]:
    """What stands between a signal of a known end (SIGUSR1/SIGUSR2) and its save when this
    process is a worker of torchelastic's agent (``torchrun``, ``accelerate launch``): SLURM's
    ``--signal=USR1@90`` reaches every process of the job step, the agent included. An agent
    that does not handle the signal is ended by its default action, and its workers fail with
    it (the agent hosts their store), before any save; one that handles it forwards it and
    SIGKILLs the workers after its shutdown timeout (30 s unless given), which may come before
    the end the signal announces. One line per such signal, saying what to set (what this
    torch's launcher takes: ``options``, as :func:`agent_options` gives them)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return []
    watched = [
        s for s in sources if isinstance(s, SignalNotice) and s.name in ("SIGUSR1", "SIGUSR2")
    ]
    if not watched:
        return []
    can_handle, can_wait = agent_options() if options is None else options
    handled = {
        s.strip().upper()
        for s in env.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _AGENT_DEFAULT_SIGNALS).split(",")
    }
    lines = []
    for source in watched:
        name, lead = source.name, source.lead_s
        if not can_handle or name not in handled:
            start = (
                f"coci: preemption={name[3:]}@{lead:g} under torchrun/accelerate launch, whose "
                f"agent does not handle {name}: a {name} sent to every process of the job (as "
                f"SLURM's --signal={name[3:]}@{lead:g} does) ends the agent, and the workers "
                "fail with it before any save. "
            )
            if not can_handle:
                lines.append(
                    start + "This torch's agent cannot be told to handle it (torch 2.9 and "
                    "later take --signals-to-handle): send the signal to the workers alone"
                )
                continue
            wait = (
                f" and TORCH_ELASTIC_SHUTDOWN_TIMEOUT={lead:g}"
                if can_wait
                else f" (this torch's agent then SIGKILLs the workers {_AGENT_SHUTDOWN_S:g} s "
                "after it forwards the signal, whatever it is told)"
            )
            lines.append(
                start + f"Launch with PET_SIGNALS_TO_HANDLE={_AGENT_DEFAULT_SIGNALS},{name}"
                f"{wait} set (torchrun: --signals-to-handle"
                + (", --shutdown-timeout" if can_wait else "")
                + "), or send the signal to the workers alone"
            )
            continue
        given = [env.get(k) for k in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")]
        try:
            timeout = next(float(v) for v in given if v) if can_wait else _AGENT_SHUTDOWN_S
        except (StopIteration, ValueError):
            timeout = _AGENT_SHUTDOWN_S
        if timeout < lead:
            told = (
                f"Set TORCH_ELASTIC_SHUTDOWN_TIMEOUT={lead:g} (torchrun: --shutdown-timeout "
                f"{lead:g}; ignore this if you gave it so)"
                if can_wait
                else "This torch's agent cannot be told to wait longer (a later torch takes "
                f"--shutdown-timeout): ask for the signal at most {timeout:g} s before the end"
            )
            lines.append(
                f"coci: preemption={name[3:]}@{lead:g} under torchrun/accelerate launch: its "
                f"agent forwards {name} and SIGKILLs the workers {timeout:g} s later (its "
                f"shutdown timeout), before the end {lead:g} s after the signal that coci plans "
                f"the save for. {told}"
            )
    return lines
