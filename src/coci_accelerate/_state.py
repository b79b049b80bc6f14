"""What Accelerate's ``save_state`` saves, gathered as one coci state, and put back.

Accelerate keeps what ``prepare`` and ``register_for_checkpointing`` registered (models,
optimizers, loaders, custom objects, save/load hooks) only in private attributes
(``accelerator._models`` ...), which its own ``save_state``/``load_state`` read; coci reads
the same ones, so that it saves exactly what ``save_state`` would.

Per-process state (random states, registered objects) is written by each process itself, as
coci per-rank state under ``PROCESS_KEY``, and put back on the process of the same index. The
rest is the same on every process and is split over them.

Under FSDP (``DistributedType.FSDP``; FSDP2's ``fully_shard`` or FSDP1) the models' and
optimizers' state is sharded: it is taken as ``save_state`` takes a ``SHARDED_STATE_DICT``, with
``get_model_state_dict`` / ``get_optimizer_state_dict`` (optimizer ``i`` with model ``i``), so
each process writes its own shards (no gather), and put back in place into the live shards
(each process reading the boxes it holds, on any mesh) with ``set_model_state_dict`` /
``set_optimizer_state_dict``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from coci_core import InPlaceTargets
from coci_core.errors import CheckpointError, ConfigError
from coci_core.training import check_optimizer_fits, model_misfit

LAYOUT = "coci.accelerate/1"
PROCESS_KEY = "coci_process"
_NEW_RUN = "start a new run in another dirpath (CociCheckpointer(dirpath=...))"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def own_loader_generators(accelerator: Accelerator) -> None:
    """Give every prepared loader that has none its own generator for its iterators' seeds.

    A PyTorch DataLoader without a ``generator`` draws each new iterator's base seed from the
    global random state. A resumed run creates its iterator at the restored step instead of at
    the epoch's start, so that draw would shift every random number after it (dropout masks,
    augmentations) against the uninterrupted run. With its own generator it shifts nothing.
    """
    for loader in accelerator._dataloaders:
        base = getattr(loader, "base_dataloader", loader)
        if getattr(base, "generator", None) is None:
            base.generator = torch.Generator().manual_seed(int(torch.initial_seed()) % 2**63)


def _iterated(loader: Any) -> list[Any]:
    """The loaders being iterated over now (Accelerate's gradient state)."""
    state = getattr(loader, "gradient_state", None)
    return list(getattr(state, "dataloader_references", []) or [])


def _loader_state(loader: Any, standin: Any = None) -> dict[str, Any]:
    base = getattr(loader, "base_dataloader", loader)
    generator = getattr(base, "generator", None)
    if standin is not None:  # skip_first_batches made it to run the rest of loader's epoch
        loader = standin
    if getattr(loader, "end_of_dataloader", False):
        # Saved on an epoch's last batch: resume at the start of the next epoch (an exhausted
        # loader state would end the epoch without counting it, replaying its order). Once
        # the loop over it has ended (a save after the epoch), ``iteration`` already counts it.
        iterating = any(ref is loader for ref in _iterated(loader))
        return {
            "iteration": int(getattr(loader, "iteration", 0)) + (1 if iterating else 0),
            "state": None,
            "generator": generator.get_state() if generator is not None else None,
        }
    return {
        "iteration": int(getattr(loader, "iteration", 0)),
        "state": loader.state_dict() if getattr(loader, "use_stateful_dataloader", False) else None,
        "generator": generator.get_state() if generator is not None else None,
    }


def collect_own(accelerator: Accelerator, *, skip: object) -> dict[str, Any]:
    """This process's own state: random states and registered objects. ``custom_none``
    lists the objects whose ``state_dict()`` returned None: a None entry not listed (the
    checkpointer's own, at ``skip``, aside) is a state missing, damage (see ``_check``)."""
    custom = [None if obj is skip else obj.state_dict() for obj in accelerator._custom_objects]
    none = [
        i
        for i, (obj, entry) in enumerate(zip(accelerator._custom_objects, custom, strict=True))
        if entry is None and obj is not skip
    ]
    return {"rng": _rng_state(), "custom": custom, "custom_none": none}


def saved_none(own: dict[str, Any]) -> frozenset[int]:
    """The registered objects whose state was saved as None (their ``state_dict()`` returned
    it; none listed before coci recorded it)."""
    listed = own.get("custom_none", [])
    return frozenset(listed) if isinstance(listed, list) else frozenset()


def completed_steps(state: dict[str, Any]) -> int:
    """The optimizer steps completed when ``state`` was saved (before this was recorded, the
    label was the 0-based index of the last step taken)."""
    if "completed_steps" in state:
        return int(state["completed_steps"])
    return int(state["step"]) + 1


def sharded(accelerator: Accelerator) -> bool:
    """Whether the prepared models and optimizers hold their state sharded (FSDP)."""
    return bool(accelerator.distributed_type == DistributedType.FSDP)


def _optimizer_models(accelerator: Accelerator) -> list[Any]:
    """The model of each prepared optimizer under FSDP: model ``i`` for optimizer ``i``, as
    Accelerate's ``save_state`` pairs them."""
    acc = accelerator
    if len(acc._optimizers) > len(acc._models):
        raise ConfigError(
            f"under FSDP, optimizer i is saved with the state of model i (as Accelerate's "
            f"save_state does): prepare at least as many models as optimizers, in the same "
            f"order (prepared: {len(acc._models)} models, {len(acc._optimizers)} optimizers)"
        )
    return list(acc._models[: len(acc._optimizers)])


def _sharded_models(accelerator: Accelerator) -> list[Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [get_model_state_dict(m) for m in accelerator._models]


def _sharded_optimizers(accelerator: Accelerator) -> list[Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    models = _optimizer_models(accelerator)
    return [
        get_optimizer_state_dict(m, opt.optimizer)
        for m, opt in zip(models, accelerator._optimizers, strict=True)
    ]


def collect(
    accelerator: Accelerator, step: int, *, standins: dict[int, Any] | None = None
) -> dict[str, Any]:
    """Everything ``save_state`` would save that is the same on every process; ``step`` is
    the number of optimizer steps completed; ``standins``: by ``id`` of a prepared loader, the
    ``skip_first_batches`` loader running the rest of its epoch."""
    acc = accelerator
    standins = standins or {}
    if sharded(acc):  # each process's own shards
        models, optimizers = _sharded_models(acc), _sharded_optimizers(acc)
    else:
        models = [acc.get_state_dict(m, unwrap=False) for m in acc._models]
        optimizers = [opt.state_dict() for opt in acc._optimizers]
    return {
        "layout": LAYOUT,
        "num_processes": acc.num_processes,
        "step": step,
        "completed_steps": step,
        "accelerate_step": acc.step,
        "models": models,
        "optimizers": optimizers,
        "schedulers": [s.state_dict() for s in acc._schedulers],
        "dataloaders": [_loader_state(dl, standins.get(id(dl))) for dl in acc._dataloaders],
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
    }


def _own(accelerator: Accelerator, state: dict[str, Any]) -> dict[str, Any] | None:
    if "per_process" in state:  # written before every process wrote its own share
        mine: dict[str, Any] = state["per_process"][accelerator.process_index]
        return mine
    own = state.get(PROCESS_KEY)
    return own if isinstance(own, dict) else None


def run_save_hooks(accelerator: Accelerator, state: dict[str, Any], output_dir: str) -> None:
    """The hooks of ``register_save_state_pre_hook``, as ``save_state`` runs them: they may
    change or remove entries of the model state dicts to save (``state["models"]``)."""
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(list(accelerator._models), state["models"], output_dir)


def live_targets(accelerator: Accelerator, *, partial: bool = False) -> InPlaceTargets | None:
    """The prepared models' and optimizers' own tensors, for a resume to fill in place (see
    :meth:`CheckpointManager.restore`): under FSDP their live shards (made for an optimizer
    that has no state yet by a step with zero lr); None when a model's state is not its
    ``state_dict()`` (DeepSpeed) or when load hooks may leave models out of the loading.
    ``partial``: live tensors the checkpoint lacks are allowed (see ``InPlaceTargets``)."""
    acc = accelerator
    if sharded(acc):
        live = {"models": _sharded_models(acc), "optimizers": _sharded_optimizers(acc)}
        return InPlaceTargets(live, replaced=[("optimizers",)], partial=partial)
    if acc.distributed_type == DistributedType.DEEPSPEED:
        return None
    if acc._load_model_state_pre_hook:
        return None
    live = {
        "models": [m.state_dict() for m in acc._models],
        "optimizers": [opt.state_dict() for opt in acc._optimizers],
    }
    return InPlaceTargets(live, replaced=[("optimizers",)], partial=partial)


def check_layout(layout: Any) -> None:
    """Raise unless ``layout`` (a checkpoint's ``"layout"`` value) is this adapter's."""
    if layout != LAYOUT:
        raise CheckpointError(
            f"this checkpoint was not written by coci_accelerate (layout {layout!r}, "
            f"expected {LAYOUT!r}): point CociCheckpointer at its own directory"
        )


def stored_layout(tree: Any) -> Any:
    """The ``"layout"`` value of a checkpoint's manifest tree (a plain string is stored as
    itself), or None."""
    content = tree.get("v") if isinstance(tree, dict) else None
    return content.get("layout") if isinstance(content, dict) else None


def mismatch_error(wrong: list[str]) -> CheckpointError:
    """The error of a checkpoint whose saved objects are not those this run prepared and
    registered (``wrong``: what differs)."""
    return CheckpointError(
        "the checkpoint does not match what this run prepared and registered ("
        + "; ".join(wrong)
        + "): prepare and register the same objects, in the same order, as the run that "
        "saved it; or start a new run in another dirpath"
    )


def _check_fits(accelerator: Accelerator, state: dict[str, Any], models: list[Any]) -> None:
    acc = accelerator
    check_layout(state.get("layout"))
    counts = {
        "models": len(models),
        "optimizers": len(acc._optimizers),
        "schedulers": len(acc._schedulers),
        "dataloaders": len(acc._dataloaders),
        "registered objects": len(acc._custom_objects),
    }
    saved = {
        "models": len(state["models"]),
        "optimizers": len(state["optimizers"]),
        "schedulers": len(state["schedulers"]),
        "dataloaders": len(state["dataloaders"]),
        "registered objects": len((_own(acc, state) or {"custom": []})["custom"]),
    }
    wrong = [
        f"{k}: {saved[k]} at the save, {counts[k]} now" for k in counts if saved[k] != counts[k]
    ]
    if saved["registered objects"] != counts["registered objects"]:
        # coci's own CociCheckpointer is one of them: name them all, not only the user's
        names = ", ".join(type(o).__name__ for o in acc._custom_objects)
        wrong[-1] += f" ({names})"
    if wrong:
        raise mismatch_error(wrong)
    if state["num_processes"] != acc.num_processes:
        raise CheckpointError(
            f"the checkpoint was written by {state['num_processes']} processes and this run has "
            f"{acc.num_processes}: the data loaders' positions and every process's random "
            "states cannot follow a change in the number of processes; resume with "
            f"{state['num_processes']} processes"
        )


def _apply_sharded(
    accelerator: Accelerator, models: list[Any], state: dict[str, Any], *, strict: bool
) -> None:
    """Under FSDP: the restored shards into the models and optimizers (``models``: those the
    load hooks left to load)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for model, model_state in zip(models, state["models"], strict=True):
        set_model_state_dict(model, model_state, options=StateDictOptions(strict=strict))
    pairs = zip(_optimizer_models(accelerator), accelerator._optimizers, strict=True)
    for (model, opt), opt_state in zip(pairs, state["optimizers"], strict=True):
        set_optimizer_state_dict(model, opt.optimizer, opt_state)


def apply(
    accelerator: Accelerator,
    state: dict[str, Any],
    *,
    skip: object,
    input_dir: str = "",
    strict: bool = True,
) -> None:
    """Put a collected state back into the prepared and registered objects (every process);
    ``strict``: as ``load_state_dict``'s, for the models.

    First the hooks of ``register_load_state_pre_hook`` run, as in ``load_state``: the models
    they remove from the list they are given are not loaded from the checkpoint."""
    acc = accelerator
    models = list(acc._models)
    for hook in acc._load_model_state_pre_hook.values():
        hook(models, input_dir)
    _check_fits(acc, state, models)
    if sharded(acc):
        _apply_sharded(acc, models, state, strict=strict)
    else:
        for model, model_state in zip(models, state["models"], strict=True):
            try:
                model.load_state_dict(model_state, strict=strict)
            except RuntimeError as e:  # another architecture: torch's message, what to do
                raise model_misfit(model, e, fix=_NEW_RUN) from e
        for opt, opt_state in zip(acc._optimizers, state["optimizers"], strict=True):
            check_optimizer_fits(opt, opt_state, fix=_NEW_RUN)
            opt.load_state_dict(opt_state)
    for sched, sched_state in zip(acc._schedulers, state["schedulers"], strict=True):
        sched.load_state_dict(sched_state)
    for loader, loader_state in zip(acc._dataloaders, state["dataloaders"], strict=True):
        if hasattr(loader, "iteration"):
            loader.iteration = loader_state["iteration"]
        if loader_state["state"] is not None:
            loader.load_state_dict(loader_state["state"])
        generator = getattr(getattr(loader, "base_dataloader", loader), "generator", None)
        if generator is not None and loader_state.get("generator") is not None:
            generator.set_state(loader_state["generator"])
    if acc.scaler is not None and state["scaler"] is not None:
        acc.scaler.load_state_dict(state["scaler"])
    acc.step = state["accelerate_step"]
    mine = _own(acc, state)
    if mine is None:
        raise CheckpointError(f"the checkpoint has no state of process {acc.process_index}")
    none = saved_none(mine)
    for i, (obj, obj_state) in enumerate(zip(acc._custom_objects, mine["custom"], strict=True)):
        if obj is not skip and (obj_state is not None or i in none):
            obj.load_state_dict(obj_state)  # None too, as Accelerate's load_state hands it
    _set_rng_state(mine["rng"])


def agree_on_apply(accelerator: Accelerator, step: int | None, failure: Exception | None) -> None:
    """Every process learns whether each put the restored state back (one collective with
    several processes): a registered object's ``load_state_dict`` that raised on one process
    only stopped that process, while the others trained on into a collective with it.

    Raises:
        CheckpointError: on every process when one did not, naming the first (chained to its
            own error on that process); ``failure`` itself with one process."""
    if accelerator.num_processes == 1:
        if failure is not None:
            raise failure
        return
    from accelerate.utils import gather_object

    said = f"{type(failure).__name__}: {failure}" if failure is not None else None
    failed = [(i, m) for i, m in enumerate(gather_object([said])) if m is not None]
    if failed:
        index, message = failed[0]
        raise CheckpointError(
            f"process {index} could not put step {step}'s state back ({message}): every "
            "process stops"
        ) from failure
