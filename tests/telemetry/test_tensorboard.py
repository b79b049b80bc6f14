"""TensorBoardTelemetry: the scalars it writes (read back with TensorBoard's reader) and the coci
tab's pointer."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager, ConfigError, RestoreEvent, SaveEvent
from coci_core.planner import Planner, PlannerReport
from coci_core.telemetry import UploadEvent
from coci_core.telemetry.tensorboard import TensorBoardTelemetry
from coci_core.telemetry.timeline import LOG_DIR_FILE, POINTER_FILE, find_runs, tensorboard_log_dir
from tests.harness.processes import run, script

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed (pip install 'coci[tensorboard]')",
)

#: Every tag the telemetry may write: what reads well as a scalar, under one group.
TAGS = {"coci/stall_ms", "coci/persist_s", "coci/checkpoint_MB", "coci/expected_overhead_s"}


def _read(log_dir: Path) -> Any:
    """An EventAccumulator over ``log_dir`` that keeps every point."""
    from tensorboard.backend.event_processing import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        event_accumulator as ea,
    )

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def _series(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _steps(acc: Any, tag: str) -> list[int]:
    return [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def reports() -> dict[int, PlannerReport]:
    """Reports of a real Planner after 11, 151 and 400 observed steps of a decaying loss."""
    planner = Planner(
        policy="coci",
        total_steps=2000,
        mtbf_s=3600,
        step_time_s=0.1,
        stall_s=0.5,
        persist_s=1.0,
        grid_points=200,
    )
    out = {}
    for step in range(400):
        planner.observe(step, loss=2.0 * math.exp(-step / 200) + 0.5, step_time_s=0.1)
        if step in (10, 150, 399):
            out[step] = planner.report()
    return out


@needs_tensorboard
def test_save_events_by_outcome(tmp_path: Path) -> None:
    """A committed save writes its stall (ms), persist (s) and size (MB); a failed one only its
    stall; a skipped one nothing."""
    with TensorBoardTelemetry(tmp_path) as tele:
        tele(
            SaveEvent(
                step=10,
                outcome="committed",
                stall_s=0.002,
                copy_s=0.001,
                persist_s=0.5,
                time_to_durable_s=0.502,
                bytes_written=4_096_000,
            )
        )
        tele(SaveEvent(step=20, outcome="skipped", stall_s=0.0001))
        tele(SaveEvent(step=30, outcome="failed", stall_s=0.004, error="OSError: disk full"))
        tele(SaveEvent(step=40, outcome="committed", stall_s=0.003, persist_s=0.25))
    acc = _read(tmp_path)
    assert _steps(acc, "coci/stall_ms") == [10, 30, 40]
    assert [e.value for e in acc.Scalars("coci/stall_ms")] == pytest.approx([2.0, 4.0, 3.0])
    assert _steps(acc, "coci/persist_s") == [10, 40]
    assert [e.value for e in acc.Scalars("coci/persist_s")] == pytest.approx([0.5, 0.25])
    assert _series(acc, "coci/checkpoint_MB") == [(10, pytest.approx(4.096)), (40, 0.0)]
    assert set(acc.Tags()["scalars"]) == TAGS - {"coci/expected_overhead_s"}


@needs_tensorboard
def test_only_costs_under_one_group(tmp_path: Path, reports: dict[int, PlannerReport]) -> None:
    """Restores, uploads, plans' steps and losses write no scalar (no step numbers as values,
    no custom-scalars layout): the Scalars tab has the four coci/ tags and nothing else."""
    with TensorBoardTelemetry(tmp_path) as tele:
        tele(SaveEvent(step=5, outcome="committed", stall_s=0.01, persist_s=0.2))
        tele(RestoreEvent(step=5, seconds=3.5, bytes_read=1 << 20))
        tele(UploadEvent(step=5, outcome="committed", seconds=1.0, bytes_uploaded=10))
        tele(UploadEvent(step=5, outcome="failed", attempt=2))
        for step, report in reports.items():
            tele.record_plan(step, report)
        tele.record_loss(399, 0.8, reports[399].fitted_loss)
    acc = _read(tmp_path)
    assert set(acc.Tags()["scalars"]) == TAGS
    assert acc.Tags()["tensors"] == []  # no custom-scalars layout
    assert _series(acc, "coci/stall_ms") == [(5, pytest.approx(10.0))]


@needs_tensorboard
def test_expected_overhead_from_a_real_planner(
    tmp_path: Path, reports: dict[int, PlannerReport]
) -> None:
    """Each recorded plan writes its expected wall-clock overhead (s) at the step recorded."""
    with TensorBoardTelemetry(tmp_path) as tele:
        for step, report in reports.items():
            tele.record_plan(step, report)
    acc = _read(tmp_path)
    assert all(r.expected_overhead is not None for r in reports.values())
    assert _steps(acc, "coci/expected_overhead_s") == list(reports)
    expected = [r.expected_overhead.wall_s for r in reports.values() if r.expected_overhead]
    values = [e.value for e in acc.Scalars("coci/expected_overhead_s")]
    assert values == pytest.approx(expected, rel=1e-6)


def test_losses_are_checked_not_written() -> None:
    """record_loss accepts numpy and tensor scalars and NaN, and writes nothing: the loss and
    its fit are drawn by the coci tab."""
    writer = _ListWriter()
    tele = TensorBoardTelemetry(writer=writer)
    tele.record_loss(1, 2.5, 2.4)
    tele.record_loss(2, np.float32(2.25), None)
    tele.record_loss(3, torch.tensor(2.0), fitted=np.float64(2.1))
    tele.record_loss(np.int64(4), float("nan"))
    assert writer.scalars == []


@needs_tensorboard
def test_pointer_for_the_coci_tab(tmp_path: Path) -> None:
    """With telemetry_dir, the writer's directory gets coci-telemetry.json naming it, and the
    coci tab finds that run from a log directory above the writer's."""
    from torch.utils.tensorboard import SummaryWriter

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "telemetry.jsonl").write_text("")
    own = TensorBoardTelemetry(tmp_path / "logs" / "own", telemetry_dir=ckpt)
    own.close()
    writer = SummaryWriter(log_dir=str(tmp_path / "logs" / "host"))
    TensorBoardTelemetry(writer=writer, telemetry_dir=ckpt).close()
    writer.close()
    for name in ("own", "host"):
        record = json.loads((tmp_path / "logs" / name / POINTER_FILE).read_text())
        assert record == {"checkpoint_dir": str(ckpt), "relative": "../../ckpt"}
    assert find_runs(tmp_path / "logs") == {".": str(ckpt)} or find_runs(tmp_path / "logs") == {
        "logs": str(ckpt)
    }
    # and the checkpoint directory names the writer's directory, for `coci report`
    assert tensorboard_log_dir(ckpt) == str(tmp_path / "logs" / "host")
    (ckpt / LOG_DIR_FILE).write_text("[" * 100_000)  # forged: no directory, no error
    assert tensorboard_log_dir(ckpt) is None


