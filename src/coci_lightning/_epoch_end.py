"""Saves planned at an epoch's last step, taken at that step and resumed exactly.

Lightning resumes none of the states at an epoch's end exactly: a checkpoint taken in
``on_train_batch_end`` of the last batch (``ModelCheckpoint(every_n_train_steps=N)``'s) is
resumed as if the epoch had ended, without its epoch-end validation and one epoch ahead; one
taken after the epoch's end work resumes into an exhausted data loader and an empty epoch. The
state Lightning's loops do resume exactly is the one *after the last batch, before the epoch's
end*: after the validation that follows the batch, if any (``RESTARTED_ON_LAST``: the resumed
run skips that validation and runs the epoch's end: ``on_train_epoch_end`` hooks, epoch-interval
LR schedulers, then the next epoch from a fresh loader iterator).

So a save at an epoch's last step is taken at the end of its validation when one follows the
batch, else in ``on_train_batch_end`` with the two counters Lightning advances right after that
hook (the batch's ``completed`` count, and the optimizer-stepped batches its loggers count)
advanced in the saved copy. The resumed run puts the random states back before the epoch's end
(not at its first batch, as for a checkpoint within an epoch), and gives the epoch-end hooks
the metrics the epoch logged (Lightning does not save logged metrics, and the resumed run
trained none of that epoch's steps: ``EarlyStopping(check_on_train_epoch_end=True)`` would find
no value).

A preemption notice's save at that step cannot wait for a validation that follows (the time
left may not fit it): it is taken in ``on_train_batch_end``, in the state Lightning resumes as a
validation cut short before its first batch (``RESTARTED_MID_EVALUATION``). The resumed run puts
the random states back, runs that validation (its hooks, and what it draws from the random
streams), then the epoch's end, as the uninterrupted run does; Lightning advances the
stepped-batches count after that validation (see :func:`as_after_the_batch` and
:func:`settle_resumed_validation`). When that step is the run's last by ``max_steps``,
Lightning's fit loop stops on ``max_steps`` before it looks at the restored loops, and would end
the resumed run without that validation and the epoch's end: the fit loop is held open until
the validation has run (:func:`hold_for_last_validation`).

These read Lightning internals (the fit loop's progress counters and its validation decision);
``tests/lightning/test_epoch_end_saves.py`` checks them against an uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

__all__ = [
    "after_a_finished_epoch",
    "as_after_the_batch",
    "epoch_end_metrics",
    "hold_for_last_validation",
    "release_last_validation",
    "run_ends_with_this_epoch",
    "settle_resumed_validation",
    "start_next_epoch",
    "validation_follows",
]


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates right after the current training batch (its own decision,
    taken in the epoch loop's ``on_advance_end``)."""
    loop = trainer.fit_loop
    fetcher = loop._data_fetcher
    # Private: the decision Lightning takes a moment later, with the same inputs.
    return fetcher is not None and bool(loop.epoch_loop._should_check_val_fx(fetcher))


