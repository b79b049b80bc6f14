"""TensorBoardTelemetry: the scalars and layout it writes, read back with TensorBoard's reader."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager, ConfigError, RestoreEvent, SaveEvent
from coci_core.planner import Planner, PlannerReport
from coci_core.telemetry.tensorboard import LAYOUT, LAYOUT_TITLE, TensorBoardTelemetry

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed (pip install 'coci[tensorboard]')",
)

LAYOUT_TAG = "custom_scalars__config__"


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


def _layouts(acc: Any) -> list[Any]:
    """Every custom-scalars layout in the run, parsed."""
    from tensorboard.plugins.custom_scalar import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        layout_pb2,
    )

    assert LAYOUT_TAG in acc.PluginTagToContent("custom_scalars")
    layouts = []
    for event in acc.Tensors(LAYOUT_TAG):
        layout = layout_pb2.Layout()
        layout.ParseFromString(event.tensor_proto.string_val[0])
        layouts.append(layout)
    return layouts


def _as_shown(points: list[tuple[int, float]]) -> list[int]:
    """The steps TensorBoard's data server shows: a point at step s hides earlier-written ones
    at steps >= s."""
    shown: list[tuple[int, float]] = []
    for step, value in points:
        shown = [p for p in shown if p[0] < step] + [(step, value)]
    return [s for s, _ in shown]


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
    """Committed saves write every save series; a failed one its step and stall; a skipped one
    only its step."""
    with TensorBoardTelemetry(tmp_path) as tele:
        tele(
            SaveEvent(
                step=10,
                outcome="committed",
                stall_s=0.002,
                copy_s=0.001,
                persist_s=0.5,
                time_to_durable_s=0.502,
                bytes_written=4096,
            )
        )
        tele(SaveEvent(step=20, outcome="skipped", stall_s=0.0001))
        tele(
            SaveEvent(
                step=30,
                outcome="failed",
                stall_s=0.004,
                persist_s=0.1,
                time_to_durable_s=0.104,
                error="OSError: disk full",
            )
        )
        tele(
            SaveEvent(
                step=40,
                outcome="committed",
                stall_s=0.003,
                copy_s=0.002,
                persist_s=0.25,
                time_to_durable_s=0.253,
                bytes_written=8192,
            )
        )
    acc = _read(tmp_path)
    assert _series(acc, "coci/save/committed_step") == [(10, 10.0), (40, 40.0)]
    assert _series(acc, "coci/save/skipped_step") == [(20, 20.0)]
    assert _series(acc, "coci/save/failed_step") == [(30, 30.0)]
    assert _steps(acc, "coci/save/stall_ms") == [10, 30, 40]
    assert [e.value for e in acc.Scalars("coci/save/stall_ms")] == pytest.approx([2.0, 4.0, 3.0])
    assert _series(acc, "coci/save/bytes_written") == [(10, 4096.0), (40, 8192.0)]
    for tag, values in {
        "coci/save/copy_ms": [1.0, 2.0],
        "coci/save/persist_ms": [500.0, 250.0],
        "coci/save/time_to_durable_ms": [502.0, 253.0],
    }.items():
        assert _steps(acc, tag) == [10, 40], tag
        assert [e.value for e in acc.Scalars(tag)] == pytest.approx(values), tag


@needs_tensorboard
def test_restore_event(tmp_path: Path) -> None:
    """A restore writes its seconds and bytes read at the restored step."""
    with TensorBoardTelemetry(tmp_path) as tele:
        tele(RestoreEvent(step=1200, seconds=3.5, bytes_read=1 << 20, skipped_steps=(1300,)))
    acc = _read(tmp_path)
    assert _series(acc, "coci/restore/seconds") == [(1200, 3.5)]
    assert _series(acc, "coci/restore/bytes_read") == [(1200, float(1 << 20))]


@needs_tensorboard
def test_plan_series_from_a_real_planner(tmp_path: Path, reports: dict[int, PlannerReport]) -> None:
    """Each recorded plan writes its next step, interval, MTBF and plan-vs-Daly overheads at
    the step recorded."""
    with TensorBoardTelemetry(tmp_path) as tele:
        for step, report in reports.items():
            tele.record_plan(step, report)
    acc = _read(tmp_path)
    assert all(r.expected_overhead is not None and r.next_steps for r in reports.values())
    assert _series(acc, "coci/plan/next_step") == [
        (k, float(r.next_steps[0])) for k, r in reports.items()
    ]
    assert _series(acc, "coci/plan/mtbf_s") == [(k, 3600.0) for k in reports]
    assert _series(acc, "coci/plan/interval_steps") == [
        (k, float(r.interval_steps)) for k, r in reports.items() if r.interval_steps is not None
    ]
    fields = {
        "coci/overhead/plan_wall_s": "wall_s",
        "coci/overhead/daly_wall_s": "daly_wall_s",
        "coci/overhead/plan_objective_s": "objective_s",
        "coci/overhead/daly_objective_s": "daly_objective_s",
    }
    for tag, field in fields.items():
        assert _steps(acc, tag) == list(reports), tag
        expected = [getattr(r.expected_overhead, field) for r in reports.values()]
        assert [e.value for e in acc.Scalars(tag)] == pytest.approx(expected, rel=1e-6), tag
    # the first plan's upcoming steps are drawn once each, at their own step
    first = reports[10].next_steps
    assert _series(acc, "coci/plan/planned_step")[: len(first)] == [(s, float(s)) for s in first]
    # what TensorBoard shows of the planned steps ends with the last plan's steps
    shown = _as_shown(_series(acc, "coci/plan/planned_step"))
    last = [s for s in reports[399].next_steps if s > 399]
    assert shown[-len(last) :] == last


@needs_tensorboard
def test_planned_steps_written_once_and_rewritten_when_the_plan_moves(
    tmp_path: Path, reports: dict[int, PlannerReport]
) -> None:
    """A repeated plan adds nothing, a longer one its new steps, a moved one its steps from the
    first change; overdue steps are not drawn."""

    def plan(*steps: int) -> PlannerReport:
        return dataclasses.replace(reports[10], next_steps=steps)

    with TensorBoardTelemetry(tmp_path) as tele:
        tele.record_plan(50, plan(100, 200, 300))
        tele.record_plan(60, plan(100, 200, 300))  # the same plan: nothing new
        tele.record_plan(70, plan(100, 200, 300, 400))  # reaches further: 400
        tele.record_plan(80, plan(150, 300))  # moved: 150, 300
        tele.record_plan(160, plan(300, 450))  # 150 passed; 300 kept; 450 new
        tele.record_plan(200, plan(120, 300, 450))  # 120 is overdue: not drawn
    acc = _read(tmp_path)
    points = _series(acc, "coci/plan/planned_step")
    assert [s for s, _ in points] == [100, 200, 300, 400, 150, 300, 450]
    assert all(v == s for s, v in points)
    # 200 and 400 are hidden by the moved plan; 100 was written before the move and stays
    assert _as_shown(points) == [100, 150, 300, 450]
    assert _series(acc, "coci/plan/next_step")[-1] == (200, 120.0)


@needs_tensorboard
def test_loss_beside_fitted_loss(tmp_path: Path) -> None:
    """Observed losses are written at every record and fitted values only when given; numpy
    and tensor scalars are accepted and NaN is kept."""
    with TensorBoardTelemetry(tmp_path) as tele:
        tele.record_loss(1, 2.5, 2.4)
        tele.record_loss(2, np.float32(2.25), None)
        tele.record_loss(3, torch.tensor(2.0), fitted=np.float64(2.1))
        tele.record_loss(np.int64(4), float("nan"))
    acc = _read(tmp_path)
    observed = _series(acc, "coci/loss/observed")
    assert observed[:3] == [(1, 2.5), (2, 2.25), (3, 2.0)]
    assert observed[3][0] == 4
    assert math.isnan(observed[3][1])
    assert _steps(acc, "coci/loss/fitted") == [1, 3]
    assert [e.value for e in acc.Scalars("coci/loss/fitted")] == pytest.approx([2.4, 2.1])


@needs_tensorboard
def test_layout_named_coci_with_three_charts(
    tmp_path: Path, reports: dict[int, PlannerReport]
) -> None:
    """The run holds one custom-scalars layout: category "coci" with the multiline charts, each
    drawing tags the telemetry writes."""
    with TensorBoardTelemetry(tmp_path) as tele:
        tele(SaveEvent(step=5, outcome="committed", stall_s=0.01, persist_s=0.2))
        tele(SaveEvent(step=6, outcome="skipped"))
        tele(SaveEvent(step=7, outcome="failed", stall_s=0.01))
        tele.record_plan(399, reports[399])
        tele.record_loss(399, 0.8, reports[399].fitted_loss)
    acc = _read(tmp_path)
    (layout,) = _layouts(acc)
    (category,) = layout.category
    assert category.title == LAYOUT_TITLE == "coci"
    charts = {c.title: list(c.multiline.tag) for c in category.chart}
    assert list(charts) == ["planned vs actual", "cost", "loss fit", "compression"]
    assert charts == {title: list(tags) for title, tags in LAYOUT.items()}
    assert {"coci/plan/next_step", "coci/plan/planned_step", "coci/save/committed_step"} <= set(
        charts["planned vs actual"]
    )
    assert {
        "coci/save/stall_ms",
        "coci/save/persist_ms",
        "coci/save/time_to_durable_ms",
        "coci/overhead/plan_wall_s",
        "coci/overhead/daly_wall_s",
        "coci/overhead/plan_objective_s",
        "coci/overhead/daly_objective_s",
    } == set(charts["cost"])
    assert charts["loss fit"] == ["coci/loss/observed", "coci/loss/fitted"]
    assert charts["compression"] == ["coci/save/compression_ratio"]
    written = set(acc.Tags()["scalars"])
    assert {t for tags in charts.values() for t in tags} <= written


@needs_tensorboard
def test_existing_summary_writer_is_used_and_left_open(tmp_path: Path) -> None:
    """With a host's SummaryWriter, scalars and the layout (once, however many telemetries) go
    to its file, and close() leaves the writer usable."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    try:
        writer.add_scalar("host/loss", 1.0, 0)
        first = TensorBoardTelemetry(writer=writer)
        second = TensorBoardTelemetry(writer=writer)
        first.record_loss(1, 0.5)
        second(SaveEvent(step=1, outcome="committed"))
        first.close()
        second.close()
        writer.add_scalar("host/loss", 0.25, 2)  # still open
        writer.flush()
        assert len(list(tmp_path.iterdir())) == 1  # one event file: nothing reopened
        acc = _read(tmp_path)
        assert _series(acc, "host/loss") == [(0, 1.0), (2, 0.25)]
        assert _series(acc, "coci/loss/observed") == [(1, 0.5)]
        assert _series(acc, "coci/save/committed_step") == [(1, 1.0)]
        assert len(_layouts(acc)) == 1
    finally:
        writer.close()


