"""How Lightning finds coci checkpoints: ``ckpt_path="last"/"best"``, and
``load_from_checkpoint`` of a coci step directory.

Lightning resolves ``ckpt_path`` before any callback hook runs, looking only at
``ModelCheckpoint`` and ``OnExceptionCheckpoint`` callbacks, and takes "best" from the first
``Checkpoint`` callback (which may be a ``CociCheckpoint``, which keeps no best model). coci
wraps that resolution once (idempotently) so that, when a ``CociCheckpoint`` is attached:

- ``"last"`` (and ``None`` in ``fit`` with ``CociCheckpoint(resume=True)``) is the newest of coci's
  newest committed step and Lightning's own "last" candidates (``ModelCheckpoint`` last files,
  ``OnExceptionCheckpoint``), by modification time as Lightning picks among its own; a tie
  goes to coci;
- ``"best"`` (and ``None`` in validate/test/predict without a model, which Lightning turns into
  "best") is the first ``ModelCheckpoint``'s best model; without a ``ModelCheckpoint``, the
  kept coci checkpoint with the lowest value of ``CociCheckpoint(monitor=...)``, or without a
  monitor the newest kept checkpoint (as ``ModelCheckpoint()`` without one); with no kept
  checkpoint, ``None`` evaluates the weights in memory (with an info line) and ``"best"`` is a
  ValueError saying what to do.
"""

from __future__ import annotations

import functools
import io
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from coci_core.training import (
    MANIFEST_NAME,
    parse_step_dir,
    read_checkpoint,
    read_torch_file,
    step_dir_of,
)
from coci_lightning._io import use_coci_io
from coci_lightning.callback import CociCheckpoint

__all__ = ["install_last_resolution"]

logger = logging.getLogger(__name__)


def install_last_resolution() -> None:
    """Make ``ckpt_path="last"/"best"`` work with coci checkpoints, and
    ``load_from_checkpoint`` read a coci step directory (safe to call many times)."""
    _install_load_from_checkpoint()
    # Private: Lightning resolves "last"/"best" here, before any callback hook runs, and
    # offers no hook to extend it; wrapping it is the only way for "last" to mean coci's step.
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, "_coci", False):
        return

    def resolve(
        self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, cocis: list[Any], **kwargs: Any
    ) -> Any:
        """The checkpoint this rank resolves ``ckpt_path`` to (``cocis``: the attached
        ``CociCheckpoint`` callbacks)."""
        fn = str(getattr(state_fn, "value", state_fn))
        fitting = fn == "fit"
        # "last" for every entry point; resume=True (no ckpt_path) only for fit
        if cocis and (ckpt_path == "last" or (ckpt_path is None and fitting and cocis[0].resume)):
            return _resolve_last(self.trainer, cocis[0])
        # Lightning turns None into "best" when a model is connected but not passed
        implicit = (
            ckpt_path is None
            and not fitting
            and not kwargs.get("model_provided", False)
            and kwargs.get("model_connected", False)
        )
        if cocis and (ckpt_path == "best" or implicit):
            return _resolve_best(self.trainer, cocis[0], fn, implicit=implicit)
        resolved = original(self, state_fn, ckpt_path, **kwargs)
        options = cocis[0].storage_options_for(resolved) if cocis else None
        if step_dir_of(resolved, options) is not None:
            # validate/test/predict (and fit) of a coci step directory, with or without a
            # CociCheckpoint attached: read it with coci's restore
            use_coci_io(self.trainer)
        return resolved

    @functools.wraps(original)
    def parse_ckpt_path(
        self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, **kwargs: Any
    ) -> Any:
        callbacks = getattr(self.trainer, "callbacks", [])
        cocis = [cb for cb in callbacks if isinstance(cb, CociCheckpoint)]
        resolved = resolve(self, state_fn, ckpt_path, cocis, **kwargs)
        if cocis:  # the ranks compare what each resolved at the callback's setup
            cocis[0].resolved_ckpt_path = (resolved,)
        return resolved

    parse_ckpt_path._coci = True  # type: ignore[attr-defined]
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path  # type: ignore[method-assign,assignment]


