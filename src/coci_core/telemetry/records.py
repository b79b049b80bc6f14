"""Reading telemetry records back: each line of a telemetry file is one JSON record, checked
field by field before ``coci report`` and the TensorBoard tab use it.

Telemetry is written by long jobs that get killed, copied and edited: a line that is not JSON
(torn by a kill, not UTF-8, nested too deep to parse), a record that is not an object, a known
record without its ``step``, or a field the readers use that holds the wrong kind of value (a
string among ``next_steps``, a NaN or 1e400 time, a negative duration or size, a list as a
cost) is skipped and counted,
never raised; the rest is shown. Fields the readers do not use are not checked (a newer
version's records read as far as they can).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_RUN_ID_CHARS",
    "MAX_STEP",
    "check_record",
    "parse_records",
    "read_records",
    "skipped_line",
    "split_runs",
]

#: Steps above this are not a training step's (and would not fit a signed 64-bit integer).
MAX_STEP = 2**63 - 1
#: Numbers above this (in magnitude) cannot be a time, a size or a cost telemetry wrote.
_MAX_NUMBER = 1e300

_Check = Callable[[Any], bool]


def _step(x: Any) -> bool:
    return type(x) is int and 0 <= x <= MAX_STEP


#: A run id longer than this was not written by coci (it writes 16 hex digits).
MAX_RUN_ID_CHARS = 64


def _run_id(x: Any) -> bool:
    """The run a record belongs to (None: written before records carried one)."""
    return x is None or (type(x) is str and 0 < len(x) <= MAX_RUN_ID_CHARS)


def _number(x: Any) -> bool:
    """A finite number (None: unknown, which telemetry writes for a non-finite one)."""
    if x is None:
        return True
    if type(x) is int:
        return abs(x) <= _MAX_NUMBER
    return type(x) is float and math.isfinite(x) and abs(x) <= _MAX_NUMBER


#: A time telemetry measured (a save's stall, a restore) is at least 0 and at most this
#: (about 31 years): a larger or negative one was not measured by coci.
_MAX_SECONDS = 1e9
_MAX_BYTES = 2**63


def _seconds(x: Any) -> bool:
    """A duration coci measured: a number in [0, _MAX_SECONDS] (or None)."""
    return x is None or (_number(x) and 0 <= x <= _MAX_SECONDS)


def _size(x: Any) -> bool:
    """A number of bytes: a number in [0, 2**63] (or None)."""
    return x is None or (_number(x) and 0 <= x <= _MAX_BYTES)


def _opt(kind: type) -> _Check:
    return lambda x: x is None or type(x) is kind


def _steps(x: Any) -> bool:
    return x is None or (type(x) is list and all(_step(s) for s in x))


def _opt_step(x: Any) -> bool:
    return x is None or _step(x)


def _numbers(x: Any) -> bool:
    return x is None or (type(x) is dict and all(_number(v) for v in x.values()))


def _mapping(x: Any) -> bool:
    return x is None or type(x) is dict


def _overhead(x: Any) -> bool:
    """A plan's expected overhead: the figures the readers use are numbers, its objective a
    string (the breakdowns inside are not read)."""
    if x is None:
        return True
    if type(x) is not dict or not _opt(str)(x.get("objective")):
        return False
    return all(_number(v) for k, v in x.items() if k.endswith("_s"))


_STR, _BOOL = _opt(str), _opt(bool)
_TIMES = ("stall_s", "update_wait_s", "copy_s", "persist_s", "time_to_durable_s")
_PARTS = ("read_s", "verify_s", "decode_s", "load_s")

#: Per record type: the fields the readers use and what each must hold (absent is None).
#: Each of these types needs a ``step``.
SCHEMA: dict[str, dict[str, _Check]] = {
    "save": {
        "outcome": _STR,
        "error": _STR,
        "path": _STR,
        "compressed": _BOOL,
        "first_save": _BOOL,
        "block": _BOOL,
        "bytes_written": _size,
        "raw_bytes": _size,
        **dict.fromkeys(_TIMES, _seconds),
    },
    "restore": {
        "seconds": _seconds,
        "bytes_read": _size,
        "skipped_steps": _steps,
        "rank_state_restored": _BOOL,
        "tier": _STR,
        "reached": _opt_step,
        **dict.fromkeys(_PARTS, _seconds),
    },
    "upload": {
        "outcome": _STR,
        "attempt": _opt_step,
        "seconds": _seconds,
        "bytes_uploaded": _size,
        "error": _STR,
    },
    "start": {"reached": _opt_step},
    "restart": {"seconds": _seconds, "restore_s": _seconds, "since": _STR, "tier": _STR},
    "plan": {
        "policy": _STR,
        "objective": _STR,
        "next_steps": _steps,
        "interval_steps": _opt_step,
        "mtbf_s": _number,
        "mtbf_source": _STR,
        "costs": _numbers,
        "cost_sources": _mapping,
        "expected_overhead": _overhead,
        "horizon_end_step": _opt_step,
        "rolling": _BOOL,
        "plan_method": _STR,
        "termination": _STR,
    },
    "loss": {"loss": _number, "fitted": _number},
    "preemption": {
        "source": _STR,
        "time_left_s": _number,
        "save": _BOOL,
        "needed_s": _seconds,
        "margin_s": _number,
        "reason": _STR,
        "saved": _opt_step,
        "save_s": _seconds,
        "noticed_at": _opt_step,
        "noticed_left_s": _number,
        "noticed_source": _STR,
        "pending": _BOOL,
    },
    "progress": {},
    "end": {"failed": _BOOL},
}


def check_record(record: Any) -> bool:
    """Whether ``record`` can be used: an object with a string ``type``, its ``run_id`` (if
    any) a string of 1 to :data:`MAX_RUN_ID_CHARS` characters; for a type coci
    writes, a ``step`` and every field the readers use of the kind they expect."""
    if type(record) is not dict or type(record.get("type")) is not str:
        return False
    if not _number(record.get("time")) or not _run_id(record.get("run_id")):
        return False
    fields = SCHEMA.get(record["type"])
    if fields is None:
        return True  # another version's record: nothing reads it
    if not _step(record.get("step")):
        return False
    return all(check(record.get(name)) for name, check in fields.items())


def parse_records(data: bytes | str) -> tuple[list[dict[str, Any]], int]:
    """The usable records of telemetry text (JSON lines), and how many non-blank lines were
    skipped (see the module's docstring)."""
    lines = data.split(b"\n") if isinstance(data, bytes) else data.split("\n")
    return _parse(lines)


#: A line longer than this is no record coci writes (its longest, a plan, is a few kB): it is
#: skipped unread, so that a file of one endless line (extended with a hole, a disk's garbage)
#: is never read into memory.
MAX_LINE_BYTES = 1 << 20


def read_records(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """:func:`parse_records` of the telemetry file ``path``, read a piece at a time: memory
    for its records, never for the file (a line over :data:`MAX_LINE_BYTES` is skipped).

    Raises:
        OSError: it cannot be read; FileNotFoundError: it is not a regular file (a FIFO put
            there since it was looked at would wait for a writer, /dev/zero never end).
    """
    from coci_core.errors import StorageError
    from coci_core.storage.local import open_regular

    try:
        fd = open_regular(path)
    except StorageError as e:
        raise FileNotFoundError(str(e)) from e
    with os.fdopen(fd, "rb") as f:
        return _parse(_lines(f))


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """The lines of ``f`` without their newline; None for one over :data:`MAX_LINE_BYTES`."""
    pending = bytearray()
    overlong = False
    while chunk := f.read(MAX_LINE_BYTES):
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            if overlong or len(pending) + end - start > MAX_LINE_BYTES:
                yield None
            else:
                yield bytes(pending) + chunk[start:end]
            pending.clear()
            overlong = False
            start = end + 1
        if not overlong:
            pending += chunk[start:]
            if len(pending) > MAX_LINE_BYTES:
                pending.clear()
                overlong = True
    if overlong:
        yield None
    elif pending:
        yield bytes(pending)


def _parse(lines: Any) -> tuple[list[dict[str, Any]], int]:
    records: list[dict[str, Any]] = []
    skipped = 0
    for line in lines:
        if line is None:  # longer than any record
            skipped += 1
            continue
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8") if isinstance(line, bytes) else line
            record = json.loads(text)
        except (ValueError, RecursionError):  # not UTF-8 or not JSON, too deep, too many digits
            skipped += 1
            continue
        if check_record(record):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def skipped_line(skipped: int) -> str:
    """The one line that says how many telemetry lines were skipped ("" for none)."""
    if not skipped:
        return ""
    if skipped == 1:
        return "1 telemetry line could not be read and was skipped"
    return f"{skipped} telemetry lines could not be read and were skipped"


def split_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``records`` split into runs, in the order written: a record whose ``run_id`` differs
    from the last one seen starts a new run. A record without one (written before records
    carried one) belongs to the run of the records around it, so a file written by an older
    version reads as one run, and a run resumed from one (its first record with a run id a
    ``restore``, or the ``start`` over after a failed session) keeps its earlier sessions;
    a run that begins anew after them is a run of its own."""
    runs: list[list[dict[str, Any]]] = [[]]
    current: str | None = None
    for r in records:
        run = r.get("run_id")
        if run is not None and run != current:
            goes_on = current is None and r.get("type") in ("restore", "start")
            if runs[-1] and not goes_on:
                runs.append([])
            current = run
        runs[-1].append(r)
    return runs
