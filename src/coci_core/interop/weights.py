"""``coci export --weights-only``: a checkpoint's model weights alone, keyed as the model's own
``state_dict()``, so that ``model.load_state_dict(safetensors.torch.load_file(path))`` (or
``torch.load(path)``) reads the file directly.

The layouts are known by their keys: Lightning's ``"state_dict"`` (the LightningModule's), a
``"model"`` (the Trainer's, by ``CociCallback``; or a loop's own ``{"model":
model.state_dict(), ...}``, as getting-started saves), Accelerate's ``"models"`` (one prepared
model). The file holds no note: ``coci import`` cannot rebuild a training state from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from coci_core.errors import CociError
from coci_core.interop.swap import file_beside

__all__ = ["WEIGHTS_LAYOUTS", "export_weights", "model_weights"]

#: the layouts whose weights ``--weights-only`` finds, by the key that holds them
WEIGHTS_LAYOUTS = {
    "state_dict": "Lightning's CociCheckpoint",
    "model": "the Trainer's CociCallback, or a loop's {'model': model.state_dict(), ...}",
    "models": "Accelerate's CociCheckpointer",
}


def model_weights(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """The model's weights in ``state`` (a restored checkpoint), keyed as its ``state_dict()``,
    and the layout they were found in.

    Raises:
        CociError: no known layout, several Accelerate models, or a value that is no tensor.
    """
    found: Any = None
    layout = ""
    if isinstance(state.get("state_dict"), Mapping):
        found, layout = state["state_dict"], "state_dict"
    elif isinstance(state.get("model"), Mapping):
        found, layout = state["model"], "model"
    elif isinstance(state.get("models"), (list, tuple)):
        models = state["models"]
        if len(models) != 1 or not isinstance(models[0], Mapping):
            raise CociError(
                f"--weights-only writes one model, and this Accelerate checkpoint holds "
                f"{len(models)}: export the whole state (without --weights-only)"
            )
        found, layout = models[0], "models"
    if found is None:
        known = ", ".join(f"{k!r} ({who})" for k, who in WEIGHTS_LAYOUTS.items())
        shown = ", ".join(repr(k) for k in list(state)[:8])
        raise CociError(
            f"--weights-only finds a model's weights under {known}; this checkpoint's keys "
            f"are {shown or 'none'}: export the whole state (without --weights-only)"
        )
    weights: dict[str, torch.Tensor] = {}
    for key, value in found.items():
        if not isinstance(value, torch.Tensor):
            raise CociError(
                f"--weights-only: the model's {key!r} is a {type(value).__name__}, not a tensor "
                "(load_state_dict of a file of tensors would miss it): export the whole state"
            )
        weights[str(key)] = value
    return weights, layout


def export_weights(state: Mapping[str, Any], out: Path, fmt: str, step: int) -> str:
    """Write the model's weights of ``state`` (step ``step``) to ``out``: ``fmt`` is
    ``safetensors`` or ``torch``; a one-line summary.

    Raises:
        CociError: no weights to write (see :func:`model_weights`), or safetensors refuses them.
    """
    weights, layout = model_weights(state)
    with file_beside(out) as tmp:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            tensors: dict[str, torch.Tensor] = {}
            storages: set[int] = set()
            for key, value in weights.items():
                t = value.detach().contiguous()
                if t.untyped_storage().data_ptr() in storages and t.numel():
                    t = t.clone()  # tied weights: safetensors refuses tensors sharing memory
                storages.add(t.untyped_storage().data_ptr())
                tensors[key] = t
            try:
                save_file(tensors, str(tmp), metadata={"coci_step": str(step)})
            except (ValueError, TypeError, RuntimeError) as e:
                raise CociError(f"cannot write {out} as safetensors: {e}") from e
        else:
            torch.save({k: v.detach() for k, v in weights.items()}, tmp)
        os.replace(tmp, out)
    return (
        f"exported the model's weights of step {step}: {len(weights)} tensors "
        f"({WEIGHTS_LAYOUTS[layout]}'s {layout!r}) to {out} ({fmt}; load_state_dict reads it)"
    )
