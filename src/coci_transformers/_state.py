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

Under FSDP2 (``TrainingArguments(fsdp=..., fsdp_config={"version": 2})``) the model's and the
optimizer's state is sharded: it is taken with ``get_model_state_dict`` /
``get_optimizer_state_dict`` (each process's own shards, DTensors, the optimizer keyed by
parameter name), so each process writes its own shards (no gather), and put back with
``set_model_state_dict`` / ``set_optimizer_state_dict``. The same holds for a model sharded
when it is loaded (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=...,
fsdp_size=...))``, ``tp_plan="auto"``: its parameters are DTensors, on a 2-D mesh with FSDP),
which Accelerate prepares under ``MULTI_GPU`` with a ``ParallelismConfig``, not as FSDP.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, cast

import numpy as np
import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState

from coci_core.errors import CheckpointError
from coci_core.training import check_optimizer_fits, model_misfit
from coci_transformers._trainer import data_parallel_size

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


def sharded(trainer: Trainer) -> bool:
    """Whether the Trainer's model and optimizer hold their state sharded: FSDP through
    Accelerate, or a model whose parameters are DTensors (sharded when it was loaded,
    ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=...))``
    or ``tp_plan="auto"``; Accelerate's type is then ``MULTI_GPU``, with a
    ``ParallelismConfig``)."""
    if trainer.accelerator.distributed_type == DistributedType.FSDP:
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in _model(trainer).parameters())


def _model(trainer: Trainer) -> torch.nn.Module:
    """The Trainer's model (under FSDP2 the sharded module itself)."""
    return cast(torch.nn.Module, trainer.model)


def _optimizer(trainer: Trainer) -> Any:
    """The torch optimizer (inside Accelerate's wrapper)."""
    t: Any = trainer
    return getattr(t.optimizer, "optimizer", t.optimizer)


def collect(trainer: Trainer, *, weights_only: bool, warm_up: bool = False) -> dict[str, Any]:
    """Everything ``_save_checkpoint`` saves that is the same on every process
    (``weights_only``: the model and the TrainerState, as with ``save_only_model``;
    ``warm_up``: for the buffers only, the Trainer's state left as it is); under FSDP each
    process's own shards."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    is_sharded = sharded(trainer)
    if is_sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model_state = get_model_state_dict(_model(trainer))
    else:
        model_state = model.state_dict()
    state: dict[str, Any] = {
        "layout": LAYOUT,
        "world_size": trainer.args.world_size,
        "data_parallel_size": data_parallel_size(trainer),
        "global_step": trainer.state.global_step,
        "weights_only": weights_only,
        "sharded": is_sharded,
        "model": model_state,
        "model_config": _config_json(model),
        "trainer_state": trainer_state_json(trainer, update=not warm_up),
    }
    if not weights_only:
        t: Any = trainer
        scaler = trainer.accelerator.scaler
        if is_sharded:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            state["optimizer"] = get_optimizer_state_dict(_model(trainer), _optimizer(trainer))
        else:
            state["optimizer"] = t.optimizer.state_dict()
        state["scheduler"] = t.lr_scheduler.state_dict()
        state["scaler"] = scaler.state_dict() if scaler is not None else None
    return state


def load_model(trainer: Trainer, state: dict[str, Any]) -> None:
    """The saved model weights into the Trainer's model (after ``accelerator.prepare``): under
    FSDP into its shards; a checkpoint saved under FSDP also into an unsharded model."""
    if sharded(trainer) or state.get("sharded"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        # restored whole (no live shards yet when it was read): each process keeps its part
        options = StateDictOptions(full_state_dict=sharded(trainer))
        set_model_state_dict(_model(trainer), state["model"], options=options)
    else:
        model = trainer.accelerator.unwrap_model(trainer.model)
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as e:  # another architecture: torch's message, and what to do
            raise model_misfit(model, e, fix=_new_run(trainer)) from e


def _new_run(trainer: Trainer) -> str:
    return f"start a new run in another output_dir than {trainer.args.output_dir!r}"


def load_optimizer(trainer: Trainer, state: dict[str, Any]) -> None:
    """The saved optimizer state into the Trainer's optimizer, as :func:`load_model`."""
    if sharded(trainer) or state.get("sharded"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=sharded(trainer))
        set_optimizer_state_dict(
            _model(trainer), _optimizer(trainer), state["optimizer"], options=options
        )
    else:
        t: Any = trainer
        check_optimizer_fits(
            t.optimizer,
            state["optimizer"],
            fix=_new_run(trainer),
        )
        t.optimizer.load_state_dict(state["optimizer"])


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
            "TrainerState only, as the Trainer's own): training cannot resume from it; load "
            "its weights with `coci export --format transformers` and from_pretrained, and "
            "start a new run (resume_from_checkpoint=None, or another output_dir)"
        )
    if sharded(trainer) and not state.get("sharded"):
        raise CheckpointError(
            f"step {state.get('global_step')} was saved without FSDP and this run shards the "
            "model (FSDP, or a model sharded when loaded): resume it without fsdp= or "
            "distributed_config= (a checkpoint saved sharded resumes with or without it)"
        )


def trainer_state(state: dict[str, Any]) -> TrainerState:
    """The saved TrainerState."""
    return TrainerState(**json.loads(state["trainer_state"]))


def own(state: dict[str, Any]) -> dict[str, Any] | None:
    """This process's own saved state (its random states), if it was saved."""
    mine = state.get(PROCESS_KEY)
    return mine if isinstance(mine, dict) else None
