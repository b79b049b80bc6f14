"""Events that every save and restore reports, and the listeners that receive them."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeAlias

from coci_core.knobs import TELEMETRY_PROGRESS_EVERY_S
from coci_core.storage.local import open_own_file
from coci_core.telemetry.records import MAX_STEP, parse_records, read_records

__all__ = [
    "PROGRESS_FILE",
    "RUN_ID_CHARS",
    "TELEMETRY_FILE",
    "Event",
    "JsonlRecords",
    "JsonlTelemetry",
    "Listener",
    "RestoreEvent",
    "SaveEvent",
    "TelemetrySink",
    "RestartEvent",
    "UploadEvent",
    "emit",
    "new_run_id",
    "parse_jsonl",
    "read_jsonl",
]

logger = logging.getLogger(__name__)

#: The JSON-lines file the adapters write beside their checkpoints, read by ``coci report``.
TELEMETRY_FILE = "telemetry.jsonl"

#: Beside it, the step the run last reached, rewritten in place at every step: a run killed
#: between two progress records still tells the restart how far it got (the work it lost).
PROGRESS_FILE = "telemetry.progress"

SaveOutcome = Literal["committed", "skipped", "failed"]


@dataclass(frozen=True, kw_only=True)
class SaveEvent:
    """What one save did.

    Attributes:
        step: the training step saved.
        outcome: ``"committed"`` (durable), ``"skipped"`` (a previous persist was still running
            and ``on_busy="skip"``, or another reason in ``error``, as from
            :meth:`CheckpointManager.skip`) or ``"failed"`` (see ``error``; nothing was
            published).
        stall_s: time the training loop was held: the ``save`` call, including any wait for the
            previous persist, plus the wait in ``before_update`` when ``block=False``.
        update_wait_s: the part of ``stall_s`` spent waiting in ``before_update``.
        copy_s: time spent copying the state into host buffers.
        persist_s: time from the end of the copy to the commit (checksums, writes, fsync, rename).
        time_to_durable_s: time from the ``save`` call to the commit.
        bytes_written: bytes of data and manifest written (by this rank).
        raw_bytes: the bytes in memory of what this rank wrote (``raw_bytes / bytes_written``
            is the compression ratio).
        first_save: the host buffers were allocated by this save (not reused).
        path: where the checkpoint was published.
        compressed: some piece was stored encoded (compression on, and it paid).
    """

    step: int
    outcome: SaveOutcome
    stall_s: float = 0.0
    update_wait_s: float = 0.0
    copy_s: float = 0.0
    persist_s: float = 0.0
    time_to_durable_s: float = 0.0
    bytes_written: int = 0
    raw_bytes: int = 0
    first_save: bool = False
    block: bool = True
    path: str = ""
    error: str | None = None
    compressed: bool = False


@dataclass(frozen=True, kw_only=True)
class RestoreEvent:
    """What one restore did; ``skipped_steps`` were newer but damaged and passed over;
    ``rank_state_restored`` is False when the checkpoint had per-rank state but none for the
    restoring rank (it was written by fewer ranks); ``tier`` is ``"remote"`` when a manager
    with a remote tier restored from it. Of ``seconds``: ``read_s`` reading the pieces,
    ``verify_s`` checking their checksums, ``decode_s`` decoding compressed ones, and
    ``load_s`` loading the state into the caller's objects (``restore(into=...)``)."""

    step: int
    seconds: float
    bytes_read: int
    skipped_steps: tuple[int, ...] = ()
    rank_state_restored: bool = True
    tier: Literal["local", "remote"] = "local"
    read_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0
    load_s: float = 0.0


UploadOutcome = Literal["committed", "failed", "superseded"]


@dataclass(frozen=True, kw_only=True)
class UploadEvent:
    """What one attempt to copy a committed step to the remote tier did.

    Attributes:
        step: the step uploaded.
        outcome: ``"committed"`` (durable on the remote), ``"failed"`` (retried later, see
            ``error``) or ``"superseded"`` (the local step is gone: a newer one is uploaded).
        attempt: 1 for the first try of this step, then 2, 3, ...
        seconds: the attempt's duration.
        bytes_uploaded: bytes sent (0 for a step already on the remote).
        error: what failed (never credentials: the storage's own message).
    """

    step: int
    outcome: UploadOutcome
    attempt: int = 1
    seconds: float = 0.0
    bytes_uploaded: int = 0
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class RestartEvent:
    """A resumed run reached its first training step: what the restart cost.

    Attributes:
        step: the step resumed from (the first step trained again is the next one).
        seconds: from ``since`` to the end of the first training step after the restore.
        restore_s: of which the restore itself (reading, verifying, loading the state).
        since: ``"process start"`` (the process's start time, read from the OS), or
            ``"adapter start"`` where the OS does not say.
        tier: the tier the checkpoint came from.
    """

    step: int
    seconds: float
    restore_s: float
    since: Literal["process start", "adapter start"] = "process start"
    tier: Literal["local", "remote"] = "local"


