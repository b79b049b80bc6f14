"""The Trainer's side of CociCallback: which arguments coci refuses, the run's length as the
Trainer will count it, the Trainer being made, its TensorBoard writer, the collectives."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from transformers import DefaultFlowCallback, EarlyStoppingCallback, Trainer, TrainingArguments

from coci_core.errors import CociError, ConfigError
from coci_core.planner import Termination
from coci_core.preemption import Preemption, SignalNotice
from coci_core.storage import is_url
from coci_core.training import TensorBoardTelemetry, newest_step_dir

logger = logging.getLogger(__name__)

#: TrainingArguments that coci refuses, with the reason (checked when training starts)
_REFUSED: dict[str, tuple[Callable[[TrainingArguments], bool], str]] = {
    "save_strategy": (
        lambda a: str(getattr(a.save_strategy, "value", a.save_strategy)) == "best",
        "save_strategy='best' is not supported with CociCallback: coci saves when its plan "
        "says so; use load_best_model_at_end=True with metric_for_best_model to load the best "
        "kept step at the end",
    ),
    "deepspeed": (
        lambda a: bool(a.deepspeed),
        "DeepSpeed is not supported by CociCallback yet: remove the callback or deepspeed=",
    ),
    "fsdp": (
        lambda a: bool(a.fsdp) and _fsdp_version(a) != 2,
        "CociCallback saves FSDP2 through the Trainer (fsdp_config={'version': 2}, the "
        "default), not FSDP1 nor FSDP on XLA: use FSDP2, or remove the callback",
    ),
    "push_to_hub": (
        lambda a: (
            bool(a.push_to_hub)
            and str(getattr(a.hub_strategy, "value", a.hub_strategy))
            in ("checkpoint", "all_checkpoints")
        ),
        "hub_strategy='checkpoint'/'all_checkpoints' pushes the Trainer's checkpoint-N "
        "directories, which CociCallback replaces: use hub_strategy='end' (the model is "
        "pushed by trainer.push_to_hub() or trainer.save_model())",
    ),
}


def _fsdp_version(args: TrainingArguments) -> int | None:
    """The FSDP version of the Trainer's FSDP plugin (None: FSDP on XLA)."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if not plugin:
        return None
    return int(plugin.get("fsdp_version", 1))


def calling_trainer(frame: FrameType | None) -> Trainer | None:
    """The Trainer whose method is running below ``frame`` (its ``__init__`` calls
    ``on_init_end``): callbacks are given no reference to their Trainer."""
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def check_arguments(args: TrainingArguments) -> None:
    for name, (refused, message) in _REFUSED.items():
        if refused(args):
            raise ConfigError(f"TrainingArguments({name}=...): {message}")


def data_parallel_size(trainer: Trainer) -> int:
    """The processes that each take their own batches: the world size over the tensor-,
    context- and sequence-parallel sizes (``Trainer.get_total_train_batch_size``'s
    ``dp_world_size``; a model sharded when loaded, ``DistributedConfig(tp_size=2,
    fsdp_size=2)`` on 4 processes: 2)."""
    world = max(1, int(trainer.args.world_size))
    t: Any = trainer
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        size = getattr(t, name, None)
        world //= max(1, int(size())) if callable(size) else 1
    return max(1, world)


def planned_steps(trainer: Trainer) -> tuple[int | None, int | None, str]:
    """The run's optimizer steps and steps per epoch, as the Trainer will count them
    (``set_initial_training_values``), and where the total comes from."""
    args = trainer.args
    per_epoch = None
    try:
        n = len(trainer.train_dataset)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n:
        per_batch = args.train_batch_size * data_parallel_size(trainer)
        batches = n // per_batch if args.dataloader_drop_last else math.ceil(n / per_batch)
        per_epoch = max(math.ceil(batches / args.gradient_accumulation_steps), 1)
    if args.max_steps > 0:
        return args.max_steps, per_epoch, "max_steps"
    if per_epoch is None:
        return None, None, ""
    total = math.ceil(args.num_train_epochs * per_epoch)
    return (
        total,
        per_epoch,
        f"{per_epoch} steps per epoch x num_train_epochs {args.num_train_epochs:g}",
    )


def trial_termination(trial: Any) -> Termination | None:
    """An Optuna trial's termination hazard, estimated from its study (None for another
    search backend)."""
    if not hasattr(trial, "study"):
        return None
    from coci_core.hpo import optuna as coci_optuna

    return coci_optuna.study_termination(trial.study, trial=trial)


def record_step(trial: Any, step: int) -> None:
    """Record the training step of an Optuna trial's report, for later trials' estimates."""
    if hasattr(trial, "set_user_attr") and hasattr(trial, "study"):
        from coci_core.hpo import optuna as coci_optuna

        trial.set_user_attr(coci_optuna.STEP_ATTR, int(step))


def tensorboard_sink(trainer: Trainer, dirpath: Path) -> TensorBoardTelemetry:
    """The scalars go through the Trainer's TensorBoard writer (``report_to="tensorboard"``)
    when it has one, else under ``dirpath/tensorboard``; either way pointed at ``dirpath``
    for TensorBoard's coci tab."""
    for cb in trainer.callback_handler.callbacks:
        writer = getattr(cb, "tb_writer", None)
        if type(cb).__name__ == "TensorBoardCallback" and writer is not None:
            return TensorBoardTelemetry(writer=writer, telemetry_dir=dirpath)
    return TensorBoardTelemetry(dirpath / "tensorboard", telemetry_dir=dirpath)