@needs_tensorboard
def test_close_closes_its_own_writer_and_drops_later_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After close() records are dropped with one warning and no new event file is opened."""
    tele = TensorBoardTelemetry(tmp_path)
    tele.record_loss(1, 1.0)
    tele.close()
    tele.close()  # idempotent
    with caplog.at_level(logging.WARNING, logger="coci_core.telemetry.tensorboard"):
        tele.record_loss(2, 0.5)
        tele(SaveEvent(step=2, outcome="committed"))
        tele.flush()
    assert len([r for r in caplog.records if "closed" in r.getMessage()]) == 1
    assert len(list(tmp_path.iterdir())) == 1
    assert _series(_read(tmp_path), "coci/loss/observed") == [(1, 1.0)]


@needs_tensorboard
def test_events_from_the_writer_thread(tmp_path: Path) -> None:
    """As a CheckpointManager listener it receives saves from the writer thread and writes
    every one, and the restore too."""
    tele = TensorBoardTelemetry(tmp_path / "tb")
    threads: list[str] = []

    def listener(event: Any) -> None:
        threads.append(threading.current_thread().name)
        tele(event)

    with CheckpointManager(tmp_path / "ckpt", keep_last=2, listeners=[listener]) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, {"w": torch.full((64,), float(step))})
            tele.record_loss(step, 1.0 / step)  # the training thread, meanwhile
        mgr.wait()
        mgr.restore()
    tele.close()
    assert "coci-persist" in threads
    assert threading.current_thread().name not in threads[:3]
    acc = _read(tmp_path / "tb")
    assert _steps(acc, "coci/save/committed_step") == [100, 200, 300]
    assert all(e.value > 0 for e in acc.Scalars("coci/save/bytes_written"))
    assert _steps(acc, "coci/loss/observed") == [100, 200, 300]
    assert _steps(acc, "coci/restore/seconds") == [300]


@needs_tensorboard
def test_concurrent_records_from_many_threads(tmp_path: Path) -> None:
    """Saves from four threads and losses from the main thread, all at once, are all written,
    each exactly once."""
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
    for step in range(200):
        tele.record_loss(step, 1.0)
    for w in workers:
        w.join()
    tele.close()
    assert not errors
    acc = _read(tmp_path)
    assert sorted(_steps(acc, "coci/save/committed_step")) == list(range(200))
    assert sorted(_steps(acc, "coci/save/stall_ms")) == list(range(200))
    assert _steps(acc, "coci/loss/observed") == list(range(200))


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
        self.layouts: list[dict[str, Any]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def add_custom_scalars(self, layout: dict[str, Any]) -> None:
        self.layouts.append(layout)

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
    assert len(writer.layouts) == 1


def test_missing_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tensorboard, a log_dir raises ConfigError with the install hint; a given writer
    still works."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'coci\[tensorboard\]'"):
        TensorBoardTelemetry("runs")
    writer = _ListWriter()
    TensorBoardTelemetry(writer=writer).record_loss(3, 0.5)
    assert writer.scalars == [("coci/loss/observed", 0.5, 3)]


def test_import_does_not_load_tensorboard() -> None:
    """Importing coci_core.telemetry.tensorboard in a fresh interpreter loads neither tensorboard
    nor
    the planner."""
    code = (
        "import sys, coci_core.telemetry.tensorboard; "
        "print(sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', "
        "'coci_core.planner') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
