"""How Lightning finds and reads coci checkpoints: ``ckpt_path="last"`` and a CheckpointIO.

Lightning resolves ``ckpt_path="last"`` before any callback hook runs, looking only at
``ModelCheckpoint`` and ``OnExceptionCheckpoint`` callbacks. coci wraps that resolution once
(idempotently) so that, when a ``CociCheckpoint`` is attached, ``"last"`` (and ``None`` with
``CociCheckpoint(resume=True)``) means the newest committed coci step. Lightning then restores
everything through its own path; the strategy's CheckpointIO is wrapped in ``setup`` so that
reading a coci step directory goes through coci's verified restore.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from coci_core.errors import CorruptCheckpointError
from coci_core.manifest import MANIFEST_NAME, parse_step_dir
from coci_core.restore import LoadedCheckpoint, load_checkpoint, newest_first
from coci_core.storage import open_storage

logger = logging.getLogger(__name__)


def coci_step_of(path: Any) -> tuple[Path, int] | None:
    """(root, step) when ``path`` is a committed coci step directory, else None."""
    try:
        p = Path(path)
    except TypeError:
        return None
    step = parse_step_dir(p.name)
    if step is None or not (p / MANIFEST_NAME).is_file():
        return None
    return p.parent, step


class CociCheckpointIO(CheckpointIO):
    """Reads coci step directories with coci's verified restore; delegates everything else."""

    def __init__(
        self,
        inner: CheckpointIO,
        on_restore: Callable[[LoadedCheckpoint, float], None] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.on_restore = on_restore
        self.fallback_for: str | None = None
        self.rank = 0  # whose per-rank state to merge in (set by the callback's setup)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        found = coci_step_of(path)
        if found is None:
            return self.inner.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        root, step = found
        started = time.perf_counter()
        storage = open_storage(str(root))
        candidates = [step]
        if getattr(self, "fallback_for", None) == str(path):  # "last": fall back past damage
            order = newest_first(storage)
            candidates = order[order.index(step) :] if step in order else [step]
        for candidate in candidates:
            try:
                loaded = load_checkpoint(storage, candidate, rank=self.rank)
                break
            except CorruptCheckpointError as e:
                if candidate == candidates[-1]:
                    raise
                rank_zero_warn(f"coci: step {candidate} is damaged, using an older one: {e}")
        if self.on_restore is not None:
            self.on_restore(loaded, time.perf_counter() - started)
        logger.info("coci: Lightning restores step %d from %s", loaded.step, root)
        return loaded.state

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def use_coci_io(trainer: Any) -> CociCheckpointIO:
    """Wrap the strategy's CheckpointIO (once) so that it reads coci step directories."""
    strategy = trainer.strategy
    io = strategy.checkpoint_io
    if not isinstance(io, CociCheckpointIO):
        io = CociCheckpointIO(io)
        strategy.checkpoint_io = io
    return io


def install_last_resolution() -> None:
    """Make ``ckpt_path="last"`` find coci checkpoints (safe to call many times)."""
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, "_coci", False):
        return

    @functools.wraps(original)
    def parse_ckpt_path(
        self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, **kwargs: Any
    ) -> Any:
        from coci_lightning.callback import CociCheckpoint

        callbacks = getattr(self.trainer, "callbacks", [])
        cocis = [cb for cb in callbacks if isinstance(cb, CociCheckpoint)]
        fitting = str(getattr(state_fn, "value", state_fn)) == "fit"
        # "last" for every entry point; resume=True (no ckpt_path) only for fit
        if cocis and (ckpt_path == "last" or (ckpt_path is None and fitting and cocis[0].resume)):
            newest = cocis[0].newest_step_dir(self.trainer)
            if newest is not None:
                # setup() has not run yet: remember that this path may fall back past damage
                cocis[0]._fallback_for = str(newest)
                use_coci_io(self.trainer).fallback_for = str(newest)
                return str(newest)
            rank_zero_info(
                f"coci: no committed checkpoint in {cocis[0].resolve_dirpath(self.trainer)}; "
                "starting fresh"
            )
            return None
        resolved = original(self, state_fn, ckpt_path, **kwargs)
        if coci_step_of(resolved) is not None:
            # validate/test/predict (and fit) of a coci step directory, with or without a
            # CociCheckpoint attached: read it with coci's restore
            use_coci_io(self.trainer)
        return resolved

    parse_ckpt_path._coci = True  # type: ignore[attr-defined]
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path  # type: ignore[method-assign,assignment]