@needs_tensorboard
def test_existing_summary_writer_is_used_and_left_open(tmp_path: Path) -> None:
    """With a host's SummaryWriter, scalars go to its file, and close() leaves the writer
    usable."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    try:
        writer.add_scalar("host/loss", 1.0, 0)
        first = TensorBoardTelemetry(writer=writer)
        second = TensorBoardTelemetry(writer=writer)
        first(SaveEvent(step=1, outcome="committed", stall_s=0.5))
        second(SaveEvent(step=2, outcome="committed", stall_s=0.25))
        first.close()
        second.close()
        writer.add_scalar("host/loss", 0.25, 2)  # still open
        writer.flush()
        assert len(list(tmp_path.iterdir())) == 1  # one event file: nothing reopened
        acc = _read(tmp_path)
        assert _series(acc, "host/loss") == [(0, 1.0), (2, 0.25)]
        assert _series(acc, "coci/stall_ms") == [(1, 500.0), (2, 250.0)]
    finally:
        writer.close()


@needs_tensorboard
def test_a_shared_writer_its_owner_closes_drops_later_records_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The host closes the shared writer while coci still records (the Trainer's
    TensorBoardCallback at the train's end, a notice's save reporting from the writer thread):
    its event file is closed under the SummaryWriter ("Writer is closed"). coci drops its later
    scalars with one INFO line; it logged a traceback ("telemetry sink ... failed")."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    tele = TensorBoardTelemetry(writer=writer)
    tele(SaveEvent(step=1, outcome="committed", stall_s=0.001))
    writer._get_file_writer().close()  # the owner's close, caught half-way by coci's write
    with caplog.at_level(logging.INFO, logger="coci_core.telemetry.tensorboard"):
        tele(SaveEvent(step=2, outcome="committed", stall_s=0.001))
        tele(SaveEvent(step=3, outcome="committed", stall_s=0.001))
        tele.flush()
        tele.close()
    (line,) = [r for r in caplog.records if "closed" in r.getMessage()]
    assert line.levelno == logging.INFO and "closed by its owner" in line.getMessage()
    assert _steps(_read(tmp_path), "coci/stall_ms") == [1]


@needs_tensorboard
def test_close_closes_its_own_writer_and_drops_later_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After close() records are dropped with one warning and no new event file is opened."""
    tele = TensorBoardTelemetry(tmp_path)
    tele(SaveEvent(step=1, outcome="committed", stall_s=0.001))
    tele.close()
    tele.close()  # idempotent
    with caplog.at_level(logging.WARNING, logger="coci_core.telemetry.tensorboard"):
        tele(SaveEvent(step=2, outcome="committed"))
        tele(SaveEvent(step=3, outcome="committed"))
        tele.flush()
    assert len([r for r in caplog.records if "closed" in r.getMessage()]) == 1
    assert len(list(tmp_path.iterdir())) == 1
    assert _steps(_read(tmp_path), "coci/stall_ms") == [1]


