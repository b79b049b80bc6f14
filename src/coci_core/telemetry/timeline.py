"""A run's checkpoints on one timeline: what the TensorBoard **coci** tab and
``coci report --plot`` draw.

:func:`find_runs` finds the runs under a TensorBoard log directory: every checkpoint directory
with a ``telemetry.jsonl`` under it, and every one that a TensorBoard run directory points to
with a ``coci-telemetry.json`` file (written by the adapters' TensorBoard telemetry next to
the event files, e.g. in Lightning's ``lightning_logs/version_N``). One checkpoint directory
is one run, however many processes (and logger versions) it took: a killed and resumed run
appends to the same telemetry. :func:`timeline` turns a run's records into the plain data
both views draw; its summary is :func:`~coci_core.telemetry.report.facts`, the numbers
``coci report`` prints.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from coci_core.errors import StorageError
from coci_core.storage.local import open_regular
from coci_core.telemetry.events import TELEMETRY_FILE
from coci_core.telemetry.records import skipped_line
from coci_core.telemetry.report import (
    STEP_RECORDS,
    RunSummary,
    earlier_runs_lines,
    facts,
    summarize,
)
from coci_core.telemetry.report_events import SESSION_STARTS, notices, preemption_line
from coci_core.telemetry.summary import compression_ratio

__all__ = [
    "LOG_DIR_FILE",
    "POINTER_FILE",
    "find_runs",
    "from_summary",
    "tensorboard_log_dir",
    "timeline",
    "write_log_dir",
    "write_pointer",
]

#: The file in a TensorBoard run directory that names the run's checkpoint directory.
POINTER_FILE = "coci-telemetry.json"
#: in the telemetry's directory: the TensorBoard directory pointing to it (for ``coci report``)
LOG_DIR_FILE = "coci-tensorboard.json"

_MAX_DEPTH = 6  # how deep find_runs looks under the log directory
_MAX_POINTER_BYTES = 64 << 10  # a pointer file is one short line


def write_pointer(log_dir: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str]) -> None:
    """Write ``log_dir/coci-telemetry.json`` naming ``checkpoint_dir`` (a path, kept both
    relative to ``log_dir`` and absolute, or an fsspec URL)."""
    target = os.fspath(checkpoint_dir)
    record: dict[str, str] = {"checkpoint_dir": target}
    if "://" not in target:
        absolute = os.path.abspath(target)
        record = {"checkpoint_dir": absolute, "relative": os.path.relpath(absolute, log_dir)}
    os.makedirs(log_dir, exist_ok=True)
    path = Path(log_dir) / POINTER_FILE
    tmp = path.with_name(f".{POINTER_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_log_dir(telemetry_dir: str | os.PathLike[str], log_dir: str | os.PathLike[str]) -> None:
    """Write ``telemetry_dir/coci-tensorboard.json`` naming ``log_dir`` (a local directory
    only), where ``coci report`` finds the TensorBoard directory of a run whose logger chose
    it (the Trainer's ``logging_dir``, an Accelerate tracker's)."""
    target = os.fspath(telemetry_dir)
    if "://" in target or not os.path.isdir(target):
        return
    path = Path(target) / LOG_DIR_FILE
    tmp = path.with_name(f".{LOG_DIR_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"log_dir": os.path.abspath(log_dir)}) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def tensorboard_log_dir(telemetry_dir: str | os.PathLike[str]) -> str | None:
    """The TensorBoard directory that :func:`write_log_dir` recorded in ``telemetry_dir``, if
    it is still a directory; else None."""
    target = os.fspath(telemetry_dir)
    if "://" in target:
        return None
    record = _read_record(Path(target) / LOG_DIR_FILE)
    log_dir = record.get("log_dir") if record is not None else None
    return log_dir if isinstance(log_dir, str) and os.path.isdir(log_dir) else None


def _read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object of a small pointer file, or None (unreadable, too long, not one)."""
    try:
        fd = open_regular(path)  # not a FIFO (a read would wait) nor /dev/zero (never ends)
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_POINTER_BYTES + 1)
        if len(data) > _MAX_POINTER_BYTES:
            return None
        record = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError, StorageError):  # deep nesting: RecursionError
        return None
    return record if isinstance(record, dict) else None


