"""How an Accelerate loop counts its steps, for :class:`CociCheckpointer`: the run's total and
the epoch's length in optimizer steps (with gradient accumulation, several batches each), the
advice that goes with them, and the checks of the batches a resumed loop skips."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from typing import Any

from accelerate import Accelerator

from coci_core.errors import ConfigError
from coci_core.planner import SavePolicy

# the checkpointer's logger: these messages are its own, filtered under its name
logger = logging.getLogger("coci_accelerate.checkpointer")


def _total_steps(
    accelerator: Accelerator,
    total_steps: int | None,
    num_epochs: int | None,
    policy: str | SavePolicy,
    planner_options: Mapping[str, Any] | None,
) -> tuple[Mapping[str, Any], str, str]:
    """The planner options with ``total_steps`` (and the epoch policy's ``steps_per_epoch``),
    where the total comes from, and the expression of the epoch to start a resumed loop at."""
    if planner_options is not None and not isinstance(planner_options, Mapping):
        return planner_options, "", ""  # CheckpointOptions.check says what is wrong with it
    options = dict(planner_options or {})
    for name, value in (("total_steps", total_steps), ("num_epochs", num_epochs)):
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"'{name}' must be an integer >= 1 or None: {value!r}")
    if total_steps is not None and num_epochs is not None:
        raise ConfigError("give 'total_steps' or 'num_epochs', not both")
    gas = max(1, int(accelerator.gradient_accumulation_steps))
    per_epoch = batches = None
    for loader in accelerator._dataloaders:  # private: see _state.py
        with contextlib.suppress(TypeError):
            batches = len(loader)
            per_epoch = math.ceil(batches / gas)  # optimizer steps (the last one syncs)
            break
    # an epoch in optimizer steps, in words: len(dataloader) counts batches, and with gradient
    # accumulation an optimizer step takes several of them
    epoch = (
        "len(dataloader)"
        if gas == 1 or per_epoch is None
        else f"{per_epoch} (optimizer steps per epoch: len(dataloader) {batches} with "
        f"gradient_accumulation_steps {gas})"
    )
    source = "given as planner_options['total_steps']"
    if total_steps is not None:
        options["total_steps"] = total_steps
        source = "given as total_steps"
    elif num_epochs is not None:
        if per_epoch is None:
            raise ConfigError(
                "'num_epochs' needs a prepared data loader with a length: make the "
                "CociCheckpointer after accelerator.prepare(..., dataloader), or pass total_steps"
            )
        options["total_steps"] = per_epoch * num_epochs
        source = (
            f"len(dataloader) {per_epoch} x num_epochs {num_epochs}"
            if gas == 1
            else f"{per_epoch} optimizer steps per epoch (len(dataloader) {batches} with "
            f"gradient_accumulation_steps {gas}) x num_epochs {num_epochs}"
        )
    if policy == "epoch" and per_epoch is not None:
        options.setdefault("steps_per_epoch", per_epoch)
    return options, source, f"ckpt.resume() // {epoch}"


def _skip_expression(accelerator: Accelerator) -> str:
    """The batches of the resumed epoch to skip, as an expression for the user's loop."""
    gas = max(1, int(accelerator.gradient_accumulation_steps))
    if gas == 1:
        return "ckpt.resume() % len(dataloader)"
    return (
        f"ckpt.resume() % math.ceil(len(dataloader) / {gas}) * {gas}, the batches of the "
        f"resumed epoch with gradient_accumulation_steps {gas}"
    )


def _count_steps(opt: Any, counted: Any) -> None:
    """Call ``counted`` after each ``opt.step()`` that updates (not accumulation steps)."""
    original = opt.step
    state = getattr(opt, "gradient_state", None)

    def step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if state is None or state.sync_gradients:
            counted()
        return result

    opt.step = step


def _log_skip_advice(accelerator: Accelerator, count: int, standins: dict[int, Any]) -> None:
    """At the first step after a resume ``count`` optimizer steps in: a WARNING per prepared
    loader that is not stateful, resumed mid-epoch, that the loop did not skip through
    ``accelerator.skip_first_batches`` (it gives the epoch's first batches again)."""
    gas = max(1, int(accelerator.gradient_accumulation_steps))
    for i, loader in enumerate(accelerator._dataloaders):  # private: see _state.py
        if getattr(loader, "use_stateful_dataloader", False) or id(loader) in standins:
            continue
        try:
            per_epoch = math.ceil(len(loader) / gas)  # optimizer steps (the last one syncs)
        except TypeError:
            continue
        if per_epoch and count % per_epoch:
            batches = min(len(loader), count % per_epoch * gas)
            logger.warning(
                "coci: resumed after %d optimizer steps, %d batches into an epoch of data "
                "loader %d, which is not stateful, and the loop did not skip them through "
                "accelerator.skip_first_batches: unless it skips them otherwise, this epoch "
                "trains on them again; skip them with accelerator.skip_first_batches(dataloader,"
                " %d) (or use DataLoaderConfiguration(use_stateful_dataloader=True))",
                count,
                batches,
                i,
                batches,
            )


def _check_skip(accelerator: Accelerator, loader: Any, count: int, num_batches: int) -> None:
    """``accelerator.skip_first_batches(loader, n)`` right after a resume ``count`` optimizer
    steps in, of a prepared loader: a WARNING (main process) when ``n`` is not the batches of
    the resumed epoch already trained on. A stateful loader is put back mid-epoch by the resume
    itself, so any skip drops ``n`` more batches (Accelerate's example skips them, for a loader
    that is not stateful); for another loader ``n`` counts batches, where ``count`` counts
    optimizer steps (with gradient accumulation, several batches each, the epoch's last one
    fewer)."""
    if not any(loader is dl for dl in accelerator._dataloaders):  # private: see _state.py
        return
    gas = max(1, int(accelerator.gradient_accumulation_steps))
    try:
        batches = len(loader)
    except TypeError:
        return
    per_epoch = math.ceil(batches / gas)
    into = min(batches, count % per_epoch * gas) if per_epoch else 0
    steps = f"{count} optimizer steps" + (
        f" with gradient_accumulation_steps {gas}" if gas > 1 else ""
    )
    if getattr(loader, "use_stateful_dataloader", False):
        if into:
            logger.warning(
                "coci: accelerator.skip_first_batches(dataloader, %d) of a loader with "
                "use_stateful_dataloader=True, which ckpt.resume() put back %d batches into its "
                "epoch: it continues from there by itself, so the skip drops %d more batches of "
                "this epoch, never trained on; after a resume, iterate a stateful loader itself "
                "(skip_first_batches is for a loader that is not stateful)",
                num_batches,
                into,
                num_batches,
            )
        return
    if num_batches != into:
        logger.warning(
            "coci: accelerator.skip_first_batches(dataloader, %d), but ckpt.resume() restored "
            "a step %d batches into this epoch (%s, %d batches an epoch): %s; skip %d",
            num_batches,
            into,
            steps,
            batches,
            f"the resumed epoch trains {into - num_batches} of them again"
            if num_batches < into
            else f"{num_batches - into} batches of this epoch are never trained on",
            into,
        )
