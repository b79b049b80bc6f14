"""The arguments of Lightning's ``ModelCheckpoint`` that its users bring to ``CociCheckpoint``:
``every_n_train_steps`` (the ``every_n_steps`` policy), ``mode`` (checked here, used by
``ckpt_path="best"``), and the two coci refuses with a reason, ``save_weights_only`` and
``filename``, rather than a bare ``TypeError``."""

from __future__ import annotations

from coci_core.errors import ConfigError
from coci_core.planner import SavePolicy

__all__ = ["MODES", "model_checkpoint_arguments"]

MODES = ("min", "max")


def model_checkpoint_arguments(
    *,
    policy: str | SavePolicy,
    every_n_steps: int | None,
    every_n_train_steps: int | None,
    mode: object,
    save_weights_only: object,
    filename: object,
) -> tuple[str | SavePolicy, int | None]:
    """The policy and ``every_n_steps`` that ModelCheckpoint's arguments ask for.

    ``every_n_train_steps=N`` is ``policy="every_n_steps", every_n_steps=N``: a save every N
    steps, as ModelCheckpoint takes them (``every_n_steps`` alone only caps coci's interval).

    Raises:
        ConfigError: a bad ``mode``; ``every_n_train_steps`` beside ``every_n_steps`` or another
            policy; ``save_weights_only=True`` or a ``filename`` (each says why, and what to do).
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
    if every_n_train_steps is None:
        return policy, every_n_steps
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
    return "every_n_steps", every_n_train_steps