def _mtime(path: str, **storage_options: Any) -> float:
    """The modification time of ``path`` (seconds since the epoch), 0 if unreadable."""
    try:
        return float(get_filesystem(path, **storage_options).modified(path).timestamp())
    except Exception:
        return 0.0


def _global_step(path: str) -> int | None:
    """The ``global_step`` a Lightning checkpoint file records (None if it cannot be read
    with ``weights_only=True``, or its pickles are crafted: never a crash of the resume)."""
    try:
        if get_filesystem(path).protocol in ("file", "local", ("file", "local")):
            loaded = read_torch_file(Path(path), what=path)
        else:
            with get_filesystem(path).open(path, "rb") as f:
                loaded = read_torch_file(f.read(), what=path)
        return int(loaded["global_step"])
    except Exception:
        return None


def _resolve_last(trainer: Any, coci: Any) -> str | None:
    """The newest "last" checkpoint: coci's newest committed step or one of Lightning's own
    candidates (ModelCheckpoint's last files, OnExceptionCheckpoint's), by the optimizer step
    they record (coci writes asynchronously, so its files may be younger than a later step's
    ``last.ckpt``); a tie is coci's. A file whose step cannot be read is compared by
    modification time, as Lightning compares its own candidates."""
    newest = coci.newest_step_dir(trainer)
    lightning_paths = {
        getattr(cb, "ckpt_path", None)
        for cb in trainer.callbacks
        if isinstance(cb, OnExceptionCheckpoint)
    }
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint):
            lightning_paths |= cb._find_last_checkpoints(trainer)
    others = [str(p) for p in lightning_paths if p and get_filesystem(str(p)).exists(str(p))]
    steps = {p: _global_step(p) for p in others}
    times = {p: _mtime(p) for p in others}
    if newest is not None:
        coci_step = parse_step_dir(str(newest).rstrip("/").rsplit("/", 1)[-1]) or 0
        manifest = str(newest).rstrip("/") + "/" + MANIFEST_NAME
        # only compared with Lightning's own files (no request to the store without them)
        coci_time = _mtime(manifest, **coci.storage_options_for(manifest)) if others else 0.0
        newer = []
        for p in others:
            step = steps[p]
            if (step > coci_step) if step is not None else (times[p] > coci_time):
                newer.append(p)
        if not newer:
            # setup() has not run yet: remember that this path may fall back past damage
            coci._fallback_for = str(newest)
            use_coci_io(trainer).fallback_for = str(newest)
            return str(newest)
        others = newer
    if others:
        chosen = max(others, key=lambda p: (steps[p] if steps[p] is not None else -1, times[p]))
        if newest is not None:
            rank_zero_info(f'coci: ckpt_path="last" is {chosen}, newer than coci\'s {newest}')
        return chosen
    rank_zero_info(
        f"coci: no committed checkpoint in {coci.resolve_dirpath(trainer)}; starting fresh"
    )
    return None