@needs_tensorboard
def test_events_from_the_writer_thread(tmp_path: Path) -> None:
    """As a CheckpointManager listener it receives saves from the writer thread and writes
    every one."""
    tele = TensorBoardTelemetry(tmp_path / "tb")
    threads: list[str] = []

    def listener(event: Any) -> None:
        threads.append(threading.current_thread().name)
        tele(event)

    with CheckpointManager(tmp_path / "ckpt", keep_last=2, listeners=[listener]) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, {"w": torch.full((64,), float(step))})
        mgr.wait()
        mgr.restore()
    tele.close()
    assert "coci-persist" in threads
    assert threading.current_thread().name not in threads[:3]
    acc = _read(tmp_path / "tb")
    assert _steps(acc, "coci/stall_ms") == [100, 200, 300]
    assert all(e.value > 0 for e in acc.Scalars("coci/checkpoint_MB"))


@needs_tensorboard
def test_concurrent_records_from_many_threads(tmp_path: Path) -> None:
    """Saves from four threads, all at once, are all written, each exactly once."""
    tele = TensorBoardTelemetry(tmp_path)
    start = threading.Barrier(5)
    errors: list[BaseException] = []

    def saves(offset: int) -> None:
        try:
            start.wait()
            for i in range(50):
                tele(SaveEvent(step=4 * i + offset, outcome="committed", stall_s=0.001))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    workers = [threading.Thread(target=saves, args=(k,)) for k in range(4)]
    for w in workers:
        w.start()
    start.wait()
    for w in workers:
        w.join()
    tele.close()
    assert not errors
    acc = _read(tmp_path)
    assert sorted(_steps(acc, "coci/stall_ms")) == list(range(200))
    assert sorted(_steps(acc, "coci/persist_s")) == list(range(200))


