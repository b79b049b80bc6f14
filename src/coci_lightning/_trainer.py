"""What the callback reads from the Trainer: the loss, the steps per epoch and of the run,
whether the monitored metric is logged and the train loaders are stateful; and the checked
``dirpath``."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_warn

from coci_core.errors import ConfigError
from coci_core.planner import Planner


def check_monitor(trainer: pl.Trainer, monitor: str | None, *, warn: bool) -> bool:
    """As ``ModelCheckpoint(monitor=...)``: a missing metric is an error once a validation
    has run (the metric may be a validation one, logged only then), and a warning before that
    when ``warn``. Returns whether it warned."""
    if not monitor or monitor in trainer.callback_metrics:
        return False
    message = (
        f"`CociCheckpoint(monitor={monitor!r})` could not find the monitored key in "
        f"the logged metrics: {list(trainer.callback_metrics)}. HINT: Did you call "
        f"`log({monitor!r}, value)` in the `LightningModule`?"
    )
    # Private: whether a validation ran yet is what ModelCheckpoint's own check uses.
    if trainer.fit_loop.epoch_loop.val_loop._has_run:
        raise MisconfigurationException(message)
    if warn:
        rank_zero_warn(message)
    return warn


def loss_of(trainer: pl.Trainer, monitor: str | None, outputs: Any) -> float | None:
    """The loss to plan with: the ``monitor`` metric, else the training step's loss."""
    value = trainer.callback_metrics.get(monitor) if monitor else outputs
    if isinstance(value, dict):
        value = value.get("loss")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    return float(value) if isinstance(value, (int, float)) else None


def steps_per_epoch(trainer: pl.Trainer) -> int:
    """Optimizer steps per training epoch, from the Trainer."""
    batches = trainer.num_training_batches  # known once training starts
    if not math.isfinite(batches) or batches < 1:
        raise ConfigError(
            "policy='epoch' needs the number of batches per epoch, and the train "
            f"DataLoader has no length ({batches}); use policy='every_n_steps' instead"
        )
    return max(1, math.ceil(int(batches) / trainer.accumulate_grad_batches))


def plan_horizon(planner: Planner, trainer: pl.Trainer, *, save_every_epochs: int | None) -> None:
    """At the start of training: the epoch policy's steps between saves (every
    ``save_every_epochs`` epochs), and the run's optimizer steps when no total is known
    (``max_epochs`` without ``max_steps``: the Trainer's estimate)."""
    if save_every_epochs is not None:
        planner.set_steps_per_epoch(steps_per_epoch(trainer) * save_every_epochs)
    if planner.total_steps is None:
        estimated = trainer.estimated_stepping_batches
        if math.isfinite(estimated) and int(estimated) > max(planner.start_step, 0):
            planner.total_steps = int(estimated)


def warn_unless_stateful_loaders(trainer: pl.Trainer) -> None:
    """Warn when a train loader (or, with several processes, its sampler) cannot resume
    mid-epoch exactly."""
    # Private: the Trainer exposes its train loaders publicly only as the user's objects,
    # not as the flattened loaders it iterates, which are what must be stateful.
    loaders = trainer.fit_loop._combined_loader
    for loader in loaders.flattened if loaders is not None else []:
        if not hasattr(loader, "state_dict"):
            rank_zero_warn(
                "coci: the train DataLoader is not stateful, so a run resumed mid-epoch sees "
                "some samples twice and some never. Use torchdata's StatefulDataLoader "
                "(pip install torchdata; from torchdata.stateful_dataloader import "
                "StatefulDataLoader) for exactly-once resumes."
            )
        elif trainer.world_size > 1 and not hasattr(
            getattr(getattr(loader, "batch_sampler", None), "sampler", None), "state_dict"
        ):
            rank_zero_warn(
                "coci: with several processes the train sampler must be stateful and "
                "seeded for exactly-once resumes: pass sampler=StatefulDistributedSampler("
                "dataset, shuffle=True, seed=...) (from torchdata.stateful_dataloader."
                "sampler) to the StatefulDataLoader instead of shuffle=True."
            )
