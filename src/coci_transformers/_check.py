"""Whether a checkpoint of ``CociCallback`` holds what the Trainer can load, before it is taken.

A checkpoint's checksums say that it is what was committed, not that what was committed is the
Trainer's: a manifest edited and resealed (its checksum computed again) passes them. The
Trainer's loaders trust what they are given (``TrainerState(**json.loads(...))``,
``random.setstate``, ``lr_scheduler.load_state_dict``) and raise their own errors deep in
``trainer.train()``, or take a forged number as the step to train from. :func:`check_saved`
runs inside the restore, on the state each process read (its own random states included): a
state that does not fit is a :class:`~coci_core.errors.CorruptCheckpointError`, so the restore
passes over that step as damaged, and every process falls back to the newest step intact for
all of them together (the restore's agreement).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from transformers import TrainerState

from coci_core.errors import CorruptCheckpointError
from coci_core.training import UnfitRandomState, check_planner_state, check_saved_random_states
from coci_transformers._state import LAYOUT, PROCESS_KEY

__all__ = ["check_saved", "parse_trainer_state"]

#: the deepest nesting of a saved TrainerState (it is 5 deep: log entries, callback states)
MAX_DEPTH = 32
_MAX_INT = 2**63 - 1
_FIELDS = {f.name for f in dataclasses.fields(TrainerState)}


class _Unfit(Exception):
    """A part of the saved state is not what the adapter writes (the message says which)."""


def _int(value: Any, low: int = 0) -> bool:
    return type(value) is int and low <= value <= _MAX_INT


def _number(value: Any, *, finite: bool = True) -> bool:
    if type(value) not in (int, float):
        return False
    return not finite or math.isfinite(value)


def _nonnegative(value: Any) -> bool:
    return _number(value) and value >= 0


def _optional(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or test(value)


def _str_keys(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def _of_dicts(value: Any) -> bool:
    return isinstance(value, list) and all(_str_keys(v) for v in value)


#: each TrainerState field, and what its saved value must be
_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "epoch": (_optional(_nonnegative), "a number >= 0 or null"),
    "global_step": (_int, "an integer >= 0"),
    "max_steps": (_int, "an integer >= 0"),
    "logging_steps": (_optional(_nonnegative), "a number >= 0"),
    "eval_steps": (_optional(_nonnegative), "a number >= 0"),
    "save_steps": (_optional(_nonnegative), "a number >= 0"),
    "train_batch_size": (_int, "an integer >= 0"),
    "num_train_epochs": (_nonnegative, "a number >= 0"),
    "num_input_tokens_seen": (_nonnegative, "a number >= 0"),
    "total_flos": (_nonnegative, "a number >= 0"),
    "log_history": (_of_dicts, "a list of objects"),
    "best_metric": (_optional(lambda v: _number(v, finite=False)), "a number or null"),
    "best_global_step": (_optional(_int), "an integer >= 0 or null"),
    "best_model_checkpoint": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "is_local_process_zero": (lambda v: type(v) is bool, "true or false"),
    "is_world_process_zero": (lambda v: type(v) is bool, "true or false"),
    "is_hyper_param_search": (lambda v: type(v) is bool, "true or false"),
    "trial_name": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "trial_params": (_optional(_str_keys), "an object or null"),
    "stateful_callbacks": (_optional(_str_keys), "an object or null"),
}


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value`` (counted without recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            stack.extend((v, depth + 1) for v in item)
    return deepest


def parse_trainer_state(text: Any, step: int | None = None) -> dict[str, Any]:
    """The saved ``trainer_state`` (the Trainer's ``trainer_state.json``) as a dict whose
    fields are the TrainerState's, each of its type (and its ``global_step`` ``step``).

    Raises:
        CorruptCheckpointError: it is not that.
    """
    try:
        return _trainer_state(text, step)
    except _Unfit as e:
        at = "" if step is None else f"step {step}: "
        raise CorruptCheckpointError(
            f"{at}the saved TrainerState (trainer_state) is not the Trainer's: {e}", step=step
        ) from None


def _trainer_state(text: Any, step: int | None) -> dict[str, Any]:
    if not isinstance(text, str):
        raise _Unfit(f"not JSON text but {type(text).__name__}")
    try:
        saved = json.loads(text)
    except RecursionError:
        raise _Unfit("nested deeper than the JSON parser reads") from None
    except ValueError as e:  # JSONDecodeError, or an integer of too many digits
        raise _Unfit(f"not JSON ({str(e)[:100]})") from None
    if not isinstance(saved, dict):
        raise _Unfit(f"not a JSON object but {type(saved).__name__}")
    if _depth(saved) > MAX_DEPTH:
        raise _Unfit(f"nested more than {MAX_DEPTH} deep")
    unknown = sorted(set(saved) - _FIELDS)
    if unknown:
        raise _Unfit(f"fields TrainerState does not have: {', '.join(map(repr, unknown[:5]))}")
    if "train_batch_size" not in saved:  # the Trainer divides it on resume
        raise _Unfit("train_batch_size is missing")
    for name, value in saved.items():
        test, expected = _TYPES.get(name, (lambda v: True, ""))
        if not test(value):
            raise _Unfit(f"{name} must be {expected}, not {_shown(value)}")
    if step is not None and saved.get("global_step") != step:
        raise _Unfit(f"global_step {_shown(saved.get('global_step'))} is not the step saved")
    for name, entry in (saved.get("stateful_callbacks") or {}).items():
        for one in entry if isinstance(entry, list) else [entry]:
            if not _str_keys(one) or not all(_str_keys(one.get(k, {})) for k in _PARTS):
                raise _Unfit(f"the state of callback {name!r} is not {{'args': {{}}, ...}}")
    try:
        TrainerState(**saved)
    except (TypeError, ValueError) as e:
        raise _Unfit(str(e)[:200]) from None
    return saved


_PARTS = ("args", "attributes")


def _shown(value: Any) -> str:
    if type(value) is int and abs(value) > 10**12:
        return f"a {value.bit_length()}-bit integer"
    return f"{value!r:.60}"


def check_callback_states(saved: dict[str, Any], callbacks: Iterable[object]) -> None:
    """The saved callback states that the Trainer restores
    (``restore_callback_states_from_checkpoint``) into ``callbacks`` (the live ones, the
    TrainerControl included) name only arguments their classes take, as
    ``type(callback)(**args)`` needs; a TrainerControl's are true or false.

    Raises:
        _Unfit: one does not.
    """
    live = {type(cb).__name__: type(cb) for cb in callbacks}
    for name, entry in (saved.get("stateful_callbacks") or {}).items():
        cls = live.get(name)
        if cls is None:
            continue  # the Trainer ignores it, with a warning
        for one in entry if isinstance(entry, list) else [entry]:
            args = one.get("args", {})
            try:
                inspect.signature(cls).bind(**args)
            except TypeError as e:
                raise _Unfit(f"the saved arguments of callback {name!r}: {e}") from None
            except ValueError:  # no signature to check against
                continue
            if name == "TrainerControl" and not all(type(v) is bool for v in args.values()):
                raise _Unfit("the saved TrainerControl's flags must be true or false")


def check_saved(
    step: int,
    state: Any,
    *,
    callbacks: Iterable[object] | None = None,
    process_index: int | None = None,
) -> None:
    """``state``, read for ``step``, holds what the Trainer loads, each of its type (a state
    of another adapter is left to the layout check). ``callbacks``: the Trainer's live
    callbacks whose saved states it restores (none: not checked against them).
    ``process_index``: the process that read it, whose own state (its random states) a step
    saved by as many processes or more holds (none: not checked).

    Raises:
        CorruptCheckpointError: it does not (a resealed, forged manifest).
    """
    if not isinstance(state, dict) or state.get("layout") != LAYOUT:
        return  # not this adapter's: said by check_layout, after the restore
    try:
        _check(step, state, callbacks, process_index)
    except _Unfit as e:
        raise CorruptCheckpointError(
            f"step {step} does not hold a Trainer state that CociCallback wrote: {e}", step=step
        ) from None


def _check(
    step: int,
    state: dict[str, Any],
    callbacks: Iterable[object] | None,
    process_index: int | None,
) -> None:
    if state.get("global_step") != step:
        raise _Unfit(f"global_step {_shown(state.get('global_step'))} is not the step saved")
    if not _int(state.get("world_size"), 1):
        raise _Unfit(f"world_size {_shown(state.get('world_size'))} is not a process count")
    dp = state.get("data_parallel_size", state["world_size"])
    if not _int(dp, 1) or dp > state["world_size"]:
        raise _Unfit(f"data_parallel_size {_shown(dp)} is not a count of its processes")
    for name in ("weights_only", "sharded"):
        if type(state.get(name, False)) is not bool:
            raise _Unfit(f"{name} must be true or false, not {_shown(state.get(name))}")
    if not _str_keys(state.get("model")):
        raise _Unfit("the model's state is not a dict of tensors")
    if not isinstance(state.get("model_config"), (str, type(None))):
        raise _Unfit("model_config is not JSON text")
    try:
        saved = _trainer_state(state.get("trainer_state"), step)
    except _Unfit as e:
        raise _Unfit(f"its TrainerState (trainer_state): {e}") from None
    if callbacks is not None:
        check_callback_states(saved, callbacks)
    coci = state.get("coci", {})
    if not _str_keys(coci) or not isinstance(coci.get("planner", {}), dict):
        raise _Unfit("coci's own state is not a dict")
    planner = coci.get("planner")
    why = None if planner is None else check_planner_state(planner)
    if why is not None:
        raise _Unfit(f"coci's planner state cannot be loaded ({why})")
    if not state.get("weights_only"):
        _check_training(state)
    mine = state.get(PROCESS_KEY)
    # every process writes its own at each save: without it, this one would train on from its
    # current random states while the others resume theirs
    saved_by = state["world_size"] if not state.get("weights_only") else 0
    if mine is None and process_index is not None and process_index < saved_by:
        raise _Unfit(f"process {process_index}'s own state (its random states) is missing")
    if mine is not None:
        if not _str_keys(mine) or not isinstance(mine.get("rng"), dict):
            raise _Unfit("this process's saved state holds no random states")
        check_rng(mine["rng"])


def _check_training(state: dict[str, Any]) -> None:
    """The optimizer's, scheduler's and gradient scaler's saved states."""
    optimizer: Any = state.get("optimizer")
    if (
        not _str_keys(optimizer)
        or not isinstance(optimizer.get("state"), dict)
        or not _of_dicts(optimizer.get("param_groups"))
        or not all(isinstance(g.get("params"), list) for g in optimizer["param_groups"])
    ):
        raise _Unfit("the optimizer's state is not {'state': {...}, 'param_groups': [...]}")
    scheduler: Any = state.get("scheduler")
    if not _str_keys(scheduler):
        raise _Unfit(f"the LR scheduler's state is not a dict but {_shown(scheduler)}")
    for name in ("last_epoch", "_step_count"):
        if name in scheduler and not _int(scheduler[name], -1):
            raise _Unfit(f"the LR scheduler's {name} is {_shown(scheduler[name])}")
    for name in ("base_lrs", "_last_lr"):
        # numbers, or one-element tensors (Adafactor's schedule, a tensor learning rate)
        value = scheduler.get(name, [])
        if not isinstance(value, list) or not all(_rate(v) for v in value):
            raise _Unfit(f"the LR scheduler's {name} is not a list of learning rates")
    lambdas = scheduler.get("lr_lambdas", [])
    if not isinstance(lambdas, list) or not all(v is None or _str_keys(v) for v in lambdas):
        raise _Unfit("the LR scheduler's lr_lambdas is not a list of dicts")
    if state.get("scaler") is not None and not _str_keys(state["scaler"]):
        raise _Unfit("the gradient scaler's state is not a dict")


def check_rng(rng: dict[str, Any]) -> None:
    """Random states that ``_state.set_rng_state`` puts back (``check_random_states``).

    Raises:
        _Unfit: one is not a random state of its generator.
    """
    try:
        check_saved_random_states(rng, torch_key="cpu")
    except UnfitRandomState as e:
        raise _Unfit(f"its {e}") from None


def _rate(value: Any) -> bool:
    """A learning rate as a scheduler keeps it: a number (Python's or NumPy's) or a tensor of
    one floating element."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
