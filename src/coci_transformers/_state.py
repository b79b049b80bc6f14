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


def trainer_state_json(
    trainer: Trainer, *, update: bool = True, cache: StateJson | None = None
) -> str:
    """``trainer.state`` as the Trainer writes ``trainer_state.json`` (as
    ``json.dumps(dataclasses.asdict(state), sort_keys=True)`` gives it), with the states of the
    stateful callbacks (``EarlyStoppingCallback``, ``TrainerControl``) brought up to date
    first, as ``_save_checkpoint`` does (unless not ``update``: a warm-up's state).
    ``cache``: the log history's entries encoded at the last save (see :class:`StateJson`)."""
    if update:
        stored: Any = trainer.state.stateful_callbacks
        for cb in [*trainer.callback_handler.callbacks, trainer.control]:
            if not isinstance(cb, ExportableState):
                continue
            name = cb.__class__.__name__
            if isinstance(stored.get(name), list):
                stored[name].append(cb.state())
            else:
                stored[name] = cb.state()
    if cache is not None:
        return cache.encode(trainer.state)
    return json.dumps(dataclasses.asdict(trainer.state), sort_keys=True)


#: the types of a log entry's values whose JSON a copy of the entry keeps (immutable)
_SCALARS = frozenset({str, int, float, bool, type(None)})


class StateJson:
    """A run's ``TrainerState`` as JSON at each save, the log history's entries encoded once.

    The log history grows by an entry at each log and evaluation: encoded whole, with the
    deep copy of ``dataclasses.asdict``, it took about 0.2 s per save of a history of 10,000
    entries, on the training thread. Here an entry is encoded again only when it is not the
    very dict met at its place at the last save, holding the same keys and values of the
    same types (a copy of it is kept: an entry changed in place is encoded again); an entry
    holding anything but strings, numbers, booleans and None is encoded at every save. The
    text is the same as ``json.dumps(dataclasses.asdict(state), sort_keys=True)``.
    """

    def __init__(self) -> None:
        # per entry of the history: the entry, a copy of it, its values' types, its JSON
        self._entries: list[tuple[Any, dict[str, Any], tuple[type, ...], str] | None] = []
        # the model's config, its values (as JSON) and its config.json at the last save
        self._config: tuple[Any, str, str] | None = None

    def config_json(self, config: Any, to_json: Any) -> str:
        """``config.to_json_string()``, the last save's when ``config`` is the same object
        and its ``to_dict()`` the same (the JSON diff against the class's defaults, which
        builds a default config, is what costs)."""
        try:
            values = json.dumps(config.to_dict(), sort_keys=True)
        except (TypeError, ValueError, AttributeError):
            return str(to_json())
        known = self._config
        if known is not None and known[0] is config and known[1] == values:
            return known[2]
        text = str(to_json())
        self._config = (config, values, text)
        return text

    def encode(self, state: TrainerState) -> str:
        history = state.log_history
        names = [f.name for f in dataclasses.fields(state)]
        if type(history) is not list or "log_history" not in names:
            return json.dumps(dataclasses.asdict(state), sort_keys=True)
        try:
            logged = self._history(history)
            # json.dumps(doc, sort_keys=True) of the top level, field by field
            fields = [
                f"{json.dumps(name)}: "
                + (
                    logged
                    if name == "log_history"
                    else json.dumps(getattr(state, name), sort_keys=True)
                )
                for name in sorted(names)
            ]
        except TypeError:  # a dataclass or another value that asdict converts first
            self._entries = []
            return json.dumps(dataclasses.asdict(state), sort_keys=True)
        return "{" + ", ".join(fields) + "}"

    def _history(self, history: list[Any]) -> str:
        kept = self._entries
        out = []
        for i, entry in enumerate(history):
            known = kept[i] if i < len(kept) else None
            if (
                known is not None
                and known[0] is entry
                and entry == known[1]
                and tuple(map(type, entry.values())) == known[2]
            ):
                out.append(known[3])
                continue
            text = json.dumps(entry, sort_keys=True)
            plain = (
                type(entry) is dict
                and all(type(k) is str for k in entry)
                and all(type(v) in _SCALARS for v in entry.values())
            )
            record = (entry, dict(entry), tuple(map(type, entry.values())), text) if plain else None
            if i < len(kept):
                kept[i] = record
            else:
                kept.append(record)
            out.append(text)
        del kept[len(history) :]
        return "[" + ", ".join(out) + "]"


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


def collect(
    trainer: Trainer, *, weights_only: bool, warm_up: bool = False, cache: StateJson | None = None
) -> dict[str, Any]:
    """Everything ``_save_checkpoint`` saves that is the same on every process
    (``weights_only``: the model and the TrainerState, as with ``save_only_model``;
    ``warm_up``: for the buffers only, the Trainer's state left as it is); under FSDP each
    process's own shards. ``cache``: what the last save encoded (see :class:`StateJson`)."""
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
        "model_config": _config_json(model, cache),
        "trainer_state": trainer_state_json(trainer, update=not warm_up, cache=cache),
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


def _config_json(model: Any, cache: StateJson | None = None) -> str | None:
    """The model's ``config.json`` (for ``from_pretrained`` after an export), if it has one
    (``cache``: the last save's, when the config is the same object with the same values)."""
    config = getattr(model, "config", None)
    to_json_string = getattr(config, "to_json_string", None)
    if not callable(to_json_string):
        return None

    def to_json() -> str:
        return _with_architecture(str(to_json_string()), model)

    if cache is None:
        return to_json()
    return cache.config_json(config, to_json)


def _with_architecture(text: str, model: Any) -> str:
    """``config.json`` naming the model's class in ``architectures`` when the config does not,
    as ``save_pretrained`` writes it (``AutoModel`` and an export's tied weights read it):
    the class of transformers' models it is, past FSDP2's wrapper class."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    if not isinstance(doc, dict) or doc.get("architectures"):
        return text
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and not issubclass(cls, FSDPModule):
            doc["architectures"] = [cls.__name__]
            return json.dumps(doc, indent=2, sort_keys=True) + "\n"
    return text


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


def check_fits(state: dict[str, Any], trainer: Trainer, *, finished: bool = False) -> None:
    """The restored ``state`` was written by this adapter and holds what a resume needs
    (``finished``: a step at the run's end, where a weights-only one will do)."""
    check_layout(state)
    if state.get("weights_only") and not finished:
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
