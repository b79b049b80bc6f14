"""The Stateful protocol: anything with ``state_dict`` and ``load_state_dict``; and loading a
restored state into such objects (``restore(into=...)``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from coci_core.errors import ConfigError, StateMismatchError

__all__ = ["Stateful", "load_into"]


@runtime_checkable
class Stateful(Protocol):
    """Models, optimizers, schedulers, samplers, the planner: objects that save and load state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def load_into(state: Mapping[str, Any], into: Mapping[str, Stateful], *, partial: bool) -> None:
    """Load each object of ``into``, in the sorted order of the keys: each rank may list them
    in another order, and a ``load_state_dict`` that runs collectives (``set_state_dict`` of
    a sharded model) must run in the same order on every rank."""
    missing = [key for key in into if key not in state]
    if missing and not partial:
        raise StateMismatchError(
            f"the restored state has no {missing} (pass partial=True to load the rest); it "
            f"has {sorted(map(str, state))}",
            missing=[str(k) for k in missing],
        )
    for key in sorted(into, key=str):
        target = into[key]
        if not hasattr(target, "load_state_dict"):
            raise ConfigError(f"'into[{key!r}]' has no load_state_dict: {type(target).__name__}")
        if key not in state:
            continue
        if partial and isinstance(target, torch.nn.Module):
            target.load_state_dict(state[key], strict=False)
        else:
            target.load_state_dict(state[key])