def test_missing_or_conflicting_arguments() -> None:
    """Neither or both of log_dir and writer raise ConfigError naming them."""
    with pytest.raises(ConfigError, match="'log_dir' or 'writer' must be given"):
        TensorBoardTelemetry()
    with pytest.raises(ConfigError, match="'log_dir' and 'writer' cannot both"):
        TensorBoardTelemetry("runs", writer=object())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"log_dir": 5}, "'log_dir' must be a str or os.PathLike", id="int-dir"),
        pytest.param({"log_dir": ""}, "'log_dir' must be a non-empty path", id="empty-dir"),
        pytest.param({"log_dir": b"runs"}, "'log_dir' must be a str", id="bytes-dir"),
        pytest.param({"writer": object()}, "'writer' must be a SummaryWriter", id="writer"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any], match: str) -> None:
    """A log_dir that is not a path or a writer without the SummaryWriter methods raise
    ConfigError naming the parameter."""
    with pytest.raises(ConfigError, match=match):
        TensorBoardTelemetry(**kwargs)


@needs_tensorboard
def test_log_dir_that_is_a_file(tmp_path: Path) -> None:
    """A log_dir naming a file raises ConfigError naming log_dir, before writing anything."""
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match="'log_dir' must be a directory"):
        TensorBoardTelemetry(path)
    assert path.read_text() == "x"


class _ListWriter:
    """A SummaryWriter stand-in that keeps what it is given (needs no tensorboard)."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda t, r: t.record_plan(-1, r), "'step' must be >= 0", id="negative"),
        pytest.param(lambda t, r: t.record_plan(1.5, r), "'step' must be an integer", id="float"),
        pytest.param(lambda t, r: t.record_plan(True, r), "'step' must be an integer", id="bool"),
        pytest.param(lambda t, r: t.record_plan("3", r), "'step' must be an integer", id="str"),
        pytest.param(lambda t, r: t.record_plan(1, {}), "'report' must be a PlannerReport", id="r"),
        pytest.param(lambda t, r: t.record_loss(1, "0.5"), "'loss' must be a real", id="loss"),
        pytest.param(lambda t, r: t.record_loss(1, None), "'loss' must be a real", id="none"),
        pytest.param(
            lambda t, r: t.record_loss(1, torch.ones(2)), "'loss' must be a real", id="tensor"
        ),
        pytest.param(lambda t, r: t.record_loss(1, 1.0, [1.0]), "'fitted' must be", id="fitted"),
        pytest.param(lambda t, r: t("saved"), "'event' must be a SaveEvent", id="event"),
    ],
)
def test_bad_record_arguments(call: Any, match: str, reports: dict[int, PlannerReport]) -> None:
    """Bad steps, reports, losses and events raise ConfigError naming the parameter and write
    nothing."""
    writer = _ListWriter()
    tele = TensorBoardTelemetry(writer=writer)
    with pytest.raises(ConfigError, match=match):
        call(tele, reports[10])
    assert writer.scalars == []


def test_missing_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tensorboard, a log_dir raises ConfigError with the install hint; a given writer
    still works."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'coci\[tensorboard\]'"):
        TensorBoardTelemetry("runs")
    writer = _ListWriter()
    TensorBoardTelemetry(writer=writer)(SaveEvent(step=3, outcome="failed", stall_s=0.5))
    assert writer.scalars == [("coci/stall_ms", 500.0, 3)]


def test_import_does_not_load_tensorboard() -> None:
    """Importing coci_core.telemetry.tensorboard in a fresh interpreter loads neither tensorboard
    nor
    the planner."""
    code = (
        "import sys, coci_core.telemetry.tensorboard; "
        "print(sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', "
        "'coci_core.planner') if m in sys.modules))"
    )
    out = run(script(code), check=True)
    assert out.stdout.strip() == "[]"