def _resolve_best(trainer: Any, coci: Any, fn: str, *, implicit: bool) -> str | None:
    """``"best"`` with a CociCheckpoint attached: the first ModelCheckpoint's best model (as
    Lightning, which would take the first ``Checkpoint`` callback, possibly coci's); without
    one, coci's best (by its ``monitor``; without one, its newest kept checkpoint); with none
    kept, ``None`` (implicit) evaluates the weights in memory and ``"best"`` is an error."""
    models = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if not models and (coci.monitor is not None or coci.best_model_path):
        return _coci_best(trainer, coci, fn, implicit=implicit)
    if not models:  # no monitor, and no kept checkpoint yet
        if implicit:
            logger.info(
                "coci: `.%s()` without a model or ckpt_path: evaluating the weights in memory "
                "(CociCheckpoint has no kept checkpoint to load as the best model).",
                fn,
            )
            return None
        raise ValueError(
            f'`.{fn}(ckpt_path="best")` is set but CociCheckpoint has no kept checkpoint in '
            f"{coci.resolve_dirpath(trainer)} (without a monitor, the best model is the newest "
            'kept checkpoint). Pass an exact ckpt_path, or give CociCheckpoint(monitor="...") '
            "for the kept checkpoint with the lowest value of a metric."
        )
    if implicit:  # Lightning's own message for this case
        rank_zero_warn(
            f"`.{fn}(ckpt_path=None)` was called without a model. The best model of the "
            f"previous `fit` call will be used. You can pass `.{fn}(ckpt_path='best')` to use "
            f"the best model or `.{fn}(ckpt_path='last')` to use the last model. If you pass "
            "a value, this warning will be silenced."
        )
    if len(models) > 1:
        rank_zero_warn(
            f'`.{fn}(ckpt_path="best")` is called with Trainer configured with multiple '
            "`ModelCheckpoint` callbacks. It will use the best checkpoint path from first "
            "checkpoint callback."
        )
    best = models[0].best_model_path
    if not best:
        if trainer.fast_dev_run:
            raise ValueError(
                f'You cannot execute `.{fn}(ckpt_path="best")` with `fast_dev_run=True`. Please '
                f"pass an exact checkpoint path to `.{fn}(ckpt_path=...)`"
            )
        raise ValueError(
            f'`.{fn}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured to save '
            "the best model."
        )
    return best


def _coci_best(trainer: Any, coci: Any, fn: str, *, implicit: bool) -> str:
    """The kept coci checkpoint with the lowest value of ``coci.monitor`` (without one: the
    newest kept)."""
    best = coci.best_model_path
    if not best:
        if trainer.fast_dev_run:
            raise ValueError(
                f'You cannot execute `.{fn}(ckpt_path="best")` with `fast_dev_run=True`. Please '
                f"pass an exact checkpoint path to `.{fn}(ckpt_path=...)`"
            )
        raise ValueError(
            f'`.{fn}(ckpt_path="best")` is set but CociCheckpoint(monitor={coci.monitor!r}) '
            f"has no kept checkpoint saved with a value of {coci.monitor!r} yet (is it logged "
            'before the saves?). Pass ckpt_path="last" for coci\'s newest checkpoint.'
        )
    if implicit:  # Lightning's own message for this case
        rank_zero_warn(
            f"`.{fn}(ckpt_path=None)` was called without a model. The best model of the "
            f"previous `fit` call will be used. You can pass `.{fn}(ckpt_path='best')` to use "
            f"the best model or `.{fn}(ckpt_path='last')` to use the last model. If you pass "
            "a value, this warning will be silenced."
        )
    use_coci_io(trainer)  # read the step directory with coci's restore
    return str(best)


def _install_load_from_checkpoint() -> None:
    """``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read the file
    with ``lightning.pytorch.core.saving.pl_load``: wrap it so that a coci step directory is
    read with coci's verified restore (then loaded as a file would be, with ``map_location``
    and ``weights_only``)."""
    from lightning.pytorch.core import saving

    original = getattr(saving, "pl_load")  # noqa: B009 (not in the module's __all__)
    if getattr(original, "_coci", False):
        return

    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if not isinstance(path_or_url, (str, Path)) or step_dir_of(path_or_url) is None:
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        root, step = step_dir_of(path_or_url)  # type: ignore[misc]
        state = read_checkpoint(root, step, agree=False)[0].state  # may run on one rank only
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        if weights_only is None:
            # The buffer holds what coci's restore built, without pickle, from the checkpoint
            # (its hyper-parameters' DictConfig, which torch's weights-only load refuses, as it
            # refuses Lightning's own .ckpt with one): nothing from the file runs when it loads.
            weights_only = False
        return original(buffer, map_location=map_location, weights_only=weights_only)

    pl_load._coci = True  # type: ignore[attr-defined]
    setattr(saving, "pl_load", pl_load)  # noqa: B010
