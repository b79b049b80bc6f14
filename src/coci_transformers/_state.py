"""What the Trainer's ``_save_checkpoint`` saves, gathered as one coci state, and put back.

The Trainer saves a ``checkpoint-N`` directory: the model's weights, the optimizer, the LR
scheduler, the gradient scaler, each process's random states (``rng_state_<i>.pth``) and the
``TrainerState`` (global step, epoch, log history, best metric, the stateful callbacks' states)
as ``trainer_state.json``. coci saves the same as one checkpoint: the state that is the same on
every process is split over them, each process writes its own random states (per-rank state
under ``PROCESS_KEY``), which go back to the process of the same index.

The Trainer finds the position in the data from the global step (it skips the batches of the
resumed epoch that were trained on, then sets the random states saved at the step), so the
data position needs nothing of its own.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState

from coci_core.errors import CheckpointError

LAYOUT = "coci.transformers/1"
PROCESS_KEY = "coci_process"


def rng_state() -> dict[str, Any]:
    """This process's random states (what the Trainer's ``_save_rng_state`` saves)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


def trainer_state_json(trainer: Trainer, *, update: bool = True) -> str:
    """``trainer.state`` as the Trainer writes ``trainer_state.json``, with the states of the
    stateful callbacks (``EarlyStoppingCallback``, ``TrainerControl``) brought up to date
    first, as ``_save_checkpoint`` does (unless not ``update``: a warm-up's state)."""
    if not update:
        return json.dumps(dataclasses.asdict(trainer.state), sort_keys=True)
    stored: Any = trainer.state.stateful_callbacks
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if not isinstance(cb, ExportableState):
            continue
        name = cb.__class__.__name__
        if isinstance(stored.get(name), list):
            stored[name].append(cb.state())
        else:
            stored[name] = cb.state()
    return json.dumps(dataclasses.asdict(trainer.state), sort_keys=True)


def collect(trainer: Trainer, *, weights_only: bool, warm_up: bool = False) -> dict[str, Any]:
    """Everything ``_save_checkpoint`` saves that is the same on every process
    (``weights_only``: the model and the TrainerState, as with ``save_only_model``;
    ``warm_up``: for the buffers only, the Trainer's state left as it is)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    state: dict[str, Any] = {
        "layout": LAYOUT,
        "world_size": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "weights_only": weights_only,
        "model": model.state_dict(),
        "model_config": _config_json(model),
        "trainer_state": trainer_state_json(trainer, update=not warm_up),
    }
    if not weights_only:
        t: Any = trainer
        scaler = trainer.accelerator.scaler
        state["optimizer"] = t.optimizer.state_dict()
        state["scheduler"] = t.lr_scheduler.state_dict()
        state["scaler"] = scaler.state_dict() if scaler is not None else None
    return state


def _config_json(model: Any) -> str | None:
    """The model's ``config.json`` (for ``from_pretrained`` after an export), if it has one."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return str(to_json()) if callable(to_json) else None


def collect_own() -> dict[str, Any]:
    """This process's own state: its random states."""
    return {"rng": rng_state()}


def check_layout(state: Any) -> None:
    """``state`` was written by this adapter."""
    if not isinstance(state, dict) or state.get("layout") != LAYOUT:
        layout = state.get("layout") if isinstance(state, dict) else None
        raise CheckpointError(
            f"this checkpoint was not written by coci_transformers (layout {layout!r}, "
            f"expected {LAYOUT!r}): point CociCallback at its own directory"
        )


def check_fits(state: dict[str, Any], trainer: Trainer) -> None:
    """The restored ``state`` was written by this adapter and holds what a resume needs."""
    check_layout(state)
    if state.get("weights_only"):
        raise CheckpointError(
            f"step {state.get('global_step')} was saved with save_only_model=True (weights and "
            "TrainerState only): training cannot resume from it; load its weights with "
            "`coci export --format transformers` and from_pretrained"
        )


def trainer_state(state: dict[str, Any]) -> TrainerState:
    """The saved TrainerState."""
    return TrainerState(**json.loads(state["trainer_state"]))


def own(state: dict[str, Any]) -> dict[str, Any] | None:
    """This process's own saved state (its random states), if it was saved."""
    mine = state.get(PROCESS_KEY)
    return mine if isinstance(mine, dict) else None