def _read_pointer(path: Path) -> str | None:
    """The checkpoint directory a pointer file names, or None (unreadable, or it has no
    telemetry where it says)."""
    record = _read_record(path)
    if record is None:
        return None
    relative, target = record.get("relative"), record.get("checkpoint_dir")
    if isinstance(relative, str):
        candidate = os.path.normpath(os.path.join(path.parent, relative))
        if os.path.isfile(os.path.join(candidate, TELEMETRY_FILE)):
            return candidate  # the directories were moved together
    if isinstance(target, str) and "://" in target:
        return target
    if isinstance(target, str) and os.path.isfile(os.path.join(target, TELEMETRY_FILE)):
        return os.path.normpath(target)
    return None


def find_runs(logdir: str | os.PathLike[str]) -> dict[str, str]:
    """The runs under ``logdir``: a name (the checkpoint directory relative to ``logdir``, or
    for one outside it, the TensorBoard directories pointing to it) -> the checkpoint
    directory (a path or an fsspec URL)."""
    root = os.path.abspath(logdir)
    found: dict[str, list[str]] = {}  # checkpoint dir -> pointer directories
    for here, dirs, files in os.walk(root):
        depth = here[len(root) :].count(os.sep)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith((".", "step-")) and depth < _MAX_DEPTH and d != "telemetry"
        )
        if TELEMETRY_FILE in files:
            found.setdefault(os.path.normpath(here), [])
        if POINTER_FILE in files:
            target = _read_pointer(Path(here) / POINTER_FILE)
            if target is not None:
                key = target if "://" in target else os.path.realpath(target)
                found.setdefault(key, []).append(here)
    runs: dict[str, str] = {}
    for target, pointers in sorted(found.items()):
        inside = "://" not in target and (target == root or target.startswith(root + os.sep))
        if inside:
            name = os.path.relpath(target, root)
        else:
            name = os.path.relpath(os.path.commonpath(pointers), root)
        if name == ".":
            name = os.path.basename(root) or root
        if name in runs:
            name = target
        runs[name] = target
    return runs


def _clocks(records: list[dict[str, Any]]) -> dict[int, list[tuple[int, float]]]:
    """Each process's (step, wall time) points, in order."""
    clocks: dict[int, list[tuple[int, float]]] = {}
    session = 0
    for r in records:
        if r.get("type") in SESSION_STARTS:
            session += 1
        t = _num(r.get("time"))
        if r.get("type") in STEP_RECORDS and t is not None:
            clocks.setdefault(session, []).append((int(r["step"]), t))
    return clocks


def _at_step(points: list[tuple[int, float]], step: int) -> float | None:
    """The wall time at ``step``, interpolated between (or extrapolated from) ``points``."""
    pts = sorted(points)
    if not pts:
        return None
    if len(pts) == 1:
        return pts[0][1]
    below = [p for p in pts if p[0] <= step] or pts[:1]
    above = [p for p in pts if p[0] > step] or pts[-1:]
    (s0, t0), (s1, t1) = below[-1], above[0]
    if s1 == s0:  # beyond the last point: the last stretch's rate
        (s0, t0), (s1, t1) = pts[-2], pts[-1]
    if s1 == s0:
        return t1
    return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def timeline(directory: str, name: str | None = None) -> dict[str, Any]:
    """The run in ``directory`` (a checkpoint directory or an fsspec URL), as plain data.

    Keys: ``run``, ``dir``; ``has_time`` (every record has a wall-clock time); ``t0`` (the
    first record's time); ``last_step``; ``loss`` (``step``, ``loss``, ``fitted``, ``time``,
    ``lost``: trained again after a restart); ``plans`` (each revision of the plan: ``step``,
    ``time``, ``next_steps``, ``session``: 0, then 1 after the first restart, ...);
    ``planned`` (each step a plan held: ``step``, ``time`` (when it was, or would have been,
    reached), ``planned_at``, ``state``: ``"taken"``, ``"missed"`` (the plan in force had it
    when the run reached it, and it was not saved), ``"revised"`` (a later plan dropped it
    before it came, or the plans after a restart did not have it) or ``"unreached"`` (the run
    never reached it: it ended first), and ``revised_at``);
    ``saves`` (``step``, ``outcome``, ``time``, ``stall_ms``, ``persist_s``, ``mb``,
    ``compression_x``, ``compressed``, ``error``); ``restarts`` (``restored``,
    ``failed_at``, ``lost_steps``, ``restart_s`` (process start to the first step after the
    restore, when recorded; else the restore), ``restore_s``, ``restart_since``, ``time``,
    ``failed_time``, ``restored_time``, ``exact``: ``failed_at`` is the step the failed
    process reached, ``checkpoint``: False when there was none to restore and the run started
    over from step 0);
    ``resumes`` (restores that lost nothing: the run went on after it ended: ``restored``,
    ``time``, ``restore_s``); ``preemptions`` (each notice: ``step`` and ``time`` where the
    ranks learned of it, ``source``, ``time_left_s`` then, ``decision`` (``"saved"``, ``"not
    saved"``: the save did not fit, ``"not finished"``: it did not end before the
    deadline), ``save_step`` (the step of the decision: later than ``step`` when the save
    was moved before a known end) and ``save_time``, ``saved``, ``save_s``, ``reason``, and
    ``text``: ``coci report``'s line); ``summary``
    (:func:`~coci_core.telemetry.report.facts`);
    ``skipped_lines`` (the telemetry lines that could not be read, left out) and
    ``skipped_note`` (that count in words, "" for none); ``earlier_runs`` (the runs written
    into the directory before the one shown: the timeline is of the latest) and
    ``earlier_note`` (those runs in words, "" for none).
    """
    return from_summary(summarize(directory), directory, name)


