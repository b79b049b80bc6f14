"""The hyper-parameters Lightning writes into every checkpoint, checked when ``fit`` starts.

``save_hyperparameters`` puts the module's (and the datamodule's) hyper-parameters into every
checkpoint: a dict of its values, or an OmegaConf config as it is, with its class beside it
(``hparams_type``). coci stores them without pickle (see
:mod:`coci_core.engine.format.tree`: OmegaConf configs, ``argparse.Namespace`` and paths by the
name of their type); a value it cannot store (an enum member, a dataclass, a structured config,
any other object) is refused here, before any training, instead of at the first save.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl

from coci_core.errors import UnsupportedValueError
from coci_core.training import flatten_state

__all__ = ["check_hyperparameters", "lightning_hyperparameters"]


def lightning_hyperparameters(trainer: pl.Trainer) -> dict[str, Any]:
    """The hyper-parameter entries of the checkpoint Lightning would dump now (as
    ``_CheckpointConnector.dump_checkpoint`` makes them)."""
    omegaconf = sys.modules.get("omegaconf")  # Lightning tests for a Container only then too
    entries: dict[str, Any] = {}
    for obj in (trainer.lightning_module, getattr(trainer, "datamodule", None)):
        if obj is None or not obj.hparams:
            continue
        if hasattr(obj, "_hparams_name"):
            entries[obj.CHECKPOINT_HYPER_PARAMS_NAME] = obj._hparams_name
        if omegaconf is not None and isinstance(obj.hparams, omegaconf.Container):
            entries[obj.CHECKPOINT_HYPER_PARAMS_KEY] = obj.hparams
            entries[obj.CHECKPOINT_HYPER_PARAMS_TYPE] = type(obj.hparams)
        else:
            entries[obj.CHECKPOINT_HYPER_PARAMS_KEY] = dict(obj.hparams)
    return entries


def check_hyperparameters(trainer: pl.Trainer) -> None:
    """Refuse, before training, hyper-parameters that no checkpoint could store.

    Raises:
        UnsupportedValueError: naming the hyper-parameter, why, and what to store instead.
    """
    try:
        flatten_state(lightning_hyperparameters(trainer))
    except UnsupportedValueError as e:
        raise UnsupportedValueError(
            "CociCheckpoint cannot store the hyper-parameters that Lightning saves in every "
            f"checkpoint (self.save_hyperparameters(...)), so fit() stops before training: {e}"
        ) from None
