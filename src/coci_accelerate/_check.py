"""Whether a checkpoint of ``CociCheckpointer`` holds what ``resume()`` puts back, before it is
taken.

A checkpoint's checksums say that it is what was committed, not that what was committed is the
adapter's: a manifest edited and resealed (its checksum computed again) passes them.
``resume()`` hands what it read to ``random.setstate``, ``numpy.random.set_state``,
``torch.set_rng_state`` and Accelerate's counters, after the models were loaded: a forged value
raised their own errors there (on the forged process only, while the others trained on), or
became the step to train from. :func:`check_saved` runs inside the restore, on the state each
process read (its own random states included): a state that does not fit is a
:class:`~coci_core.errors.CorruptCheckpointError`, so every process passes over that step
together and falls back to the newest step intact for all of them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from coci_accelerate._state import LAYOUT, PROCESS_KEY, mismatch_error, saved_none
from coci_core.errors import CorruptCheckpointError
from coci_core.training import UnfitRandomState, check_planner_state, check_saved_random_states

__all__ = ["check_saved"]

_MAX_INT = 2**63 - 1


class _Unfit(Exception):
    """A part of the saved state is not what the adapter writes (the message says which)."""


def _int(value: Any, low: int = 0) -> bool:
    return type(value) is int and low <= value <= _MAX_INT


def check_saved(
    step: int,
    state: Any,
    process_index: int,
    registered: Sequence[str] | None = None,
    *,
    stateless: Collection[int] = (),
) -> None:
    """``state``, read for ``step`` by process ``process_index``, holds what ``resume()`` puts
    back, each of its type (a state of another adapter is left to the layout check).
    ``registered``: the names of the objects this run registered for checkpointing, whose
    states this process's own state must hold as many of (said here, inside the restore, so
    that every process raises it: a count forged on one process only was that process's error
    alone, after the restore, while the others trained on into a collective), each with a
    state of its own except those at ``stateless`` (the checkpointer itself, whose state is
    the shared ``coci``: None in the process's list).

    Raises:
        CorruptCheckpointError: it does not (a resealed, forged manifest).
        CheckpointError: this process saved another number of registered objects.
    """
    if not isinstance(state, dict) or state.get("layout") != LAYOUT:
        return
    try:
        _check(state, process_index, registered, stateless)
    except _Unfit as e:
        raise CorruptCheckpointError(
            f"step {step} does not hold a state that CociCheckpointer wrote: {e}", step=step
        ) from None


def _check(
    state: dict[str, Any],
    process_index: int,
    registered: Sequence[str] | None,
    stateless: Collection[int],
) -> None:
    for name, low in (("completed_steps", 0), ("accelerate_step", 0), ("num_processes", 1)):
        if name in state and not _int(state[name], low):
            raise _Unfit(f"{name} is {_shown(state[name])}, not an integer >= {low}")
    for name in ("models", "optimizers", "schedulers", "dataloaders"):
        if not isinstance(state.get(name), list):
            raise _Unfit(f"{name} is not a list")
    for i, loader in enumerate(state["dataloaders"]):
        if not isinstance(loader, dict) or not _int(loader.get("iteration", 0)):
            raise _Unfit(f"dataloaders[{i}] is not a loader's position")
    coci = state.get("coci", {})
    if not isinstance(coci, dict):
        raise _Unfit("coci's own state is not a dict")
    why = None if coci.get("planner") is None else check_planner_state(coci["planner"])
    if why is not None:
        raise _Unfit(f"coci's planner state cannot be loaded ({why})")
    if "per_process" in state:  # written before every process wrote its own share
        own = state["per_process"]
        mine = own[process_index] if isinstance(own, list) and process_index < len(own) else None
    else:
        mine = state.get(PROCESS_KEY)
    if mine is None:
        if process_index < state.get("num_processes", 0):  # every process writes its own
            raise _Unfit(f"process {process_index}'s own state is missing")
        return  # said by resume(), naming the process
    if not isinstance(mine, dict) or not isinstance(mine.get("rng"), dict):
        raise _Unfit(f"process {process_index}'s own state holds no random states")
    custom = mine.get("custom", [])
    if not isinstance(custom, list):
        raise _Unfit(f"process {process_index}'s registered objects are not a list")
    none = mine.get("custom_none", [])
    if not isinstance(none, list) or any(
        type(i) is not int or not 0 <= i < len(custom) or custom[i] is not None for i in none
    ):
        raise _Unfit(
            f"process {process_index}'s registered objects whose state was None are "
            f"{_shown(none)}, not places of None in its {len(custom)} states"
        )
    if registered is not None and len(custom) != len(registered):
        names = ", ".join(registered)
        raise mismatch_error(
            [f"registered objects: {len(custom)} at the save, {len(registered)} now ({names})"]
        )
    if registered is not None:
        if any(custom[i] is not None for i in stateless):
            # the checkpointer registered at another place than at the save (before: the
            # object saved at its place silently left fresh)
            none = saved_none(mine)
            at = [i for i, entry in enumerate(custom) if entry is None and i not in none]
            raise mismatch_error(
                [
                    f"registered objects in another order: CociCheckpointer at {at} at the "
                    f"save, at {sorted(stateless)} now ({', '.join(registered)})"
                ]
            )
        # a registered object's state missing (one process's entry forged and resealed):
        # resume() put back nothing into it, and the object went on from its fresh state on
        # this process only (before: restored, silently). A None its state_dict() returned
        # is recorded in custom_none, and put back.
        none = saved_none(mine)
        for i, entry in enumerate(custom):
            if entry is None and i not in stateless and i not in none:
                raise _Unfit(
                    f"process {process_index}'s state of registered object {i} "
                    f"({registered[i]}) is missing"
                )
    try:
        _check_rng(mine["rng"])
    except _Unfit as e:
        raise _Unfit(f"process {process_index}'s {e}") from None


def _check_rng(rng: dict[str, Any]) -> None:
    """Random states that ``_state._set_rng_state`` puts back (``check_random_states``)."""
    try:
        check_saved_random_states(rng, torch_key="torch")
    except UnfitRandomState as e:
        raise _Unfit(str(e)) from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
