"""Fixed-interval policies (``every_n_steps``, ``epoch``): they need no measurement and save at
exactly the multiples of N from step 1, the run's last step included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["fixed_ahead", "fixed_interval_of", "fixed_window", "is_fixed_save"]

#: policy name -> the option that holds its fixed interval
_INTERVAL_OPTION = {"every_n_steps": "every_n_steps", "epoch": "steps_per_epoch"}


def fixed_interval_of(policy: str, options: Mapping[str, Any]) -> int | None:
    """The fixed interval of ``policy`` made with ``options``, or None if it has none."""
    key = _INTERVAL_OPTION.get(policy)
    return None if key is None else int(options[key])


def is_fixed_save(step: int, every: int) -> bool:
    """Whether ``step`` is a checkpoint at a fixed interval of ``every`` steps."""
    return step > 0 and step % every == 0


def fixed_ahead(every: int, now: int, total_steps: int | None, count: int) -> list[int]:
    """The next ``count`` multiples of ``every`` after step ``now`` (to the last step)."""
    first = (now // every + 1) * every
    last = first + (count - 1) * every
    if total_steps is not None:
        last = min(last, total_steps)
    return list(range(first, last + 1, every))


def fixed_window(step: int, every: int) -> list[int]:
    """The multiples of ``every`` around ``step`` that :meth:`Planner.explain` shows."""
    near = max(1, step // every - 1) * every
    return list(range(near, step + 2 * every + 1, every))
