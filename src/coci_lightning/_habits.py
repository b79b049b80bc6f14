"""The arguments of Lightning's ``ModelCheckpoint`` that its users bring to ``CociCheckpoint``:
``every_n_train_steps`` (the ``every_n_steps`` policy), ``train_time_interval`` (the
``every_n_seconds`` policy), ``mode`` (checked here, used by ``ckpt_path="best"``),
``save_last=True`` (what coci always does), and those coci refuses with a reason rather than a
bare ``TypeError``: ``save_weights_only``, ``filename``, ``save_top_k`` and ``save_last=False``;
and the Trainer's ``enable_checkpointing=False`` beside a ``CociCheckpoint``, told in coci's
words."""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

from coci_core.errors import ConfigError
from coci_core.planner import SavePolicy

__all__ = ["MODES", "Interval", "install_checkpointing_message", "model_checkpoint_arguments"]

MODES = ("min", "max")


class Interval(NamedTuple):
    """The policy and its interval that ModelCheckpoint's arguments ask for."""

    policy: str | SavePolicy
    every_n_steps: int | None
    every_n_seconds: float | None


def model_checkpoint_arguments(
    *,
    policy: str | SavePolicy,
    every_n_steps: int | None,
    every_n_seconds: float | None,
    every_n_train_steps: int | None,
    train_time_interval: object,
    mode: object,
    save_weights_only: object,
    filename: object,
    save_top_k: object,
    save_last: object,
) -> Interval:
    """The policy, ``every_n_steps`` and ``every_n_seconds`` that ModelCheckpoint's arguments
    ask for.

    ``every_n_train_steps=N`` is ``policy="every_n_steps", every_n_steps=N``: a save every N
    steps, as ModelCheckpoint takes them (``every_n_steps`` alone only caps coci's interval);
    ``train_time_interval=timedelta(...)`` is ``policy="every_n_seconds"`` with its seconds.

    Raises:
        ConfigError: a bad ``mode``; ``every_n_train_steps`` or ``train_time_interval`` beside
            the option it stands for, each other or another policy; ``save_weights_only=True``,
            a ``filename``, a ``save_top_k`` or ``save_last`` other than True (each says why,
            and what to do).
    """
    if mode not in MODES:
        raise ConfigError(
            f"'mode' must be 'min' (the lowest value of 'monitor' is best) or 'max': {mode!r}"
        )
    if save_weights_only is not False:
        raise ConfigError(
            "'save_weights_only': coci's checkpoints hold the whole training state (optimizer, "
            "random states, loader position) so that a run resumes exactly, and its "
            "incremental writes make that cheap. For the weights alone, export them from a "
            "checkpoint: coci export DIR model.safetensors --weights-only (a file that "
            "model.load_state_dict(safetensors.torch.load_file(...)) reads)"
        )
    if filename is not None:
        raise ConfigError(
            f"'filename' ({filename!r}): coci names each checkpoint by its step "
            "(dirpath/step-0000000300), so that a resume finds the newest one and ckpt_path "
            "takes 'last', 'best' or a step directory; leave it out (for a file named your "
            "way, `coci export DIR NAME.safetensors --weights-only` or `coci export DIR "
            "NAME.ckpt`)"
        )
    if save_top_k is not None:
        raise ConfigError(
            f"'save_top_k' ({save_top_k!r:.40}): coci keeps the newest checkpoints, as many as "
            "keep_last=N says (a resume needs the newest); for the best k by a metric, add a "
            "ModelCheckpoint(monitor=..., save_top_k=k) beside CociCheckpoint"
        )
    if save_last is not None and save_last is not True:
        raise ConfigError(
            f"'save_last' ({save_last!r:.40}): coci always keeps its newest checkpoint, which "
            "ckpt_path='last' resumes from; leave save_last out (keep_last=N says how many "
            "are kept)"
        )
    if train_time_interval is not None:
        seconds = _seconds_of(train_time_interval)
        if every_n_train_steps is not None or every_n_seconds is not None:
            raise ConfigError(
                "'train_time_interval' is ModelCheckpoint's name of coci's every_n_seconds "
                "policy: pass one of train_time_interval, every_n_seconds and "
                "every_n_train_steps"
            )
        if policy not in ("coci", "every_n_seconds"):
            raise ConfigError(
                f"'train_time_interval' selects the every_n_seconds policy (a save every so "
                f"many seconds of training), and 'policy' is {policy!r}: pass "
                "every_n_seconds=S for that policy's interval"
            )
        return Interval("every_n_seconds", every_n_steps, seconds)
    if every_n_train_steps is None:
        return Interval(policy, every_n_steps, every_n_seconds)
    if type(every_n_train_steps) is not int or every_n_train_steps < 1:
        raise ConfigError(
            f"'every_n_train_steps' (coci's every_n_steps) must be an integer >= 1: "
            f"{every_n_train_steps!r}"
        )
    if every_n_steps is not None:
        raise ConfigError(
            "'every_n_train_steps' is ModelCheckpoint's name of coci's 'every_n_steps': pass one"
        )
    if policy not in ("coci", "every_n_steps"):
        raise ConfigError(
            f"'every_n_train_steps' selects the every_n_steps policy (a save every N steps), "
            f"and 'policy' is {policy!r}: pass every_n_steps=N for that policy's interval"
        )
    return Interval("every_n_steps", every_n_train_steps, every_n_seconds)


def _seconds_of(interval: object) -> float:
    if not isinstance(interval, datetime.timedelta) or interval.total_seconds() <= 0:
        raise ConfigError(
            f"'train_time_interval' must be a datetime.timedelta longer than zero (as "
            f"ModelCheckpoint takes it): {interval!r:.60}"
        )
    return interval.total_seconds()


def install_checkpointing_message() -> None:
    """``Trainer(enable_checkpointing=False, callbacks=[CociCheckpoint()])``: Lightning refuses
    it saying it "found `ModelCheckpoint` in callbacks list", where there is none; say what
    to do instead (safe to call many times)."""
    # Private: Lightning checks this in the Trainer's constructor, before any callback hook.
    original = _CallbackConnector._configure_checkpoint_callbacks
    if getattr(original, "_coci", False):
        return

    def configure(self: _CallbackConnector, enable_checkpointing: bool) -> Any:
        cocis = [
            type(c).__name__
            for c in self.trainer.checkpoint_callbacks
            # a user's subclass of CociCheckpoint too
            if any(k.__module__.startswith("coci_lightning") for k in type(c).__mro__)
        ]
        if cocis and not enable_checkpointing:
            raise MisconfigurationException(
                "Trainer(enable_checkpointing=False) with a CociCheckpoint in its callbacks: "
                "CociCheckpoint is a Checkpoint callback, so the Trainer adds no ModelCheckpoint "
                "of its own beside it; leave enable_checkpointing out (True), or take "
                "CociCheckpoint out of the callbacks to save nothing"
            )
        return original(self, enable_checkpointing)

    configure._coci = True  # type: ignore[attr-defined]
    _CallbackConnector._configure_checkpoint_callbacks = configure  # type: ignore[method-assign]
