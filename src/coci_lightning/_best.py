"""``ckpt_path="best"`` for ``CociCheckpoint(monitor=...)``: the monitored value of each
committed save, by step, and the kept checkpoint with the lowest one (the highest for
``mode="max"``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from coci_core.training import SaveHandle, run_step_dir, step_dir_of

__all__ = ["SCORES_KEY", "MonitorScores"]

# in the callback's state: the monitored value of each committed save, by step
SCORES_KEY = "monitor_scores"


def monitored(metrics: Mapping[str, Any], monitor: str) -> float | None:
    """The value of ``monitor`` in ``metrics`` when it is a finite number, else None."""
    try:
        score = float(metrics[monitor])
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None
    return score if math.isfinite(score) else None


class MonitorScores:
    """The monitored value of each committed save of a run, by step. A save's value is the one
    logged when it is taken, replaced by a validation's at the same step (the planner saves at
    a step's end, before its validation)."""

    def __init__(self, *, maximize: bool = False) -> None:
        self.maximize = maximize  # mode="max": the highest value is best
        self.scores: dict[int, float] = {}
        self._saving: tuple[int, float] | None = None  # the save being taken
        self._validated: tuple[int, float] | None = None  # the validation after the last save

    def taking(self, step: int, score: float | None) -> None:
        """A save of ``step`` is being taken (its state is dumped next)."""
        self._saving = None if score is None else (step, score)

    def taken(self, handle: SaveHandle) -> None:
        """The save is on its way: its value counts once it commits."""
        saving, self._saving = self._saving, None
        if saving is None:
            return
        step, score = saving

        def record(h: SaveHandle) -> None:
            if h.event is not None and h.event.outcome == "committed":
                fresh = self._validated
                self.scores[step] = fresh[1] if fresh and fresh[0] == step else score

        handle.add_done_callback(record)

    def validated(self, step: int, score: float | None) -> None:
        """A validation at ``step``, the step saved last: its value is that save's."""
        if score is None:
            return
        self._validated = (step, score)
        if step in self.scores:  # already committed
            self.scores[step] = score

    def state(self) -> dict[str, float]:
        """For the callback's state: the committed values and the one of the save being
        taken (committed if that checkpoint is ever restored)."""
        scores = dict(self.scores)
        if self._saving is not None:
            scores[self._saving[0]] = self._saving[1]
        return {str(step): score for step, score in sorted(scores.items())}

    def load(self, state: Any) -> None:
        """The values a restored checkpoint's callback state holds (invalid entries dropped)."""
        if isinstance(state, dict):
            self.scores = {
                int(step): float(score)
                for step, score in state.items()
                if isinstance(step, str) and step.isdigit() and isinstance(score, (int, float))
            }

    def best(
        self,
        directory: Path | str,
        options_for: Callable[[str], Mapping[str, Any]],
        run: str | None = None,
    ) -> tuple[str, float] | None:
        """(the step directory, its value) of the kept checkpoint with the lowest value (the
        highest with ``maximize``; the newest of equals), or None; ``run``: whose checkpoint
        of a step two runs hold."""
        sign = -1.0 if self.maximize else 1.0
        for step, score in sorted(self.scores.items(), key=lambda it: (sign * it[1], -it[0])):
            path = str(run_step_dir(directory, step, run, options_for(str(directory))))
            if step_dir_of(path, options_for(path)) is not None:  # committed, still kept
                return path, score
        return None