def broadcast(obj: Any) -> Any:
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def early_stopping(trainer: Trainer) -> EarlyStoppingCallback | None:
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, EarlyStoppingCallback):
            return cb
    return None


def metric(args: TrainingArguments, metrics: Mapping[str, Any] | None) -> float | None:
    """The value of ``metric_for_best_model`` in ``metrics`` (``eval_`` prefixed as the
    Trainer reads it), if it is a finite number."""
    name = args.metric_for_best_model
    if not name or not metrics:
        return None
    key = name if name.startswith("eval_") else f"eval_{name}"
    value = metrics.get(key)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def best_kept(trainer: Trainer, kept: list[int]) -> tuple[int, float] | None:
    """The kept step with the best ``metric_for_best_model`` evaluated at it (the log
    history), and its value; None without an evaluated kept step."""
    args = trainer.args
    scores: dict[int, float] = {}
    for entry in trainer.state.log_history:
        value = metric(args, entry)
        if value is not None and entry.get("step") in kept:
            scores[int(entry["step"])] = value
    if not scores:
        return None
    sign = -1.0 if args.greater_is_better else 1.0
    step = min(scores, key=lambda k: (sign * scores[k], k))  # the earliest of equal values
    return step, scores[step]


def best_to_load(trainer: Trainer, kept: list[int]) -> tuple[int, float] | None:
    """:func:`best_kept`, said by process 0: the step to load, or that none of the ``kept``
    steps was evaluated (the final weights then stay)."""
    best = best_kept(trainer, kept)
    if trainer.args.process_index != 0:
        return best
    name = trainer.args.metric_for_best_model
    if best is not None:  # the metric as the Trainer logs it (eval_loss), 6 digits
        key = name if not name or name.startswith("eval_") else f"eval_{name}"
        logger.info("coci: loading the best kept step %d (%s %.6g)", best[0], key, best[1])
    else:
        logger.warning(
            "coci: load_best_model_at_end: no kept step was evaluated (%s at the kept steps "
            "%s; retention removed the evaluated ones): the final weights stay; keep more "
            "steps (CociCallback(keep_last=N), or keep_last=None) for the best to be kept",
            name,
            kept,
        )
    return best


def jit_checkpoint_off(trainer: Trainer, preemption: Preemption | None) -> bool:
    """While coci acts on SIGTERM, the Trainer's JIT checkpoint (``enable_jit_checkpoint``)
    is off: its SIGTERM handler is replaced by the one it replaced, before coci installs its
    own (which chains to the handler it finds), so that SIGTERM starts no timer thread that
    saves a second time 3 s later (and holds the exit back). Whether it was turned off."""
    if preemption is None or not any(
        isinstance(s, SignalNotice) and s.signum == signal.SIGTERM
        for s in preemption.make_sources()
    ):
        return False
    for callback in trainer.callback_handler.callbacks:
        manager = getattr(callback, "jit_manager", None)
        if type(callback).__name__ != "JITCheckpointCallback" or manager is None:
            continue
        with contextlib.suppress(ValueError):  # not the main thread: the handler stays
            if signal.getsignal(signal.SIGTERM) == manager._sigterm_handler:
                previous = manager._original_sigterm_handler
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        callback.jit_manager = None
        return True
    return False


def shield_eval_loaders(trainer: Trainer, shield: Callable[[Any], int]) -> None:
    """The workers of the evaluation loaders the Trainer makes from now on (one per
    evaluation) are shielded (``shield``: ``Checkpointer.shield_loader_workers``) from the
    notice's signals sent to every process of the job: ``get_eval_dataloader`` is wrapped (an
    instance attribute; no-op once the checkpointer is closed)."""
    request = trainer.get_eval_dataloader
    if getattr(request, "_coci_shields_workers", False):
        return

    @functools.wraps(request)
    def shielded(*args: Any, **kwargs: Any) -> Any:
        loader = request(*args, **kwargs)
        shield(loader)
        return loader

    shielded._coci_shields_workers = True  # type: ignore[attr-defined]
    trainer.get_eval_dataloader = shielded  # type: ignore[method-assign]


def coci_directory(path: Any) -> bool:
    """Whether ``path`` is a directory holding committed coci checkpoints."""
    try:
        return newest_step_dir(str(path)) is not None
    except (OSError, CociError):
        return False


def same_directory(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two spellings name one directory (a path by its real path, a URL by its text
    without a trailing slash)."""
    if is_url(a) or is_url(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return os.path.realpath(os.fspath(a)) == os.path.realpath(os.fspath(b))


def quiet_default_flow(trainer: Trainer) -> None:
    """The Trainer's ``DefaultFlowCallback`` no longer asks for saves (its ``save_strategy``
    schedule, and the last step's save, are coci's plan to make): its ``should_save`` is put
    back as it was after its ``on_step_end`` and ``on_epoch_end`` (instance attributes). What
    the user's own callbacks ask (``control.should_save = True``) then stands, before
    ``CociCallback`` in ``callbacks`` or after it, as with the Trainer's own saves."""
    for callback in trainer.callback_handler.callbacks:
        if not isinstance(callback, DefaultFlowCallback) or getattr(callback, "_coci", False):
            continue
        for event in ("on_step_end", "on_epoch_end"):
            setattr(callback, event, _keeping_should_save(getattr(callback, event)))
        callback._coci = True  # type: ignore[attr-defined]


def _keeping_should_save(event: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(event)
    def kept(args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        asked = control.should_save
        result = event(args, state, control, **kwargs)
        control.should_save = asked
        if result is not None and result is not control:
            result.should_save = asked
        return result

    return kept
