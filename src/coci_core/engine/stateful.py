"""The Stateful protocol: anything with ``state_dict`` and ``load_state_dict``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Models, optimizers, schedulers, samplers, the planner: objects that save and load state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...
