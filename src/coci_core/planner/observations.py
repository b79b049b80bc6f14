"""What the planner measures of a run: losses (bounded), step, save and restore costs, what a
save costs the training loop, failures and elapsed time, and the saves it asked for."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from coci_core.knobs import CHARGED_STEPS_MAX, FIRST_LOSSES_KEPT, LOSS_BINS_MAX, MIN_TIMED_STEPS
from coci_core.planner.costs import CostEstimator
from coci_core.planner.model import estimate_mtbf_s
from coci_core.planner.settings import PlannerSettings

__all__ = ["LossBuffer", "RunObservations"]

_clock = time.monotonic


@dataclass
class _WallClock:
    """This process's wall clock from its first timed step (monotonic seconds)."""

    first: float
    last: float
    step_s: float = 0.0  # the step times given since the first
    saves_s: float = 0.0  # the saves' stalls and the slowdowns they caused
    periods: int = 0  # timed steps since the first

    def outside_s(self) -> float:
        """What neither the step times nor the saves account for."""
        return max(0.0, self.last - self.first - self.step_s - self.saves_s)


class LossBuffer:
    """Losses aggregated in chunks of a doubling width (bounded memory, JSON state)."""

    def __init__(self) -> None:
        self.width = 1
        self.origin: int | None = None
        self.chunks: list[list[float]] = []  # [chunk index, sum step, sum loss, count]

    def add(self, step: int, loss: float) -> None:
        if self.origin is None:
            self.origin = step
        idx = (step - self.origin) // self.width
        if self.chunks and self.chunks[-1][0] == idx:
            c = self.chunks[-1]
            c[1] += step
            c[2] += loss
            c[3] += 1
            return
        self.chunks.append([float(idx), float(step), loss, 1.0])
        if len(self.chunks) > LOSS_BINS_MAX:
            self._merge()

    def _merge(self) -> None:
        self.width *= 2
        merged: dict[int, list[float]] = {}
        for idx, ss, sl, n in self.chunks:
            key = int(idx) // 2
            if key in merged:
                m = merged[key]
                m[1] += ss
                m[2] += sl
                m[3] += n
            else:
                merged[key] = [float(key), ss, sl, n]
        self.chunks = [merged[k] for k in sorted(merged)]

    def arrays(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        if not self.chunks:
            return np.zeros(0), np.zeros(0)
        arr = np.asarray(self.chunks)
        return arr[:, 1] / arr[:, 3], arr[:, 2] / arr[:, 3]

    def count(self) -> int:
        return int(sum(c[3] for c in self.chunks))

    def state_dict(self) -> dict[str, object]:
        return {
            "width": self.width,
            "origin": self.origin,
            "chunks": [list(c) for c in self.chunks],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.width = int(state["width"])
        self.origin = None if state["origin"] is None else int(state["origin"])
        self.chunks = [[float(x) for x in c] for c in state["chunks"]]


class RunObservations:
    """The run as observed: fed by ``Planner.observe``/``record_save``/``record_restore``
    (``record_save`` from any thread: ``lock`` guards what it shares)."""

    def __init__(self, settings: PlannerSettings, costs: CostEstimator) -> None:
        self.settings = settings
        self.costs = costs
        self.lock = threading.Lock()
        self.losses = LossBuffer()
        self.first_losses: list[list[float]] = []  # raw, for coci_paper
        self.skipped = 0
        self.observed = 0
        self.last_step: int | None = None
        self.elapsed_s = 0.0
        self.failures = 0
        self.last_true = -1  # the last step should_save answered True for
        self.exclude_next = False  # the next step time includes a save: not a step time
        # The save being charged for its cost to the loop: [its stall (None until its persist
        # ended), excess step time so far, steps counted].
        self.charge: list[Any] | None = None
        # What the step times miss (validation, logging, data waits between timed steps) is
        # work too: a failure loses it, and failures strike during it.
        self.wall: _WallClock | None = None
        self.new_costs = False  # a save's cost was measured since the last check

    def observe(self, k: int, loss: float | None, step_time_s: float | None) -> None:
        """Record step ``k``'s loss and time; skip (and count) NaN/inf losses, ignore odd times."""
        self.observed += 1
        if loss is not None:
            try:
                x = float(loss)
            except (TypeError, ValueError):
                x = math.nan
            if math.isfinite(x):
                self.losses.add(k, x)
                if len(self.first_losses) < FIRST_LOSSES_KEPT:
                    self.first_losses.append([float(k), x])
            else:
                self.skipped += 1
        if step_time_s is not None:
            with self.lock:
                exclude = self.exclude_next
                self.exclude_next = False
            try:
                st = float(step_time_s)
            except (TypeError, ValueError):
                st = math.nan
            if math.isfinite(st) and st >= 0:
                now = _clock()
                with self.lock:
                    self.elapsed_s += st
                    if self.wall is None:
                        self.wall = _WallClock(now, now)
                    else:
                        self.wall.last = now
                        self.wall.step_s += st
                        self.wall.periods += 1
                if self.charge is not None:
                    self._charge_step(st)
                if not exclude:
                    self.costs.add("step_time_s", st)
        self.last_step = k

    def mark_save(self, k: int) -> None:
        """``should_save(k)`` answered True: remember it, and charge the save's cost."""
        self.last_true = k
        self.exclude_next = True
        with self.lock:
            self.charge = [None, 0.0, 0]

    def record_save(
        self,
        stall_s: float | None,
        persist_s: float | None,
        unobserved_stall_s: float | None,
    ) -> None:
        """See :meth:`Planner.record_save`."""
        if stall_s is not None:
            self.costs.add("stall_s", stall_s)
            with contextlib.suppress(TypeError, ValueError), self.lock:
                stall = float(stall_s)
                if math.isfinite(stall) and stall > 0:
                    self.elapsed_s += stall
                    if self.wall is not None:
                        self.wall.saves_s += stall
        if persist_s is not None:
            self.costs.add("persist_s", persist_s)
        self.new_costs = True
        with self.lock:
            self.exclude_next = True
            if self.charge is not None and self.charge[0] is None:
                outside = stall_s if unobserved_stall_s is None else unobserved_stall_s
                with contextlib.suppress(TypeError, ValueError):
                    self.charge[0] = max(0.0, float(outside or 0.0))

    def _charge_step(self, step_time_s: float) -> None:
        """Charge a step that overlapped a save's persist with its excess over the usual step
        time; once the persist has ended (this step included), record the save's loop cost."""
        tau = self.costs.get("step_time_s").value
        with self.lock:
            charge = self.charge
            if charge is None or tau is None:
                return
            charge[1] += step_time_s - tau
            charge[2] += 1
            if charge[0] is None and charge[2] < CHARGED_STEPS_MAX:
                return
            self.charge = None
        if charge[0] is not None:  # else the save never committed: nothing to learn
            self.costs.add("loop_cost_s", max(charge[0], charge[0] + charge[1]))
            self.new_costs = True
            with self.lock:
                if self.wall is not None and math.isfinite(charge[1]):
                    self.wall.saves_s += max(0.0, charge[1])

    def outside_s(self) -> float:
        """The wall time of this process since its first timed step that neither the step
        times nor the saves account for."""
        with self.lock:
            return 0.0 if self.wall is None else self.wall.outside_s()

    def wall_step_s(self) -> float | None:
        """The mean wall time per step in this process, saves left out (None before
        ``MIN_TIMED_STEPS`` timed steps): step time and what falls between steps."""
        with self.lock:
            w = self.wall
            if w is None or w.periods < MIN_TIMED_STEPS:
                return None
            return max(0.0, w.last - w.first - w.saves_s) / w.periods

    def close_wall(self) -> None:
        """End the wall-clock window (a restore, a loaded state: what follows is not a
        step), keeping its outside time in ``elapsed_s``."""
        outside = self.outside_s()
        with self.lock:
            self.elapsed_s += outside
            self.wall = None

    def record_restore(self, seconds: float, *, failure: bool = True) -> None:
        """One more failure (unless ``failure`` is False), and its measured restore time."""
        self.close_wall()
        if self.costs.add("restart_s", seconds):
            self.elapsed_s += float(seconds)
        self.failures += 1 if failure else 0

    def record_restart(self, seconds: float) -> None:
        """The whole restart of the last restore (process start to the first step), which
        replaces its restore time as the restart cost."""
        before = self.costs.replace_last("restart_s", seconds)
        if before is not None:
            with self.lock:
                self.elapsed_s += max(0.0, float(seconds) - before)

    def mtbf(self) -> tuple[float, str]:
        """MTBF planned with: per node if ``nodes`` is a function, else for the whole job."""
        s = self.settings
        if s.mtbf_s is not None:
            nodes = 1 if callable(s.nodes) else s.nodes
            return s.mtbf_s / nodes, "user"
        src = "estimated" if self.failures else "default"
        return estimate_mtbf_s(
            failures=self.failures,
            elapsed_s=self.elapsed_s + self.outside_s(),
            prior_mtbf_s=s.default_mtbf_s,
        ), src

    def plan_inputs(self) -> dict[str, float] | None:
        """The costs and MTBF to plan with, or None before a step time is known."""
        snap = self.costs.snapshot()
        step_t = snap["step_time_s"].value
        if snap["step_time_s"].source == "measured":
            # the median of the step times leaves out what falls between them (validation,
            # logging, waits) and rare long steps; a failure loses that work too
            wall = self.wall_step_s()
            if wall is not None and step_t is not None:
                step_t = max(step_t, wall)
        if step_t is None or step_t <= 0:
            return None
        stall = snap["stall_s"].value
        loop_cost = snap["loop_cost_s"].value
        if stall is not None and loop_cost is not None and snap["stall_s"].source != "user":
            # what a checkpoint costs is the training time it takes, not only its stall
            stall = max(stall, loop_cost)
        persist = snap["persist_s"].value
        return {
            "step_time_s": step_t,
            "stall_s": stall if stall else 1e-6,
            "persist_s": persist if persist is not None else 0.0,
            "restart_s": snap["restart_s"].value or 0.0,
            "mtbf_s": self.mtbf()[0],
        }
