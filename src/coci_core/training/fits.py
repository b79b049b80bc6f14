"""A saved state that does not fit the run resuming from it, said as such: an optimizer state
checked against the optimizer it is about to be loaded into, so that a resume with another
optimizer class (AdamW's state into SGD) says so, rather than failing inside torch
(``KeyError: 'momentum'`` at the first step, or ``KeyError: 'step'`` in ``load_state_dict``);
and a model's ``load_state_dict`` error (another architecture) with what to do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coci_core.errors import ConfigError

#: the keys of a parameter group that are not the optimizer's settings
_NOT_SETTINGS = frozenset({"params", "param_names", "initial_lr"})


def check_optimizer_fits(optimizer: Any, saved: object, *, fix: str) -> None:
    """Raise when ``saved`` (an optimizer's ``state_dict()``) was written by another kind of
    optimizer than ``optimizer``: one of its parameter groups lacks settings that
    ``optimizer``'s group takes *and* holds settings it does not take. A group that only
    lacks settings (a newer torch adds one, which ``load_state_dict`` fills in) or only has
    more passes, and so does anything that is not a state dict of groups (torch's own
    ``load_state_dict`` names that).

    Args:
        fix: what to do instead, in words (e.g. where to start a new run).

    Raises:
        ConfigError: naming the optimizer, the settings on each side and ``fix``.
    """
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    current = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not isinstance(current, list):
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # an AcceleratedOptimizer's own
    name = type(inner).__name__
    for index, (mine, theirs) in enumerate(zip(current, groups, strict=False)):
        if not isinstance(mine, Mapping) or not isinstance(theirs, Mapping):
            continue
        missing = sorted(set(mine) - set(theirs) - _NOT_SETTINGS, key=str)
        extra = sorted(set(theirs) - set(mine) - _NOT_SETTINGS, key=str)
        if missing and extra:
            raise ConfigError(
                f"the checkpoint's optimizer state does not fit this run's optimizer ({name}): "
                f"its parameter group {index} holds {', '.join(map(str, extra))}, which {name} "
                f"does not take, and lacks {', '.join(map(str, missing))}, which {name} needs: "
                f"it was saved with another optimizer. Resume with the optimizer the "
                f"checkpoint was saved with, or {fix}"
            )


def model_misfit(model: Any, error: Exception, *, fix: str) -> ConfigError:
    """The error to raise when ``model.load_state_dict`` of a checkpoint's weights raised
    ``error`` (torch's "Missing key(s)", "size mismatch"): it names the model, keeps the
    first of torch's lines (cut at 600 characters) and says what to do."""
    model = getattr(model, "module", model)  # a DDP wrapper's own
    said = str(error).strip()
    said = said if len(said) <= 600 else said[:600] + " ..."
    return ConfigError(
        f"the checkpoint's weights do not fit this run's model ({type(model).__name__}): "
        f"{said}\nIt was saved from another model (another architecture or config). Resume "
        f"with the model it was saved with, or {fix}"
    )
