"""The end-of-training summary line counts committed, skipped and failed saves."""

from __future__ import annotations

from pathlib import Path

from coci_core import CheckpointManager
from coci_core.telemetry import SaveEvent
from coci_core.telemetry.summary import SaveSummary, save_line


def test_summary_counts_every_outcome() -> None:
    summary = SaveSummary()
    assert summary.line() == "coci: no checkpoint committed, total stall 0.000 s, 0 MB written"
    summary.add(
        SaveEvent(
            step=5, outcome="committed", stall_s=0.25, bytes_written=2_000_000, raw_bytes=2_000_000
        )
    )
    summary.add(
        SaveEvent(
            step=10,
            outcome="committed",
            stall_s=0.5,
            bytes_written=1_000_000,
            raw_bytes=3_000_000,
            compressed=True,
        )
    )
    summary.add(SaveEvent(step=12, outcome="skipped", stall_s=0.25))
    summary.add(SaveEvent(step=15, outcome="failed", error="OSError: disk full"))
    assert summary.line(world_size=2) == (
        "coci: 2 checkpoints committed (newest step 10), 1 skipped, 1 failed, total stall "
        "1.000 s, 3 MB written (this rank's share), compressed 1.67x"
    )


def test_save_line() -> None:
    event = SaveEvent(
        step=7,
        outcome="committed",
        stall_s=0.0123,
        bytes_written=1_500_000,
        raw_bytes=3_000_000,
        compressed=True,
        time_to_durable_s=0.2,
    )
    assert save_line(event) == (
        "coci: step 7 saved: stall 12.3 ms, 1.5 MB written, compressed 2.00x, durable 200 ms "
        "after the save began"
    )


def test_a_skip_for_another_reason_than_a_busy_writer_says_why(tmp_path: Path) -> None:
    """A skip that is not ``on_busy="skip"`` (the checkpoint the run resumed from, a skip the
    user records) says its reason in the event and the verbose line; a busy writer's skip
    keeps its own words."""
    events: list[SaveEvent] = []
    with CheckpointManager(tmp_path, listeners=[events.append]) as mgr:
        mgr.skip(7, "it is the checkpoint this run resumed from")
    (event,) = events
    assert (
        event.outcome == "skipped" and event.error == "it is the checkpoint this run resumed from"
    )
    assert save_line(event).startswith(
        "coci: step 7 not saved (skipped: it is the checkpoint this run resumed from); stall "
    )
    busy = SaveEvent(step=8, outcome="skipped")
    assert "skipped: the previous save was still being written" in save_line(busy)