def run_ends_with_this_epoch(trainer: pl.Trainer) -> bool:
    """Whether ``fit`` ends once the current (last) batch's epoch has ended: ``max_steps``
    reached, or this is the ``max_epochs``-th epoch (both stop Lightning unconditionally)."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs


def as_after_the_batch(
    state: dict[str, Any], trainer: pl.Trainer, *, before_validation: bool = False
) -> bool:
    """Turn a checkpoint dumped in ``on_train_batch_end`` into the state after that batch:
    advance the two counters Lightning advances right after the hook. False (``state``
    unchanged) when the checkpoint does not have the layout this expects.

    ``before_validation``: the state after the batch and before the validation that follows
    it, which Lightning resumes by running that validation: its batch counter as when the
    validation's first batch has started (a validation cut short there), and the
    optimizer-stepped batches not advanced (Lightning advances them after the validation)."""
    try:
        loop = state["loops"]["fit_loop"]
        progress = loop["epoch_loop.batch_progress"]
        counters = [progress["total"], progress["current"]]
        stepped = loop["epoch_loop.state_dict"]
        if not all(type(c.get("completed")) is int for c in counters):
            return False
        if type(stepped.get("_batches_that_stepped")) is not int:
            return False
        if before_validation:
            validation = loop["epoch_loop.val_loop.batch_progress"]
            total = validation["total"]
            if not all(type(total.get(k)) is int for k in _PROCESSING):
                return False
            if type(validation["current"]) is not dict:
                return False
    except (KeyError, TypeError):
        return False
    for counter in counters:
        counter["completed"] += 1
    if before_validation:
        # the validations earlier in this epoch counted, and one more started, none of its
        # batches processed (the stage Lightning calls RESTARTED_MID_EVALUATION)
        done = total["completed"]
        total.update(ready=done + 1, started=done + 1, processed=done, completed=done)
        validation["current"].update(ready=1, started=1, processed=0, completed=0)
        validation["is_last_batch"] = False
    # Private: whether this batch stepped the optimizer, as Lightning asks before counting it.
    elif not trainer.fit_loop._should_accumulate():
        stepped["_batches_that_stepped"] += 1
    return True


def settle_resumed_validation(trainer: pl.Trainer) -> bool:
    """In a run resumed from a save taken before an epoch's validation (see
    :func:`as_after_the_batch`), once Lightning has decided to run that validation
    (``on_train_start``): count the validation's started batch as none, so that a checkpoint
    taken after it (the end of fit's, another callback's) does not resume it once more.
    Whether the run was resumed so (the step it resumed from is not finished yet)."""
    # Private: the validation loop's restart stage and batch counters.
    loop = trainer.fit_loop.epoch_loop.val_loop
    if not loop.restarted_mid_evaluation:
        return False
    total = loop.batch_progress.total
    counts = total.state_dict()
    total.load_state_dict(dict.fromkeys(counts, counts["completed"]))
    return True


_PROCESSING = ("ready", "started", "processed", "completed")


class _UntilValidated:
    """Mixed into the fit loop's class while it is held: not done, whatever ``max_steps``
    says (the epoch loop still stops on it, once the restored validation has run)."""

    @property
    def done(self) -> bool:
        return False


def hold_for_last_validation(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """When ``checkpoint``, restored by ``fit``, was taken before the validation that follows
    the run's last step by ``max_steps`` (see :func:`as_after_the_batch`), keep Lightning's
    fit loop from ending before it runs that validation, until
    :func:`release_last_validation`. Whether it did."""
    step = checkpoint.get("global_step")
    if trainer.state.fn != "fit" or type(step) is not int or not 0 < trainer.max_steps <= step:
        return False
    try:
        loop = checkpoint["loops"]["fit_loop"]
        current = loop["epoch_loop.val_loop.batch_progress"]["current"]
        cut_short = current["started"] > current["processed"]  # RESTARTED_MID_EVALUATION
    except (KeyError, TypeError):
        return False
    if not cut_short:
        return False
    # Private: the fit loop's ``done`` is a property of its class; the live loop takes a
    # subclass of its own class for as long as it is held.
    fit_loop = trainer.fit_loop
    base = type(fit_loop)
    fit_loop.__class__ = type(base.__name__, (_UntilValidated, base), {})
    return True


def after_a_finished_epoch(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint``, restored by a ``fit`` whose length is given as ``max_steps``,
    was taken after an epoch's end (the final save of a run that ended with that epoch).
    Lightning treats every resume of a ``max_steps`` run as a restart within an epoch: it would
    resume the exhausted epoch (its data loader's state included) as an empty epoch, its
    epoch-end hooks included, and count every later epoch and logged step one too many. For
    such a checkpoint this drops the data loaders' state from ``checkpoint`` (a fresh epoch
    starts from a fresh iterator), and :func:`start_next_epoch` then starts the next epoch as
    Lightning does for it in a ``max_epochs`` run."""
    if trainer.state.fn != "fit" or trainer.max_steps == -1:
        return False
    try:
        loop = checkpoint["loops"]["fit_loop"]
        epochs = loop["epoch_progress"]["current"]
        batches = loop["epoch_loop.batch_progress"]
        counts = [epochs[k] for k in _PROCESSING]
        finished = (
            counts[0] > 0
            and counts.count(counts[0]) == len(counts)
            and batches["is_last_batch"] is True
            and batches["current"]["completed"] == batches["current"]["ready"]
        )
        if finished:
            loop["state_dict"]["combined_loader"] = []
    except (KeyError, TypeError, AttributeError):
        return False
    return bool(finished)


def start_next_epoch(trainer: pl.Trainer) -> None:
    """In ``on_train_start`` of a ``fit`` resumed from a checkpoint for which
    :func:`after_a_finished_epoch` held: the fit loop (its ``max_steps`` setter forces a
    restart) and its epoch loop are not restarting."""
    # Private: the loops' restart flag (the fit loop's setter would force it back on).
    loop = trainer.fit_loop
    loop._restarting = False
    loop.epoch_loop.restarting = False  # and its own children


def release_last_validation(trainer: pl.Trainer) -> None:
    """Undo :func:`hold_for_last_validation` (once the validation has run, or at the end)."""
    fit_loop = trainer.fit_loop
    if isinstance(fit_loop, _UntilValidated):
        fit_loop.__class__ = type(fit_loop).__mro__[2]


def epoch_end_metrics(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The metrics the epoch-end hooks will see (``trainer.callback_metrics`` at
    ``on_train_epoch_end``): the logged values so far, with the epoch's aggregates computed
    now (the epoch's last batch has logged)."""
    metrics = dict(trainer.callback_metrics)
    try:
        # Private: the epoch aggregates Lightning computes at the epoch's end from the same
        # results (cached there, so they are not computed twice).
        results = trainer.fit_loop.epoch_loop._results
        metrics.update(results.metrics(False)["callback"])
    except (AttributeError, KeyError, TypeError):
        pass
    return {
        str(k): v.detach().cpu() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
        for k, v in metrics.items()
        if isinstance(v, (torch.Tensor, int, float))
    }
