"""``coci export --format transformers``: a coci step of a ``CociCallback`` run written as the
Trainer's own ``checkpoint-N`` directory, which ``Trainer.train(resume_from_checkpoint=...)``
and ``from_pretrained`` read natively: ``model.safetensors``, ``config.json``,
``trainer_state.json``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (when saved) and
``rng_state.pth`` (``rng_state_<i>.pth`` per process of a run of several). A step saved under
FSDP2 is written whole (the optimizer keyed by index, as without FSDP).

The way back needs no command: ``trainer.train(resume_from_checkpoint="<output_dir>/checkpoint-N")``
with a ``CociCallback`` attached resumes from the Trainer's directory, and coci saves from there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

import coci_transformers._state as _state
from coci_core.errors import ConfigError
from coci_core.training import directory_beside, newest_step_dir, read_checkpoint, step_dir_of
from coci_transformers._check import check_saved

__all__ = ["export_step"]


def _writer(state: object) -> str:
    """Who wrote ``state``, in words (Lightning's holds its version; a loop's, anything)."""
    if isinstance(state, dict) and state.get("layout") == "coci.accelerate/1":
        return "CociCheckpointer (Accelerate)"
    if isinstance(state, dict) and "pytorch-lightning_version" in state:
        return "CociCheckpoint (Lightning)"
    return "a CheckpointManager"


def export_step(directory: str, out: str | os.PathLike[str], step: int | str | None = None) -> str:
    """Write ``step`` of the coci directory ``directory`` (default: the step a resume takes)
    to the directory ``out`` in the Trainer's layout; a one-line summary. A ``step`` given is
    that step or an error, as ``coci export --step`` (never another step in its place).

    Raises:
        NoCheckpointError: no committed checkpoint (or none at ``step``).
        CorruptCheckpointError: ``step`` is damaged.
        ConfigError: the step was not written by ``CociCallback``.
    """
    if step is None:  # the step a resume takes: the newest, past damaged ones
        newest = newest_step_dir(directory)
        found = step_dir_of(newest) if newest is not None else None
        loaded, _ = read_checkpoint(
            directory, found[1] if found else 0, fall_back=True, check=check_saved
        )
    else:  # a state the Trainer cannot load (a forged, resealed manifest) is damage
        loaded, _ = read_checkpoint(directory, step, check=check_saved)
    state = loaded.state
    layout = state.get("layout") if isinstance(state, dict) else None
    if layout != _state.LAYOUT:
        raise ConfigError(
            f"--format transformers exports checkpoints of CociCallback (the Trainer's); step "
            f"{loaded.step} was written by {_writer(state)}: export it with --format torch, or "
            "to a .safetensors file with --weights-only"
        )
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    # written beside OUT and swapped in whole: an export killed midway, or two at once of
    # different steps, never leave one step's files beside another's (before: written into
    # OUT in place, over and beside an earlier export's files)
    with directory_beside(target, "transformers") as tmp:
        written = _write_layout(state, tmp, directory, loaded.step)
    return f"exported step {loaded.step} to {target} (transformers: {', '.join(written)})"


def _write_layout(state: dict[str, Any], target: Path, directory: str, step: int) -> list[str]:
    """Write ``state`` (``step`` of ``directory``) into the directory ``target`` in the
    Trainer's layout; the names of the files written."""
    _write_weights(state["model"], target / "model.safetensors", state.get("model_config"))
    written = ["model.safetensors"]
    if state.get("model_config"):
        (target / "config.json").write_text(str(state["model_config"]))
        written.append("config.json")
    trainer_state = json.loads(state["trainer_state"])
    (target / "trainer_state.json").write_text(
        json.dumps(trainer_state, indent=2, sort_keys=True) + "\n"
    )
    written.append("trainer_state.json")
    if not state.get("weights_only"):
        optimizer = state["optimizer"]
        if state.get("sharded"):  # keyed by parameter name under FSDP
            optimizer = _by_index(optimizer)
        torch.save(optimizer, target / "optimizer.pt")
        torch.save(state["scheduler"], target / "scheduler.pt")
        written += ["optimizer.pt", "scheduler.pt"]
        if state.get("scaler") is not None:
            torch.save(state["scaler"], target / "scaler.pt")
            written.append("scaler.pt")
        world = int(state.get("world_size") or 1)
        for rank in range(world):
            mine = _state.own(state if rank == 0 else _rank_state(directory, step, rank))
            if mine is None:
                continue
            name = "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"
            torch.save(mine["rng"], target / name)
            written.append(name)
    return written


def _by_index(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``, as saved under
    FSDP) keyed by index instead, as ``optimizer.state_dict()`` gives it: the parameters
    numbered in the order of the parameter groups, which the names are listed in."""
    index: dict[str, int] = {}
    groups = []
    for group in optimizer["param_groups"]:
        params = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": params})
    state = {index[name]: value for name, value in optimizer["state"].items()}
    return {"state": state, "param_groups": groups}


def _rank_state(directory: str, step: int, rank: int) -> dict[str, Any]:
    loaded, _ = read_checkpoint(directory, step, rank=rank, check=check_saved)
    state: dict[str, Any] = loaded.state
    return state


def _write_weights(weights: dict[str, torch.Tensor], path: Path, config: object = None) -> None:
    """``weights`` as ``save_pretrained`` writes them: of names that share one tensor (tied
    embeddings), those the model's class declares tied (``_tied_weights_keys``) are left out,
    as ``from_pretrained`` ties them back; any other sharing is written as copies."""
    from safetensors.torch import save_file  # a dependency of transformers

    tied = _tied_patterns(config)
    shared: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for name, tensor in weights.items():
        if tensor.numel():
            alias = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
            shared.setdefault((*alias, tuple(tensor.shape), tuple(tensor.stride())), []).append(
                name
            )
    left_out: set[str] = set()
    for names in shared.values():  # transformers' remove_tied_weights_from_state_dict
        found = [n for n in sorted(names) if any(re.search(p, n) for p in tied)]
        left_out.update(found[: len(names) - 1] if len(found) == len(names) else found)
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in weights.items():
        if name in left_out:
            continue
        t = tensor.detach().contiguous()
        if t.untyped_storage().data_ptr() in storages and t.numel():
            t = t.clone()  # safetensors refuses tensors that share memory
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    save_file(tensors, str(path), metadata={"format": "pt"})


def _tied_patterns(config: object) -> list[str]:
    """The tied weights' name patterns of the model class that ``config`` (the saved
    ``config.json``) names in ``architectures``: a class of ``transformers``, looked up by
    name and never called; none for any other name."""
    import transformers

    try:
        architectures = json.loads(str(config)).get("architectures") if config else None
    except (ValueError, AttributeError):
        return []
    patterns: list[str] = []
    for name in architectures if isinstance(architectures, list) else []:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            keys = getattr(cls, "_tied_weights_keys", None) or []
            patterns += [k for k in keys if isinstance(k, str)]
    return patterns
