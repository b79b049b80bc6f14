"""What a run's saves did, in one line: a line per save (``verbose``) and the end summary.

:class:`SaveSummary` adds up the :class:`~coci_core.telemetry.SaveEvent` s one rank sees; the
:class:`~coci_core.training.checkpointer.Checkpointer` feeds it every event, and the framework
adapters
log :meth:`SaveSummary.line` once at the end of training (rank 0).
"""

from __future__ import annotations

import threading

from coci_core.telemetry import SaveEvent

__all__ = ["SaveSummary", "compression_ratio", "save_line"]


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g} MB"


def compression_ratio(raw_bytes: float | None, written: float | None, compressed: bool) -> float:
    """How many times smaller a save's data was stored: 1.0 for a raw (uncompressed) one,
    whose files also hold padding and the manifest; else its bytes in memory over the bytes
    written (NaN when unknown)."""
    if not compressed:
        return 1.0
    if not raw_bytes or not written:
        return float("nan")
    return float(raw_bytes) / float(written)


def save_line(event: SaveEvent) -> str:
    """One line for one save: step, stall (ms), bytes written (MB), compression, durability."""
    if event.outcome == "skipped":
        why = event.error or "the previous save was still being written"
        stall = f"stall {event.stall_s * 1e3:.1f} ms"
        return f"coci: step {event.step} not saved (skipped: {why}); {stall}"
    if event.outcome == "failed":
        return f"coci: save of step {event.step} failed: {event.error}"
    compression = ""
    if event.compressed and event.bytes_written > 0:
        ratio = compression_ratio(event.raw_bytes, event.bytes_written, event.compressed)
        compression = f", compressed {ratio:.2f}x"
    return (
        f"coci: step {event.step} saved: stall {event.stall_s * 1e3:.1f} ms, "
        f"{_mb(event.bytes_written)} written{compression}, durable "
        f"{event.time_to_durable_s * 1e3:.0f} ms after the save began"
    )


class SaveSummary:
    """Counts and totals of one rank's saves (thread-safe: commits arrive on the writer's
    thread, skips on the training thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.committed = 0
        self.skipped = 0
        self.failed = 0
        self.stall_s = 0.0
        self.bytes_written = 0
        self.raw_bytes = 0
        self.compressed = False  # some committed save was stored compressed
        self.newest_step: int | None = None

    def add(self, event: SaveEvent) -> None:
        """Count one save event."""
        with self._lock:
            self.stall_s += event.stall_s
            if event.outcome == "committed":
                self.committed += 1
                self.bytes_written += event.bytes_written
                self.raw_bytes += event.raw_bytes
                self.compressed = self.compressed or event.compressed
                if self.newest_step is None or event.step > self.newest_step:
                    self.newest_step = event.step
            elif event.outcome == "skipped":
                self.skipped += 1
            else:
                self.failed += 1

    def line(self, *, world_size: int = 1) -> str:
        """The end-of-training summary, e.g. ``coci: 3 checkpoints committed (newest step 40),
        total stall 0.012 s, 4.2 MB written``; skipped and failed saves only when there were
        some; with several ranks the bytes are this rank's share."""
        with self._lock:
            if self.committed:
                noun = "checkpoint" if self.committed == 1 else "checkpoints"
                newest = f"newest step {self.newest_step}"
                parts = [f"coci: {self.committed} {noun} committed ({newest})"]
            else:
                parts = ["coci: no checkpoint committed"]
            if self.skipped:
                parts.append(f"{self.skipped} skipped")
            if self.failed:
                parts.append(f"{self.failed} failed")
            parts.append(f"total stall {self.stall_s:.3f} s")
            written = f"{_mb(self.bytes_written)} written"
            if world_size > 1:
                written += " (this rank's share)"
            ratio = compression_ratio(self.raw_bytes, self.bytes_written, self.compressed)
            if self.compressed and ratio > 1:
                written += f", compressed {ratio:.2f}x"
            parts.append(written)
            return ", ".join(parts)