Event: TypeAlias = SaveEvent | RestoreEvent | UploadEvent | RestartEvent
Listener: TypeAlias = Callable[[Event], None]


def emit(listeners: list[Listener], event: Event) -> None:
    """Give ``event`` to every listener; a failing listener is logged, never raised."""
    for listener in list(listeners):
        try:
            listener(event)
        except Exception:
            logger.exception("coci telemetry listener %r failed on %r", listener, event)


class TelemetrySink(Protocol):
    """Where an adapter's telemetry goes (TensorBoard, a JSON-lines file, ...).

    Called as (rank 0): ``sink(event)`` for each save (from the writer thread) and restore;
    ``record_plan(step, report)`` when the plan changes; ``record_loss(step, loss, fitted)``;
    ``flush()``; ``close()``.
    """

    def __call__(self, event: Event) -> None: ...

    def record_plan(self, step: int, report: Any) -> None: ...

    def record_loss(self, step: int, loss: float, fitted: float | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


#: Held while a sink makes its own run lock (held while it chooses its run: an object store's
#: sink lists its store then, which must not hold up the other sinks of the process).
_RUN_LOCK = threading.Lock()


def _finite_or_none(x: Any) -> Any:
    """``x`` with every non-finite float (at any depth) replaced by None, for strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x


class JsonlRecords:
    """A sink that turns events, plans and losses into the JSON-lines records ``coci report``
    reads (each with ``time``, the wall-clock time it was written, in seconds since the
    epoch); a subclass stores each line (``_write_line``) and implements ``flush`` and
    ``close`` (which calls :meth:`record_end` first).

    Besides the events: ``progress`` records (the run reached a step; at most one every
    ``TELEMETRY_PROGRESS_EVERY_S``, whatever the calls), an ``end`` record when the sink is
    closed (the session's last step; ``failed`` when training ended on an error), and on a
    restore the step the previous session reached when the sink knows it (``reached``: then
    the lost work is exact). A session that starts without a restore after a session that did
    not end (killed before its first checkpoint) first writes a ``start`` record: step 0, and
    the step the previous session ``reached``.

    Every record carries ``run_id``: the run it belongs to. A session that goes on with the
    run (its first record is a restore, or the ``start`` over after a failed session) keeps
    the previous session's (:attr:`previous_run_id`); any other starts a new run, so that
    ``coci report`` tells apart two runs written one after the other into one directory."""

    #: the newest step this session reached (None before its first step)
    reached: int | None = None
    #: the step the previous session reached, read when the sink opened (None: unknown)
    previous_reached: int | None = None
    #: the previous session was closed (it ended at ``previous_reached``)
    previous_ended: bool = False
    _progress_at: float = -math.inf
    _ended: bool = False
    _began: bool = False  # this session wrote a record
    #: the run this session's records belong to (None until its first record or step)
    run_id: str | None = None

    def _write_line(self, line: str, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def previous_run_id(self) -> str | None:
        """The run the previous session's records belong to (None: unknown, or none)."""
        return None

    def _run_of(self, kind: str | None) -> str:
        """This session's run, chosen at its first record (of type ``kind``) or step (None):
        the previous session's when this one restores, or starts over after it failed."""
        if self.run_id is None:
            with _RUN_LOCK:
                lock: threading.Lock = self.__dict__.setdefault("_run_lock", threading.Lock())
            with lock:  # the writer thread's first record and the loop's first step
                if self.run_id is None:
                    goes_on = kind == "restore" or (
                        self.previous_reached and not self.previous_ended
                    )
                    self.run_id = (self.previous_run_id() if goes_on else None) or new_run_id()
        return self.run_id

    def _write(self, record: dict[str, Any]) -> None:
        if not self._began:
            self._began = True
            self._run_of(record.get("type"))
            if (
                record.get("type") != "restore"
                and self.previous_reached
                and not self.previous_ended
            ):
                # the previous session failed and this one starts without a checkpoint to
                # restore: it starts over from step 0, the steps it reached lost
                self._write({"type": "start", "step": 0, "reached": self.previous_reached})
        record["run_id"] = self._run_of(record.get("type"))
        record["time"] = round(time.time(), 3)
        self._write_line(json.dumps(record, default=str, allow_nan=False), record)

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __call__(self, event: Event) -> None:
        kind = {
            SaveEvent: "save",
            UploadEvent: "upload",
            RestoreEvent: "restore",
            RestartEvent: "restart",
        }[type(event)]
        fields = {k: _finite_or_none(v) for k, v in asdict(event).items()}
        starts = isinstance(event, RestoreEvent) and self.reached is None
        if starts:
            # the session starts with this restore: the previous one got this far
            fields["reached"] = self.previous_reached
        self._write({"type": kind, **fields})
        if starts:  # a session killed before its first step lost nothing more
            self._reach(event.step)

    def record_plan(self, step: int, report: Any) -> None:
        overhead = getattr(report, "expected_overhead", None)
        self._write(
            {
                "type": "plan",
                "step": int(step),
                "policy": report.policy,
                "objective": report.objective,
                "next_steps": [int(s) for s in report.next_steps],
                "interval_steps": report.interval_steps,
                "mtbf_s": _finite_or_none(report.mtbf_s),
                "mtbf_source": report.mtbf_source,
                "costs": {k: _finite_or_none(v) for k, v in report.costs.items()},
                "cost_sources": dict(report.cost_sources),
                "expected_overhead": None
                if overhead is None
                else {k: _finite_or_none(v) for k, v in asdict(overhead).items()},
                # why the plan is what it is, for the TensorBoard tab (a reader of older
                # records finds these missing)
                "horizon_end_step": getattr(report, "horizon_end_step", None),
                "rolling": getattr(report, "rolling", None),
                "plan_method": getattr(report, "plan_method", None),
                "termination": getattr(report, "termination", None),
            }
        )

    def record_progress(self, step: int) -> None:
        """The run reached ``step``; call it at every step. A ``progress`` record is written
        at most every ``TELEMETRY_PROGRESS_EVERY_S`` (it tells how far a killed run got,
        hence the work its restart lost)."""
        step = int(step)
        self.reached = step
        self._reach(step)
        now = time.monotonic()
        if now - self._progress_at >= TELEMETRY_PROGRESS_EVERY_S:
            self._progress_at = now
            self._write({"type": "progress", "step": step})

    def _reach(self, step: int, *, ended: bool = False) -> None:
        """Keep ``step`` as the step reached (``ended``: where the session ended) where a
        killed process leaves it (cheap: called at every step); nothing by default."""

    @property
    def previous_end(self) -> int | None:
        """The step the previous session ended at when it was closed there (so a restore of
        that step continues the run: no failure), else None."""
        return self.previous_reached if self.previous_ended else None

    def record_end(self, *, failed: bool = False) -> None:
        """The session ends (the sink is closed; ``failed``: on an error): an ``end`` record
        with its last step, once, when it trained at least one step."""
        if self._ended or self.reached is None:
            return
        self._ended = True
        self._write({"type": "end", "step": self.reached, "failed": failed})
        self._reach(self.reached, ended=not failed)

    def record_preemption(
        self,
        step: int,
        *,
        source: str,
        time_left_s: float,
        save: bool,
        needed_s: float | None,
        margin_s: float,
        reason: str,
        saved: int | None,
        save_s: float | None,
        noticed_at: int | None = None,
        noticed_left_s: float | None = None,
        noticed_source: str | None = None,
        pending: bool = False,
    ) -> None:
        """A preemption notice: the step of the decision (where the ranks learned of it, or
        where its save was moved to before a known end), its source, the seconds left then,
        the decision (``save``, the save's measured time ``needed_s``, the ``margin_s`` kept,
        the ``reason`` in words) and what came of it: the step ``saved`` (None: none) and the
        time that save took to be durable; ``noticed_at``, ``noticed_left_s`` and
        ``noticed_source``: the step at which the ranks learned of it, the seconds left then
        and that notice's source (``source`` is the one in force at ``step``). ``pending``:
        written at the decision, before the save (its outcome's record replaces it; alone, it
        tells of a process that ended first)."""
        self._write(
            {
                "type": "preemption",
                "step": int(step),
                "source": str(source),
                "time_left_s": _finite_or_none(float(time_left_s)),
                "save": bool(save),
                "needed_s": None if needed_s is None else _finite_or_none(float(needed_s)),
                "margin_s": _finite_or_none(float(margin_s)),
                "reason": str(reason),
                "saved": None if saved is None else int(saved),
                "save_s": None if save_s is None else _finite_or_none(float(save_s)),
                "noticed_at": int(step) if noticed_at is None else int(noticed_at),
                "noticed_left_s": _finite_or_none(
                    float(time_left_s if noticed_left_s is None else noticed_left_s)
                ),
                "noticed_source": str(source if noticed_source is None else noticed_source),
                **({"pending": True} if pending else {}),
            }
        )

    def record_loss(self, step: int, loss: float, fitted: float | None = None) -> None:
        self._write(
            {
                "type": "loss",
                "step": int(step),
                "loss": _finite_or_none(float(loss)),
                "fitted": None if fitted is None else _finite_or_none(float(fitted)),
            }
        )


class JsonlTelemetry(JsonlRecords):
    """Appends telemetry as JSON lines to one file, for ``coci report``; thread-safe.

    Also a :class:`~coci_core.CheckpointManager` listener: ``CheckpointManager(directory,
    listeners=[JsonlTelemetry(f"{directory}/telemetry.jsonl")])`` records its saves and
    restores; calling :meth:`record_progress` at each step adds how far the run got (the
    work a restart lost). Each line is written whole at once (nothing is buffered), so an
    unclosed one loses nothing; :meth:`close` (or a ``with`` block) records the end."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd = open_own_file(self.path, os.O_WRONLY | os.O_APPEND)
        # the step reached, rewritten in place: one small write per step, no growth
        progress = self.path.with_name(PROGRESS_FILE)
        try:
            self._progress_fd = open_own_file(progress, os.O_RDWR)
        except BaseException:
            os.close(self._fd)
            raise
        try:
            # One process writes a directory's telemetry at a time. A POSIX record lock: it
            # goes with the process (killed or not), is not inherited by forked children
            # (data loader workers), and a second sink of the same process is not refused.
            fcntl.lockf(self._progress_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            held = e.errno in (errno.EACCES, errno.EAGAIN)
            if not held:
                logger.warning("coci: cannot lock %s (%s); recording anyway", progress, e)
        else:
            held = False
        if held:
            # A second process on a directory another one is writing to (a second job, refused
            # the directory at its first save): its records would read as the first's (its
            # start as a restart of the first, its progress over the first's); it writes none.
            logger.warning(
                "coci: another process is recording telemetry in %s: this one records none "
                "there (give each run its own directory)",
                self.path.parent,
            )
            for fd in (self._fd, self._progress_fd):
                os.close(fd)
            self._fd = self._progress_fd = -1
            return
        self.previous_reached, self.previous_ended, self._previous_run = _read_reached(
            self._progress_fd
        )

    _previous_run: str | None = None  # the run the progress file names

    def previous_run_id(self) -> str | None:
        return self._previous_run

    def __enter__(self) -> JsonlTelemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reach(self, step: int, *, ended: bool = False) -> None:
        with self._lock:
            if self._progress_fd >= 0:  # fixed width: each write replaces the last whole
                run = self._run_of(None).encode("ascii")
                line = b"%20d %-3s %s\n" % (step, b"end" if ended else b"", run)
                os.pwrite(self._progress_fd, line, 0)

    def _write_line(self, line: str, record: dict[str, Any]) -> None:
        data = memoryview((line + "\n").encode("utf-8"))
        with self._lock:
            while self._fd >= 0 and data:
                data = data[os.write(self._fd, data) :]

    def flush(self) -> None:
        """Nothing to do: each line is written as it comes."""

    def close(self) -> None:
        self.record_end()
        with self._lock:
            for fd in (self._fd, self._progress_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._progress_fd = -1


#: A run id: what :func:`new_run_id` makes (and readers check records' ``run_id`` against).
RUN_ID_CHARS = 16


def new_run_id() -> str:
    """A new run's id: 16 random hex digits."""
    return uuid.uuid4().hex[:RUN_ID_CHARS]


def _read_reached(fd: int) -> tuple[int | None, bool, str | None]:
    """The step a progress file holds (None: empty, unreadable, or a step no run reaches),
    whether its session ended there, and its run (None: not written, as by a version before
    run ids, or forged)."""
    try:
        fields = os.pread(fd, 64, 0).decode("ascii").split()
        step = int(fields[0])
    except (OSError, ValueError, UnicodeDecodeError, IndexError):
        return None, False, None
    if not 0 <= step <= MAX_STEP:  # forged: a record carrying it would be skipped by readers
        return None, False, None
    run = fields[-1] if len(fields) > 1 else ""
    known = len(run) == RUN_ID_CHARS and all(c in "0123456789abcdef" for c in run)
    return step, fields[1:2] == ["end"], run if known else None


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """The records of telemetry text that can be used (a torn line from a killed run, or any
    line :func:`~coci_core.telemetry.records.parse_records` skips, is left out)."""
    return parse_records(text)[0]


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a telemetry file that can be used (see :func:`parse_jsonl`)."""
    return read_records(path)[0]
