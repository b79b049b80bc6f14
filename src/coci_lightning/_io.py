"""How Lightning reads coci checkpoints: a CheckpointIO that reads coci step directories.

Lightning restores everything through its own path (``ckpt_path``, resolved by
:mod:`coci_lightning._resume`); the strategy's CheckpointIO is wrapped so that reading a coci step
directory goes through coci's verified restore.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from coci_core.errors import CheckpointError, NoCheckpointError
from coci_core.storage import is_url
from coci_core.telemetry import RestoreEvent
from coci_core.training import (
    MANIFEST_NAME,
    parse_step_dir,
    ranks_read_alike,
    read_checkpoint,
    step_dir_name,
    step_dir_of,
)
from coci_lightning._rng import check_saved_rng
from coci_lightning._sharded import use_sharded_load

if TYPE_CHECKING:
    from coci_core.training import LoadedCheckpoint

logger = logging.getLogger(__name__)


class CociCheckpointIO(CheckpointIO):
    """Reads coci step directories with coci's verified restore; delegates everything else."""

    def __init__(
        self,
        inner: CheckpointIO,
        on_restore: Callable[[LoadedCheckpoint, RestoreEvent], None] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.on_restore = on_restore
        self.fallback_for: str | None = None
        self.rank = 0  # whose per-rank state to merge in (set by the callback's setup)
        # for an fsspec URL directory (set by the callback; credentials: never logged)
        self.storage_options: dict[str, Any] = {}
        # the checkpoint directory and the remote tier's URL and options, for a resume from
        # the newest intact checkpoint of either tier (set by the callback)
        self.directory: str | None = None
        self.remote: str | None = None
        self.remote_storage_options: dict[str, Any] = {}
        # the live state a resume reads into in place ({"state_dict": the module's}; set by
        # the callback): Lightning loads the module from the checkpoint's "state_dict" later
        self.live_state: Callable[[], Mapping[str, Any]] | None = None
        # whether the module loads strictly (LightningModule.strict_loading; set by the
        # callback): when it does not, live tensors the checkpoint lacks are allowed
        self.strict_loading: Callable[[], bool] = lambda: True
        # the step directory the last read restored: another than the one asked for when
        # "last" fell back past a damaged step (the callback makes Lightning name it)
        self.restored_path: str | None = None

    def configure(
        self,
        module: pl.LightningModule,
        *,
        rank: int,
        directory: str,
        storage_options: Mapping[str, Any],
        remote: str | None,
        remote_storage_options: Mapping[str, Any],
        on_restore: Callable[[LoadedCheckpoint, RestoreEvent], None],
        fallback_for: str | None,
    ) -> None:
        """Read coci step directories for a ``CociCheckpoint`` (its setup calls this)."""
        self.on_restore = on_restore
        self.fallback_for = fallback_for
        self.rank = rank
        self.storage_options = dict(storage_options)
        self.directory = directory
        self.remote = remote
        self.remote_storage_options = dict(remote_storage_options)
        # a resume reads the module's tensors in place (no second copy of them); Lightning
        # creates the optimizers after it reads the checkpoint, and they adopt its tensors.
        # Not when the module's on_load_checkpoint may change what it loads (keep a weight).
        own_hook = type(module).on_load_checkpoint is not pl.LightningModule.on_load_checkpoint
        self.live_state = None if own_hook else lambda: {"state_dict": module.state_dict()}
        self.strict_loading = lambda: bool(getattr(module, "strict_loading", True))

    def options_for(self, path: Any) -> dict[str, Any]:
        """The fsspec options of the tier that ``path`` is in."""
        return tier_options(path, self.storage_options, self.remote, self.remote_storage_options)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def is_coci(self, path: Any) -> bool:
        """Whether ``path`` is a committed coci step directory."""
        return step_dir_of(path, self.options_for(path)) is not None

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not self.is_coci(path):
            _refuse_a_checkpoint_directory(path)
            return self.inner.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        live = getattr(self, "live_state", None)
        strict = getattr(self, "strict_loading", lambda: True)()
        return self.read(path, live() if live is not None else None, partial=not strict)

    def read(
        self,
        path: Any,
        live: Mapping[str, Any] | None,
        replaced: Iterable[tuple[Any, ...]] = (),
        *,
        partial: bool = False,
    ) -> dict[str, Any]:
        """The state of the coci step directory ``path``, its tensors read in place into
        ``live``'s where they fit (``replaced``: paths whose ``load_state_dict`` replaces the
        whole state, as an optimizer's; ``partial``: live tensors the checkpoint lacks are
        allowed, else ``StateMismatchError``)."""
        options = self.options_for(path)
        found = step_dir_of(path, options)
        if found is None:
            raise ValueError(f"{path} is not a committed coci step directory")
        root, step = found
        if getattr(self, "fallback_for", None) == str(path):
            # "last": the newest intact checkpoint of either tier, as the manager's restore
            loaded, event = read_checkpoint(
                getattr(self, "directory", None) or root,
                step,
                storage_options=self.storage_options,
                rank=self.rank,
                live=live,
                replaced=replaced,
                partial=partial,
                check=functools.partial(check_saved_rng, rank=self.rank),
                fall_back=True,
                remote=self.remote,
                remote_storage_options=self.remote_storage_options,
            )
        else:
            loaded, event = read_checkpoint(
                root,
                step,
                storage_options=options,
                rank=self.rank,
                live=live,
                replaced=replaced,
                partial=partial,
                check=functools.partial(check_saved_rng, rank=self.rank),
            )
        self.restored_path = str(path)
        tier = self.remote if event.tier == "remote" and self.remote else None
        if loaded.step != _step_of(step):
            base = tier or getattr(self, "directory", None) or str(root)
            self.restored_path = f"{str(base).rstrip('/')}/{step_dir_name(loaded.step)}"
        if self.on_restore is not None:
            self.on_restore(loaded, event)
        if self.rank == 0:
            where = f"{tier} (the remote tier)" if tier else root
            logger.info("coci: Lightning restores step %d from %s", loaded.step, where)
        return loaded.state

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _step_of(ref: object) -> int | None:
    """The step a reference names (a step, or a step directory's name)."""
    return ref if isinstance(ref, int) else parse_step_dir(str(ref))


def tier_options(
    path: object,
    options: Mapping[str, Any],
    remote: str | None,
    remote_options: Mapping[str, Any],
) -> dict[str, Any]:
    """The fsspec options for ``path``: ``remote_options`` when it is under ``remote`` (the
    second tier), else ``options``."""
    if remote is not None and str(path).startswith(remote.rstrip("/") + "/"):
        return dict(remote_options)
    return dict(options)


def use_coci_io(trainer: Any) -> CociCheckpointIO:
    """Wrap the strategy's CheckpointIO (once) so that it reads coci step directories; for a
    strategy with sharded state, which reads checkpoints itself, wrap its reader too."""
    strategy = trainer.strategy
    io = strategy.checkpoint_io
    if not isinstance(io, CociCheckpointIO):
        io = CociCheckpointIO(io)
        strategy.checkpoint_io = io
    use_sharded_load(strategy, io)
    return io


def agree_on_resume(path: object, directory: str, options: Mapping[str, Any]) -> None:
    """Raise the same error on every rank unless all of them read a coci checkpoint, or none does,
    and those that read a file of Lightning's own all read one of the same name. Lightning
    resolves ``ckpt_path`` (``"last"``) on each rank alone: a rank that saw no coci checkpoint
    in its ``directory`` (another directory, a node's own disk) or a newer Lightning file
    started fresh or read that file, while the others waited for it in the restore's agreement
    (30 min), and then in a collective. ``options``: the fsspec options of ``path``'s tier.

    Raises:
        CorruptCheckpointError, CheckpointError: as :func:`ranks_read_alike
            <coci_core.training.ranks_read_alike>`.
    """
    if path is None:
        ranks_read_alike(None, NoCheckpointError(f"no committed checkpoint in {directory}"))
    elif step_dir_of(path, options) is None:
        # a file of Lightning's own: every rank reads one of that name, or none does (before:
        # a rank whose node's disk held an OnExceptionCheckpoint or last file resumed from it
        # while the others started fresh)
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        not_coci = CheckpointError(f"it reads {path}, not a coci checkpoint")
        ranks_read_alike(None, not_coci, name=f"Lightning's {name}")
    else:
        ranks_read_alike(str(path))


def _refuse_a_checkpoint_directory(path: Any) -> None:
    """A ``ckpt_path`` that is a local coci checkpoint directory (``<default_root_dir>/coci``)
    rather than one of its steps: a ``ValueError`` saying what to give instead, not the
    ``IsADirectoryError`` of Lightning's ``torch.load``."""
    if not isinstance(path, (str, os.PathLike)) or is_url(path) or not os.path.isdir(path):
        return
    steps = sorted(
        (parsed, entry.name)
        for entry in Path(path).iterdir()
        if (parsed := parse_step_dir(entry.name)) is not None and (entry / MANIFEST_NAME).is_file()
    )
    if steps:
        raise ValueError(
            f"ckpt_path={str(path)!r} is a coci checkpoint directory, not a checkpoint: give "
            f"one of its steps (e.g. {str(Path(path) / steps[-1][1])!r}), or ckpt_path='last' "
            "for the newest checkpoint of the CociCheckpoint's dirpath"
        )
