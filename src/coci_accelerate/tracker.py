"""CociTracker: Accelerate's metrics in, for coci's planner (a real GeneralTracker)."""

from __future__ import annotations

import threading
from typing import Any

from accelerate.tracking import GeneralTracker

__all__ = ["CociTracker"]


class CociTracker(GeneralTracker):
    """Takes the loss from ``accelerator.log(...)`` and hands it to coci's planner.

    Accelerate runs trackers on the main process only; ``CociCheckpointer`` shares the save
    decisions with the other processes. Use it in ``log_with`` (an instance, or the name
    ``"coci"``).

    Args:
        run_name: ignored (Accelerate passes the project name to trackers it creates by name).
        loss_key: the logged value to use as the loss.
    """

    name = "coci"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str | None = None, *, loss_key: str = "loss", **_: Any) -> None:
        super().__init__()
        if not isinstance(loss_key, str) or not loss_key:
            from coci_core.errors import ConfigError

            raise ConfigError(f"'loss_key' must be a non-empty string: {loss_key!r}")
        self.run_name = run_name
        self.loss_key = loss_key
        self.config: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._losses: dict[int, float] = {}
        self._last: tuple[int | None, float] | None = None

    @property
    def tracker(self) -> CociTracker:
        """The tracking object (this tracker: it has no external run)."""
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Keep the run's configuration (shown by nothing yet; kept for completeness)."""
        self.config = dict(values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values[loss_key]`` for ``step`` (other values and odd losses are ignored)."""
        value = values.get(self.loss_key)
        try:
            loss = float(value.item() if hasattr(value, "item") else value)  # type: ignore[union-attr,arg-type]
        except (TypeError, ValueError):
            return
        with self._lock:
            self._last = (step, loss)
            if step is not None:
                self._losses[int(step)] = loss
                if len(self._losses) > 1024:  # never grows without bound if nobody reads it
                    self._losses.pop(next(iter(self._losses)))

    def pop_loss(self, step: int) -> float | None:
        """The loss logged for ``step`` (or, if none was logged with a step, the latest)."""
        with self._lock:
            if step in self._losses:
                loss = self._losses.pop(step)
                for old in [s for s in self._losses if s < step]:
                    del self._losses[old]
                return loss
            if self._last is not None and self._last[0] is None:
                loss = self._last[1]
                self._last = None
                return loss
        return None
