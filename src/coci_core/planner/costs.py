"""Online profiling: robust running estimates of step, stall, persist and restart times, and
of what a save costs the training loop in all (``loop_cost_s``: its stall plus the slowdown of
the steps that overlap its persist, which is not free when training and the writer share CPU
cores)."""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from coci_core.knobs import COST_WINDOWS
from coci_core.planner.checks import check_nonnegative, check_optional_positive, check_positive

__all__ = ["COST_NAMES", "CostEstimate", "CostEstimator", "CostInputs"]

COST_NAMES = ("step_time_s", "stall_s", "persist_s", "restart_s", "loop_cost_s")
#: restart and stall times assumed before the first measured restore and save
DEFAULT_RESTART_S = 60.0
DEFAULT_STALL_S = 1.0


@dataclass(frozen=True, kw_only=True)
class CostEstimate:
    """One cost and its source: ``"user"``, ``"measured"``, ``"default"`` or ``"unknown"``."""

    value: float | None
    source: str


@dataclass(frozen=True, kw_only=True)
class CostInputs:
    """The user-given costs (each overrides its measurements) and the defaults assumed before
    the first measurement, checked by :meth:`check`."""

    step_time_s: float | None
    stall_s: float | None
    persist_s: float | None
    restart_s: float | None
    default_restart_s: float
    default_stall_s: float

    @classmethod
    def check(
        cls,
        *,
        step_time_s: float | None,
        stall_s: float | None,
        persist_s: float | None,
        restart_s: float | None,
        default_restart_s: float,
        default_stall_s: float,
    ) -> CostInputs:
        """The checked inputs, or ConfigError naming the bad one."""
        return cls(
            step_time_s=check_optional_positive("step_time_s", step_time_s),
            stall_s=check_optional_positive("stall_s", stall_s),
            persist_s=None if persist_s is None else check_nonnegative("persist_s", persist_s),
            restart_s=None if restart_s is None else check_nonnegative("restart_s", restart_s),
            default_restart_s=check_positive("default_restart_s", default_restart_s),
            default_stall_s=check_positive("default_stall_s", default_stall_s),
        )


class CostEstimator:
    """Running medians over recent samples; user-given values override measured ones.

    Thread-safe: ``add`` may be called from a background persist thread.
    """

    def __init__(self, inputs: CostInputs | None = None) -> None:
        inputs = inputs if inputs is not None else _DEFAULT_INPUTS
        self.inputs = inputs
        self._user = {
            "step_time_s": inputs.step_time_s,
            "stall_s": inputs.stall_s,
            "persist_s": inputs.persist_s,
            "restart_s": inputs.restart_s,
            "loop_cost_s": None,  # measured only
        }
        self._defaults = {"restart_s": inputs.default_restart_s, "stall_s": inputs.default_stall_s}
        self._samples: dict[str, deque[float]] = {
            k: deque(maxlen=COST_WINDOWS[k]) for k in COST_NAMES
        }
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> bool:
        """Record one measurement; ignore (and return False for) non-finite or negative ones."""
        try:
            x = float(seconds)
        except (TypeError, ValueError):
            return False
        if not math.isfinite(x) or x < 0:
            return False
        with self._lock:
            self._samples[name].append(x)
        return True

    def replace_last(self, name: str, seconds: float) -> float | None:
        """Replace the newest measurement of ``name`` by a better one of the same event (or
        add it); the value replaced, or None (a non-finite or negative one is ignored)."""
        try:
            x = float(seconds)
        except (TypeError, ValueError):
            return None
        if not math.isfinite(x) or x < 0:
            return None
        with self._lock:
            samples = self._samples[name]
            old = samples.pop() if samples else None
            samples.append(x)
        return old

    def get(self, name: str) -> CostEstimate:
        """The current estimate of ``name``."""
        user = self._user[name]
        if user is not None:
            return CostEstimate(value=user, source="user")
        with self._lock:
            data = list(self._samples[name])
        if data:
            return CostEstimate(value=float(np.median(data)), source="measured")
        if name in self._defaults:
            return CostEstimate(value=self._defaults[name], source="default")
        return CostEstimate(value=None, source="unknown")

    def snapshot(self) -> dict[str, CostEstimate]:
        """All estimates at once."""
        return {k: self.get(k) for k in COST_NAMES}

    def state_dict(self) -> dict[str, object]:
        """JSON-compatible state (recent samples only; user values come from the config)."""
        with self._lock:
            return {k: list(v) for k, v in self._samples.items()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore samples saved by :meth:`state_dict`."""
        with self._lock:
            for k in COST_NAMES:
                values = state.get(k, [])
                self._samples[k].clear()
                if isinstance(values, list):
                    self._samples[k].extend(float(x) for x in values)


_DEFAULT_INPUTS = CostInputs(
    step_time_s=None,
    stall_s=None,
    persist_s=None,
    restart_s=None,
    default_restart_s=DEFAULT_RESTART_S,
    default_stall_s=DEFAULT_STALL_S,
)