def from_summary(summary: RunSummary, directory: str, name: str | None = None) -> dict[str, Any]:
    """:func:`timeline` of a summary already read."""
    records = summary.records
    times = [_num(r.get("time")) for r in records]
    has_time = bool(records) and all(t is not None for t in times)
    t0 = min((t for t in times if t is not None), default=None)

    # a loss point is lost work when a later restore went back before it
    lost_index: set[int] = set()
    for restart in summary.restarts:
        for i in range(restart.index):
            r = records[i]
            if r.get("type") == "loss" and restart.restored < int(r["step"]) <= restart.failed_at:
                lost_index.add(i)
    loss = [
        {
            "step": int(r["step"]),
            "loss": _num(r.get("loss")),
            "fitted": _num(r.get("fitted")),
            "time": _num(r.get("time")),
            "lost": i in lost_index,
        }
        for i, r in enumerate(records)
        if r.get("type") == "loss"
    ]

    plans: list[dict[str, Any]] = []
    session = 0  # the process: a restore starts the next one
    for r in records:
        if r.get("type") in SESSION_STARTS:
            session += 1
        if r.get("type") != "plan":
            continue
        steps = sorted({int(s) for s in r.get("next_steps", [])})
        if plans and plans[-1]["next_steps"] == steps and plans[-1]["session"] == session:
            continue
        plans.append(
            {
                "step": int(r["step"]),
                "time": _num(r.get("time")),
                "next_steps": steps,
                "session": session,
            }
        )

    committed = {int(s["step"]): _num(s.get("time")) for s in summary.committed}
    clocks = _clocks(records)
    planned = []
    as_stood = set(summary.planned)
    for step in summary.proposed:
        # the plans made while it was ahead; a later one of the same process dropped it?
        before = [p for p in plans if p["step"] < step]
        holders = [i for i, p in enumerate(before) if step in p["next_steps"]]
        revised_at = None
        if holders:
            last = before[holders[-1]]
            after = [p for p in before[holders[-1] + 1 :] if p["session"] == last["session"]]
            if not after and step <= summary.last_step:
                # its session failed before it; the run reached it after the restart, when the
                # new session's plans did not have it: they revised it away
                after = [p for p in plans if p["session"] > last["session"]]
            if after:
                revised_at = after[0]["step"]
        if step in committed:
            state = "taken"
        elif step in as_stood:
            state = "missed"  # the plan had it as the run reached it: not saved
        else:  # dropped by a later plan before the run reached it, or never reached
            state = "revised" if revised_at is not None else "unreached"
        session = before[holders[-1]]["session"] if holders else 0
        planned.append(
            {
                "step": step,
                "time": committed.get(step) or _at_step(clocks.get(session, []), step),
                "planned_at": before[holders[0]]["step"] if holders else None,
                "state": state,
                "revised_at": revised_at,
            }
        )

    saves = []
    for s in summary.saves:
        written, raw = _num(s.get("bytes_written")), _num(s.get("raw_bytes"))
        ok = s.get("outcome") == "committed"
        compressed = bool(s.get("compressed"))
        persist = _num(s.get("persist_s"))
        saves.append(
            {
                "step": int(s["step"]),
                "outcome": str(s.get("outcome")),
                "time": _num(s.get("time")),
                "stall_ms": None if _num(s.get("stall_s")) is None else 1e3 * s["stall_s"],
                "persist_s": persist if ok else None,
                "mb": written / 1e6 if ok and written is not None else None,
                "compression_x": _finite(compression_ratio(raw, written, compressed))
                if ok
                else None,
                "compressed": compressed,
                "error": s.get("error"),
            }
        )

    restarts = []
    for restart, whole in zip(summary.restarts, summary.restart_records, strict=True):
        restore = records[restart.index]
        earlier = [
            _num(records[i].get("time"))
            for i in range(restart.index)
            if records[i].get("type") in STEP_RECORDS
        ]
        reached = [
            _num(records[i].get("time"))
            for i in range(restart.index)
            if records[i].get("type") in STEP_RECORDS
            and int(records[i]["step"]) <= restart.restored
        ]
        restarts.append(
            {
                "restored": restart.restored,
                "failed_at": restart.failed_at,
                "lost_steps": restart.lost_steps,
                "exact": restart.exact,
                "checkpoint": restart.checkpoint,
                "restore_s": _num(restore.get("seconds")),
                "restore_parts_s": {
                    k[:-2]: _num(restore.get(k))
                    for k in ("read_s", "verify_s", "decode_s", "load_s")
                    if _num(restore.get(k)) is not None
                },
                "restart_s": _num((whole or restore).get("seconds")),
                "restart_since": None if whole is None else whole.get("since"),
                "time": _num(restore.get("time")),
                "failed_time": earlier[-1] if earlier else None,
                "restored_time": reached[-1] if reached else None,
            }
        )

    preemptions = []
    session = 0
    shown = {id(r) for r in notices(records)}  # one record per notice
    for r in records:
        if r.get("type") == "restore":
            session += 1
        if r.get("type") != "preemption" or id(r) not in shown:
            continue
        step = int(r["step"])
        noticed = r.get("noticed_at")
        noticed = step if noticed is None else int(noticed)
        saved = r.get("saved")
        decision = (
            "saved" if saved is not None else "not finished" if r.get("save") else "not saved"
        )
        left = _num(r.get("noticed_left_s"))
        preemptions.append(
            {
                "step": noticed,
                "time": _at_step(clocks.get(session, []), noticed),
                "source": str(r.get("noticed_source") or r.get("source") or "?"),
                "time_left_s": _num(r.get("time_left_s")) if left is None else left,
                "decision": decision,
                "save_step": step,
                "save_time": committed.get(step) or _at_step(clocks.get(session, []), step),
                "saved": saved,
                "save_s": _num(r.get("save_s")),
                "reason": r.get("reason"),
                "text": preemption_line(r),
            }
        )

    return {
        "run": name or directory,
        "dir": directory,
        "has_time": has_time,
        "t0": t0,
        "last_step": summary.last_step,
        "loss": loss,
        "plans": plans,
        "planned": planned,
        "saves": saves,
        "restarts": restarts,
        "resumes": [
            {
                "restored": r.restored,
                "time": _num(records[r.index].get("time")),
                "restore_s": _num(records[r.index].get("seconds")),
            }
            for r in summary.resumes
            if not r.failure
        ],
        "preemptions": preemptions,
        "summary": facts(summary),
        "skipped_lines": summary.skipped_lines,
        "skipped_note": skipped_line(summary.skipped_lines),
        # the runs written into the directory before the one shown, and that in words
        "earlier_runs": len(summary.earlier_runs),
        "earlier_note": " ".join(line.strip() for line in earlier_runs_lines(summary)).strip(),
    }
