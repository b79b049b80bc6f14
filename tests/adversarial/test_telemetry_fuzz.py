"""Telemetry fuzzer: a real telemetry file (two sessions of a planned run, a restore, a restart,
uploads) with malformed lines put in. The TensorBoard tab's routes (through the plugin's WSGI
app) answer 200 with the rest shown, and ``coci report`` exits 0 with one line counting the lines
it skipped."""

from __future__ import annotations

import io
import json
import os
import tracemalloc
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.plugins import base_plugin
from werkzeug.test import Client

from coci_core.commands.cli import main
from coci_core.telemetry import JsonlTelemetry, UploadEvent
from coci_core.telemetry.records import MAX_LINE_BYTES, parse_records, read_records
from coci_core.telemetry.tb_plugin import CociPlugin
from coci_core.training import Checkpointer
from tests.harness.processes import module, run, script


def _session(directory: Path, steps: range, *, restore: bool) -> None:
    sink = JsonlTelemetry(directory / "telemetry.jsonl")
    ckpt = Checkpointer(directory, sinks=[sink], mtbf_s=3600.0, telemetry_every_n_steps=1)
    if restore:
        ckpt.restore()
    for step in steps:
        ckpt.observe(step, loss=1.0 / step, step_time_s=0.01)
        if ckpt.should_save(step) or step % 10 == 0:
            ckpt.save(step, {"w": torch.full((64,), float(step))})
    sink(UploadEvent(step=steps[-1], outcome="failed", seconds=0.1, error="OSError: down"))
    if restore:  # the second session ends on a notice
        sink.record_preemption(
            steps[-1],
            source="SIGTERM",
            time_left_s=28.5,
            save=True,
            needed_s=0.2,
            margin_s=3.0,
            reason="it fits",
            saved=steps[-1],
            save_s=0.21,
        )
    ckpt.close()


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The telemetry of a run that saved at 10 and 20, was resumed from 20 and saved at 30."""
    directory = tmp_path_factory.mktemp("real")
    _session(directory, range(1, 25), restore=False)
    _session(directory, range(21, 31), restore=True)
    data = (directory / "telemetry.jsonl").read_bytes()
    kinds = {json.loads(line)["type"] for line in data.splitlines()}
    assert kinds >= {
        "plan",
        "save",
        "loss",
        "progress",
        "end",
        "restore",
        "restart",
        "upload",
        "preemption",
    }
    return data


class Views:
    """What a user sees of a telemetry file: the tab's two routes and ``coci report``."""

    def __init__(self, logdir: Path, telemetry: bytes) -> None:
        self.run = logdir / "run"
        self.run.mkdir(parents=True)
        (self.run / "telemetry.jsonl").write_bytes(telemetry)
        apps = CociPlugin(base_plugin.TBContext(logdir=str(logdir))).get_plugin_apps()
        self.routes = {name: Client(apps[f"/{name}"]) for name in ("timeline", "reason")}

    def route(self, name: str) -> dict[str, Any]:
        response = self.routes[name].get("/", query_string={"run": "run"})
        assert response.status_code == 200, (name, response.get_data()[-2000:])
        return json.loads(response.get_data())  # type: ignore[no-any-return]

    def report(self) -> str:
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["report", str(self.run)]) == 0
        return out.getvalue()


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def _inject(data: bytes, bad: list[bytes]) -> bytes:
    """``bad`` lines spread through ``data`` (between whole lines)."""
    lines = _lines(data)
    every = max(1, len(lines) // (len(bad) + 1))
    for i, line in enumerate(bad):
        lines.insert(min(len(lines), (i + 1) * every + i), line.rstrip(b"\n") + b"\n")
    return b"".join(lines)


def _same_but_skipped(got: dict[str, Any], want: dict[str, Any], skipped: int) -> None:
    """A route's answer ``got`` is ``want`` (the clean file's) but for the lines skipped."""
    got, want = dict(got), dict(want)
    assert (got.pop("skipped_lines"), want.pop("skipped_lines")) == (skipped, 0)
    if "skipped_note" in want:
        note = f"{skipped} telemetry line{'' if skipped == 1 else 's'} could not be read"
        assert got.pop("skipped_note").startswith(note) and want.pop("skipped_note") == ""
    got.pop("dir", None), want.pop("dir", None)  # where each copy lies
    assert got == want


def _record(data: bytes, kind: str, last: bool = False) -> dict[str, Any]:
    records = [json.loads(line) for line in data.splitlines()]
    found = [r for r in records if r["type"] == kind]
    return found[-1] if last else found[0]  # type: ignore[no-any-return]


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


#: Each kind of line a killed, copied or edited telemetry file may hold that cannot be read.
MALFORMED: dict[str, bytes] = {
    "array": b"[1, 2, 3]",
    "string": b'"save"',
    "number": b"17",
    "null": b"null",
    "empty object": b"{}",
    "no type": b'{"step": 5, "time": 1.0}',
    "type a number": b'{"type": 5, "step": 5}',
    "save without step": b'{"type": "save", "outcome": "committed", "time": 1.0}',
    "plan without step": b'{"type": "plan", "next_steps": [40], "time": 1.0}',
    "restore without step": b'{"type": "restore", "seconds": 1.0, "time": 1.0}',
    "string in next_steps": b'{"type": "plan", "step": 3, "next_steps": ["40"]}',
    "step a string": b'{"type": "loss", "step": "5", "loss": 1.0}',
    "step a float": b'{"type": "progress", "step": 5.0}',
    "step negative": b'{"type": "progress", "step": -5}',
    "step beyond int64": b'{"type": "progress", "step": 99999999999999999999}',
    "100,000-deep array": _deep(100_000),
    "100,000-deep object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "invalid UTF-8": b'{"type": "save", "step": 5, "error": "\xff\xfe"}',
    "NaN time": b'{"type": "progress", "step": 5, "time": NaN}',
    "Infinity loss": b'{"type": "loss", "step": 5, "loss": Infinity}',
    "1e400 seconds": b'{"type": "restore", "step": 5, "seconds": 1e400}',
    "a 400-digit number": b'{"type": "save", "step": 5, "stall_s": 1' + b"0" * 400 + b"}",
    "a 5000-digit number": b'{"type": "save", "step": 5, "stall_s": 1' + b"0" * 5000 + b"}",
    "a negative stall": b'{"type": "save", "step": 5, "stall_s": -1e300}',
    "a stall of 1e300 s": b'{"type": "save", "step": 5, "stall_s": 1e300}',
    "a negative size": b'{"type": "save", "step": 5, "bytes_written": -1}',
    "a negative restore": b'{"type": "restore", "step": 5, "seconds": -0.5}',
    "NUL bytes": b"\x00\x00\x00",
    "an empty run id": b'{"type": "progress", "step": 5, "time": 1.0, "run_id": ""}',
    "a run id no run has": b'{"type": "end", "step": 5, "run_id": "%s"}' % (b"a" * 65),
    "not JSON": b"coci was here",
}


@pytest.fixture(scope="module")
def clean(real: bytes, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the user sees of the real file: both routes and the report."""
    views = Views(tmp_path_factory.mktemp("clean"), real)
    return {
        "timeline": views.route("timeline"),
        "reason": views.route("reason"),
        **{"report": views.report()},
    }


def _shows_the_rest(views: Views, clean: dict[str, Any], skipped: int) -> None:
    for route in ("timeline", "reason"):
        _same_but_skipped(views.route(route), clean[route], skipped)


def test_malformed_lines_are_skipped_counted_and_the_rest_shown(
    tmp_path: Path, real: bytes, clean: dict[str, Any]
) -> None:
    for kind, line in MALFORMED.items():
        assert parse_records(line + b"\n" + real) == (parse_records(real)[0], 1), kind
    torn = _lines(real)[-1][:25]  # the last line of a run killed mid-write
    views = Views(tmp_path, _inject(real, list(MALFORMED.values())) + torn)
    skipped = len(MALFORMED) + 1
    _shows_the_rest(views, clean, skipped)
    # the command itself, in a process of its own: exit 0, the count first, no traceback
    proc = run(module("coci_core.commands.cli", "report", str(views.run)))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    line = f"{skipped} telemetry lines could not be read and were skipped\n"
    assert proc.stdout == line + clean["report"]


#: Values no field of a record may hold, by the kind of value the field holds in a real record.
WRONG: dict[str, list[Any]] = {
    "number": ["1.5", [1], {"k": 1}, True, float("nan"), float("inf"), 10**400],
    "str": [5, [1], {"k": "v"}, True],
    "bool": ["yes", 1, [True]],
    "list": ["7", ["7"], [1.5], [-1], [True], {"k": 1}],
    "dict": ["x", [1], 5, True],
    "none": [[["deep"]], True],  # an optional field: no kind takes these
}


def _kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "str", list: "list", dict: "dict"}[type(value)]


def _mutants(record: dict[str, Any]) -> Iterator[bytes]:
    """``record`` with each field in turn holding each value wrong for it."""
    for field, value in record.items():
        for wrong in WRONG[_kind(value)]:
            if field == "type" and isinstance(wrong, str):
                continue  # another type's name is a record of that type
            # Python's json writes NaN, Infinity and 1e400 (as Infinity) as a writer may
            yield json.dumps({**record, field: wrong}).encode()


def test_a_wrong_value_in_any_field_of_any_record_is_skipped(
    tmp_path: Path, real: bytes, clean: dict[str, Any]
) -> None:
    kinds = ("plan", "save", "loss", "progress", "end", "restore", "restart", "upload")
    kinds += ("preemption",)
    bad = [line for kind in kinds for line in _mutants(_record(real, kind, last=True))]
    assert len(bad) > 300  # every field of every kind of record, each several ways
    for line in bad:
        assert parse_records(line)[1] == 1, line
    views = Views(tmp_path, _inject(real, bad))
    _shows_the_rest(views, clean, len(bad))
    line = f"{len(bad)} telemetry lines could not be read and were skipped\n"
    assert views.report() == line + clean["report"]


def test_the_largest_step_is_shown_without_planning_over_it(tmp_path: Path, real: bytes) -> None:
    """A step of 2**63 - 1 is a step: the run's length, with no per-step plan over it (before:
    the policy comparison asked numpy for an array that long, and the routes and the report
    failed)."""
    last = json.dumps({"type": "progress", "step": 2**63 - 1, "time": 2e9}).encode()
    views = Views(tmp_path, real + last + b"\n")
    timeline = views.route("timeline")
    assert timeline["last_step"] == 2**63 - 1 and timeline["skipped_lines"] == 0
    assert timeline["summary"]["policies"] == []
    assert views.route("reason")["lines"]
    report = views.report()
    assert "not compared: the policies are compared over at most 20,000,000 steps" in report


_POINTERS = """
import os, resource, sys
from pathlib import Path
from coci_core.telemetry.timeline import find_runs
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a read of /dev/zero: MemoryError
root = Path(sys.argv[1])
(root / "run").mkdir()
(root / "run" / "telemetry.jsonl").write_text("")
for kind in ("deep", "fifo", "zero", "huge"):
    log = root / "tb" / kind
    log.mkdir(parents=True)
    pointer = log / "coci-telemetry.json"
    if kind == "deep":
        pointer.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "fifo":
        os.mkfifo(pointer)
    elif kind == "zero":
        os.symlink("/dev/zero", pointer)
    else:
        pointer.write_text('{"checkpoint_dir": "' + "x" * 10**6 + '"}')
print(sorted(find_runs(root).values()))
"""


def test_a_pointer_file_that_is_deep_a_fifo_or_endless_is_passed_over(tmp_path: Path) -> None:
    """A TensorBoard directory's ``coci-telemetry.json`` nested 100,000 deep, a FIFO, a link to
    /dev/zero or a megabyte long is no run: the runs are listed at once (before: a
    RecursionError out of every route, a route that waited for ever for the FIFO's writer, a
    read of /dev/zero until memory ran out)."""
    out = run(script(_POINTERS, str(tmp_path)), timeout_s=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == repr([str(tmp_path / "run")])


def test_a_line_longer_than_memory_is_skipped_not_read(tmp_path: Path, real: bytes) -> None:
    """A telemetry file ending in an endless line (a file extended with a hole, a disk's
    garbage: here 256 MiB, as well 40 GiB) is read a piece at a time: that line is skipped and
    counted, the rest shown by both routes and ``coci report``, in a few MiB of memory
    (before: the whole file was read into memory, and a file larger than it failed every view
    with a MemoryError traceback)."""
    views = Views(tmp_path, real)
    with (views.run / "telemetry.jsonl").open("r+b") as f:
        f.truncate(len(real) + (256 << 20))  # a hole: no disk used
    tracemalloc.start()
    try:
        skipped = [views.route(name)["skipped_lines"] for name in ("timeline", "reason")]
        report = views.report()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert skipped == [1, 1]
    assert report.startswith("1 telemetry line could not be read and was skipped\n")
    assert peak < 32 << 20, peak
    # lines across the pieces it reads, one of the longest length and one just over it
    for pad, over in ((MAX_LINE_BYTES - 5, 0), (MAX_LINE_BYTES, 0), (MAX_LINE_BYTES + 1, 1)):
        path = tmp_path / f"pad{pad}.jsonl"
        path.write_bytes(b" " * pad + b"\n" + real)
        assert read_records(path) == (parse_records(real)[0], over), pad


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero"])
def test_a_telemetry_file_that_is_not_a_file_is_named_so(tmp_path: Path, kind: str) -> None:
    """A ``telemetry.jsonl`` that is a FIFO, a directory or a link to /dev/zero: ``coci
    report`` says so in one line, exit 1, at once (before: "no telemetry.jsonl in DIR: the
    adapters write it", of a file that is there); a reader opened after the look is refused
    too (a FIFO would wait for a writer, /dev/zero never end)."""
    path = tmp_path / "telemetry.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["report", str(tmp_path)]) == 1
    assert err.getvalue() == f"coci: {path} is not a regular file: coci reads a run's " + (
        "telemetry from the file its adapter writes there\n"
    )
    with pytest.raises(FileNotFoundError, match="not a regular file"):
        read_records(path)


@pytest.mark.parametrize("forged", [b"99999999999999999999999", b"-5", b"9223372036854775808"])
def test_a_forged_progress_file_writes_no_record_its_reader_skips(
    tmp_path: Path, forged: bytes
) -> None:
    """A ``telemetry.progress`` holding a step no run reaches (beyond 2**63-1, negative) is
    unreadable, as a torn one is: the next session's records are all read back (before: its
    ``start`` record carried the forged step as ``reached``, and every reader skipped it)."""
    (tmp_path / "telemetry.progress").write_bytes(forged)
    with JsonlTelemetry(tmp_path / "telemetry.jsonl") as sink:
        sink.record_progress(1)
    records, skipped = read_records(tmp_path / "telemetry.jsonl")
    assert skipped == 0 and [r["type"] for r in records][-1] == "end"
