"""What the remote tier costs, measured online: the inputs of the two-level plan
(:func:`~coci_core.planner.two_level.plan_two_levels`) that the planner does not already have.

An upload runs on its own thread, so its cost to training is not a stall but the slowdown of
the steps it overlaps (it shares CPU cores, memory bandwidth and the network with them): the
excess of those steps over the usual step time, summed over the upload's duration. A restore
from the remote tier is timed like any restore; until one is seen, it is taken as a local
restart plus one more upload's duration (the bytes come back over the same link).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import numpy as np

from coci_core.knobs import UPLOAD_COST_WINDOW, UPLOAD_STEPS_KEPT

__all__ = ["UploadCosts"]


class UploadCosts:
    """Running medians of the upload time, its cost to the training loop and the restart time
    from the remote tier (thread-safe: uploads are reported from the upload thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, float]] = deque(maxlen=UPLOAD_STEPS_KEPT)
        self._upload_s: deque[float] = deque(maxlen=UPLOAD_COST_WINDOW)
        self._loop_cost_s: deque[float] = deque(maxlen=UPLOAD_COST_WINDOW)
        self._restart_s: deque[float] = deque(maxlen=UPLOAD_COST_WINDOW)

    def step(self, step_time_s: float, now: float | None = None) -> None:
        """A training step that took ``step_time_s`` ended (at ``now``, monotonic)."""
        with self._lock:
            self._steps.append((time.monotonic() if now is None else now, step_time_s))

    def upload(self, seconds: float, usual_step_s: float | None, now: float | None = None) -> None:
        """An upload that took ``seconds`` ended (at ``now``): charge it the excess over
        ``usual_step_s`` of the steps that ended while it ran."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        end = time.monotonic() if now is None else now
        with self._lock:
            self._upload_s.append(seconds)
            if usual_step_s is None:
                return
            excess = sum(st - usual_step_s for t, st in self._steps if end - seconds <= t <= end)
            self._loop_cost_s.append(max(0.0, excess))

    def remote_restore(self, seconds: float) -> None:
        """A restore from the remote tier took ``seconds``."""
        if math.isfinite(seconds) and seconds >= 0:
            with self._lock:
                self._restart_s.append(seconds)

    @property
    def uploads(self) -> int:
        """Uploads measured so far (at most the last UPLOAD_COST_WINDOW)."""
        with self._lock:
            return len(self._upload_s)

    def upload_s(self) -> float | None:
        return self._median(self._upload_s)

    def loop_cost_s(self) -> float | None:
        """What one upload costs the training loop (None before one was charged)."""
        return self._median(self._loop_cost_s)

    def remote_restart_s(self, local_restart_s: float) -> float:
        """The restart time from the remote tier: measured, else a local restart plus an
        upload's duration."""
        measured = self._median(self._restart_s)
        if measured is not None:
            return measured
        return local_restart_s + (self.upload_s() or 0.0)

    def _median(self, samples: deque[float]) -> float | None:
        with self._lock:
            data = list(samples)
        return float(np.median(data)) if data else None
