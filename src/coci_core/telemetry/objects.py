"""Telemetry in an object store: one JSON-lines object per writer session, put whole.

An object store cannot append, so a run whose checkpoint directory is a URL keeps its records
in memory and puts them, whole, as ``<dir>/telemetry/<session>.jsonl`` from a background
thread: soon after each committed save, else within ``TELEMETRY_PUT_DELAY_S`` of a new record,
never more often than every ``TELEMETRY_PUT_GAP_S``, and a last time on ``close()``. A failed
put is logged as a warning and tried again later; it never reaches the training loop.
Session names start with their UTC start time, so sorting them orders the sessions.
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from coci_core.errors import StorageError
from coci_core.knobs import TELEMETRY_CLOSE_TIMEOUT_S, TELEMETRY_PUT_DELAY_S, TELEMETRY_PUT_GAP_S
from coci_core.storage import Storage, is_url, open_storage
from coci_core.telemetry.events import TELEMETRY_FILE, JsonlRecords, JsonlTelemetry
from coci_core.telemetry.records import parse_records

__all__ = [
    "TELEMETRY_DIR",
    "ObjectTelemetry",
    "read_object_records",
    "read_objects",
    "report_sink",
]

logger = logging.getLogger(__name__)

#: The folder, under a URL checkpoint directory, of the sessions' telemetry objects.
TELEMETRY_DIR = "telemetry"


def _session_name() -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y%m%dT%H%M%S%fZ}-{uuid.uuid4().hex[:8]}"


class ObjectTelemetry(JsonlRecords):
    """A telemetry sink (and manager listener) that writes ``coci report``'s records to
    ``<url>/telemetry/<session>.jsonl``; thread-safe.

    Args:
        url: the checkpoint directory (an fsspec URL, or a :class:`Storage`).
        storage_options: the file system's options (credentials: never logged nor written).
        session: the object's name without ``.jsonl`` (default: UTC start time and a random
            suffix).
        gap_s: the least time between two puts.
        delay_s: the longest a record waits for a put when no save commits; the wait before
            a failed put is tried again.
    """

    def __init__(
        self,
        url: str | Storage,
        storage_options: dict[str, Any] | None = None,
        *,
        session: str | None = None,
        gap_s: float = TELEMETRY_PUT_GAP_S,
        delay_s: float = TELEMETRY_PUT_DELAY_S,
    ) -> None:
        self.storage = open_storage(url, **(storage_options or {}))
        self.path = f"{TELEMETRY_DIR}/{session or _session_name()}.jsonl"
        self.gap_s = gap_s
        self.delay_s = delay_s
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._put_count = 0  # lines in the store
        self._pending_since: float | None = None  # when the oldest line not in the store came
        self._soon = False  # a save committed (or flush() asked): put as soon as the gap allows
        self._retry_at = -math.inf
        self._last_put = -math.inf
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the first record

    def __repr__(self) -> str:
        return f"ObjectTelemetry({self.storage.url!r}, path={self.path!r})"

    def previous_run_id(self) -> str | None:
        """The run of the newest other session's object (read once, at this session's first
        record, only when it restores: never raises, a failed read is a new run)."""
        try:
            names = sorted(
                n
                for n in self.storage.list_dir(TELEMETRY_DIR)
                if n.endswith(".jsonl") and f"{TELEMETRY_DIR}/{n}" != self.path
            )
            if not names:
                return None
            records, _ = parse_records(self.storage.read_bytes(f"{TELEMETRY_DIR}/{names[-1]}"))
        except Exception as e:  # telemetry never fails the run
            logger.warning("coci: could not read the previous session's telemetry: %s", e)
            return None
        return next((r["run_id"] for r in reversed(records) if r.get("run_id")), None)

    def _write_line(self, line: str, record: dict[str, Any]) -> None:
        with self._cond:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="coci-telemetry-put", daemon=True
                )
                self._thread.start()
            if self._pending_since is None:
                self._pending_since = time.monotonic()
            self._lines.append(line)
            if record.get("type") == "save" and record.get("outcome") == "committed":
                self._soon = True
            self._cond.notify_all()

    def _due(self) -> float:
        """When the pending lines are put (call under the lock, with lines pending)."""
        start = self._last_put + self.gap_s
        if not self._soon:
            assert self._pending_since is not None
            start = max(start, self._pending_since + self.delay_s)
        return max(start, self._retry_at)

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._closed:
                    break
                if len(self._lines) == self._put_count:
                    self._cond.wait()
                    continue
                now, due = time.monotonic(), self._due()
                if now < due:
                    self._cond.wait(due - now)
                    continue
                self._put_locked()
            if len(self._lines) > self._put_count:
                self._put_locked()  # the last put, on close (tried whatever the backoff)

    def _put_locked(self) -> None:
        """Put every line so far, releasing the lock meanwhile (never raises)."""
        lines = self._lines[:]
        count = len(lines)
        self._soon = False
        self._cond.release()
        try:
            data = "".join(line + "\n" for line in lines).encode("utf-8")
            self.storage.write_file(self.path, [memoryview(data)])
            error: Exception | None = None
        except Exception as e:  # a telemetry put never fails the run
            error = e
        finally:
            self._cond.acquire()
        now = time.monotonic()
        if error is not None:
            self._retry_at = now + self.delay_s
            logger.warning(
                "coci: could not write the telemetry %s/%s (%s): %s",
                self.storage.url,
                self.path,
                "its last records are lost"
                if self._closed
                else f"tried again within {self.delay_s:.0f} s and on close",
                error,
            )
        else:
            self._put_count = count
            self._last_put = now
            self._retry_at = -math.inf
            self._pending_since = now if len(self._lines) > count else None
        self._cond.notify_all()

    @property
    def unsaved(self) -> int:
        """The records not in the store yet."""
        with self._cond:
            return len(self._lines) - self._put_count

    def flush(self, timeout_s: float = TELEMETRY_CLOSE_TIMEOUT_S) -> None:
        """Put the records so far now (on the background thread) and wait for that put, at
        most ``timeout_s``. Never raises: a failed put is logged, ``unsaved`` stays > 0."""
        with self._cond:
            target = len(self._lines)
            if self._put_count >= target or self._closed:
                return
            # Due now: no gap, no backoff.
            self._soon, self._last_put, self._retry_at = True, -math.inf, -math.inf
            self._cond.notify_all()
            deadline = time.monotonic() + timeout_s
            while self._put_count < target and self._retry_at == -math.inf:  # until done or failed
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def close(self) -> None:
        """Put the records a last time and stop the background thread (waits at most
        ``TELEMETRY_CLOSE_TIMEOUT_S``)."""
        self.record_end()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return
        thread.join(TELEMETRY_CLOSE_TIMEOUT_S)
        if thread.is_alive():
            logger.warning(
                "coci: the last put of the telemetry %s/%s did not finish within %.0f s",
                self.storage.url,
                self.path,
                TELEMETRY_CLOSE_TIMEOUT_S,
            )


def read_objects(storage: Storage) -> list[dict[str, Any]] | None:
    """The records of every session's telemetry object under ``storage``, sessions in the
    order they started; None when there is none."""
    read = read_object_records(storage)
    return None if read is None else read[0]


def read_object_records(storage: Storage) -> tuple[list[dict[str, Any]], int] | None:
    """:func:`read_objects`, and how many lines were skipped (see
    :func:`~coci_core.telemetry.records.parse_records`); None when there is none."""
    names = sorted(n for n in storage.list_dir(TELEMETRY_DIR) if n.endswith(".jsonl"))
    if not names:
        return None
    records: list[dict[str, Any]] = []
    skipped = 0
    for name in names:
        got, bad = parse_records(storage.read_bytes(f"{TELEMETRY_DIR}/{name}"))
        records.extend(got)
        skipped += bad
    return records, skipped


def report_sink(dirpath: Path | str, storage_options: dict[str, Any] | None = None) -> JsonlRecords:
    """The sink of ``coci report``'s records for a checkpoint directory: ``telemetry.jsonl``
    in a local one, an :class:`ObjectTelemetry` under an fsspec URL."""
    if is_url(dirpath):
        return ObjectTelemetry(dirpath, storage_options)
    try:
        return JsonlTelemetry(Path(dirpath) / TELEMETRY_FILE)
    except OSError as e:  # the adapters' first write there: say which directory, and why
        why = f"{e.strerror}: {e.filename!r}" if e.strerror and e.filename else str(e)
        raise StorageError.wrap(
            f"cannot write in the checkpoint directory {str(dirpath)!r} (dirpath): {why}", e
        ) from e
