"""The lines of ``coci report`` read from a run's records alone, not from its summary: its
preemption notices and its remote tier's uploads (and the numbers' formatting that the report
shares with them)."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = [
    "SESSION_STARTS",
    "notices",
    "num",
    "plural",
    "preemption_line",
    "uploads_line",
]

#: The records that start a new session of the run: a restore, or a ``start`` over from
#: step 0 after a session that failed before its first checkpoint.
SESSION_STARTS = ("restore", "start")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def num(value: Any, spec: str, scale: float = 1.0, unknown: str = "-") -> str:
    """``value * scale`` formatted by ``spec``; ``unknown`` for a missing (None) value, which
    telemetry writes for a non-finite or not yet measured one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return unknown
    return format(value * scale, spec)


def notices(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The preemption records, one per notice: the record written at a notice's decision,
    before its save (``pending``), is replaced by its outcome's record when the session
    wrote one; alone, it is a notice whose process ended (a SIGKILL) before that."""
    shown: list[dict[str, Any]] = []
    waiting: dict[tuple[Any, Any], int] = {}  # this session's pending records -> index
    for r in records:
        if r.get("type") in SESSION_STARTS:
            waiting = {}
        if r.get("type") != "preemption":
            continue
        key = (r.get("step"), r.get("noticed_at"))
        if r.get("pending"):
            waiting[key] = len(shown)
            shown.append(r)
        elif key in waiting:
            shown[waiting.pop(key)] = r
        else:
            shown.append(r)
    return shown


def preemption_line(r: dict[str, Any]) -> str:
    """One preemption notice: when it came, the time left, and the step saved (and how long
    the save took) or why none was."""
    noticed_at = r.get("noticed_at")
    if noticed_at is None or noticed_at == r["step"]:
        head = (
            f"preemption notice ({r.get('source') or '?'}) at step {r['step']}, "
            f"{num(r.get('time_left_s'), '.1f', unknown='?')} s left"
        )
    else:  # a known end far enough ahead: the save moved to its last step that fits, or a
        # later notice (a SIGTERM) took it at once on the way
        source = r.get("source") or "?"
        first = r.get("noticed_source") or source
        left = num(r.get("time_left_s"), ".1f", unknown="?")
        head = (
            f"preemption notice ({first}) at step {noticed_at}, "
            f"{num(r.get('noticed_left_s'), '.1f', unknown='?')} s left: "
            + (
                f"the save moved to step {r['step']}, {left} s left"
                if first == source
                else f"then {'a notice on another rank' if source == 'another rank' else source}"
                f" at step {r['step']}, {left} s left"
            )
        )
    saved = r.get("saved")
    if saved is not None:
        took = num(r.get("save_s"), ".2f", unknown="?")
        return f"{head}: saved step {saved} (the save took {took} s)"
    if r.get("save") and r.get("pending"):
        why = (
            "the process ended before the save was durable (killed before the deadline "
            "coci was given?)"
        )
    elif r.get("save"):
        why = "the save did not finish before the deadline"
    else:
        why = r.get("reason") or "no reason recorded"
    return f"{head}: not saved: {why}"


def uploads_line(uploads: list[dict[str, Any]]) -> str:
    """The remote tier in one line: steps uploaded, the newest, failed attempts."""
    done = [u for u in uploads if u.get("outcome") == "committed"]
    failed = [u for u in uploads if u.get("outcome") == "failed"]
    line = f"remote tier: {plural(len(done), 'checkpoint')} uploaded"
    if done:
        median = statistics.median(_seconds(u) for u in done)
        line += f", newest step {done[-1]['step']} (median {num(median, '.2f')} s each)"
    if failed:
        last = failed[-1]
        line += f"; {plural(len(failed), 'failed attempt')}, the last at step {last['step']}: "
        line += str(last.get("error") or "?")
        if not done or done[-1]["step"] < last["step"]:
            line += " (not uploaded since)"
    return line


def _seconds(upload: dict[str, Any]) -> float:
    x = upload.get("seconds")
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0
