"""Finding and reading checkpoints by their step directories, for an adapter whose framework
picks and loads a checkpoint by path itself (Lightning's ``ckpt_path``), not through
:meth:`Checkpointer.restore <coci_core.training.Checkpointer.restore>`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from coci_core.engine.inplace import InPlaceTargets
from coci_core.engine.manifest import MANIFEST_NAME, parse_step_dir, step_dir_name
from coci_core.engine.restore import LoadedCheckpoint, restore_newest, resume_order
from coci_core.storage import open_storage
from coci_core.telemetry import RestoreEvent

__all__ = ["newest_step_dir", "read_checkpoint", "step_dir_of"]


def step_dir_of(
    path: Any, storage_options: Mapping[str, Any] | None = None
) -> tuple[Path | str, int] | None:
    """(root, step) when ``path`` is a committed coci step directory, else None. An fsspec
    URL (``s3://bucket/run/step-...``) stays a string, its root too; ``storage_options`` reach
    its file system."""
    if isinstance(path, str) and "://" in path:
        root, _, name = path.rstrip("/").rpartition("/")
        step = parse_step_dir(name)
        if step is None or "://" not in root:
            return None
        try:
            committed = open_storage(root, **(storage_options or {})).exists(
                f"{name}/{MANIFEST_NAME}"
            )
        except (OSError, ValueError):
            return None
        return (root, step) if committed else None
    try:
        p = Path(path)
    except TypeError:
        return None
    step = parse_step_dir(p.name)
    if step is None or not (p / MANIFEST_NAME).is_file():
        return None
    return p.parent, step


def newest_step_dir(
    directory: Path | str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    remote: str | None = None,
    remote_storage_options: Mapping[str, Any] | None = None,
) -> Path | str | None:
    """The step directory a resume tries first (the newest checkpoint of the newest run, by
    commit sequence, in ``directory`` or the ``remote`` tier); or None. A URL stays a string."""
    remote_storage = None
    if remote is not None:
        remote_storage = open_storage(remote, **dict(remote_storage_options or {}))
    candidates = resume_order(
        open_storage(str(directory), **dict(storage_options or {})), remote_storage
    )
    if not candidates:
        return None
    newest = candidates[0]
    base = directory if newest.tier == "local" or remote is None else remote
    if isinstance(base, str):
        return base.rstrip("/") + "/" + step_dir_name(newest.step)
    return base / step_dir_name(newest.step)


def read_checkpoint(
    directory: Path | str,
    step: int,
    *,
    storage_options: Mapping[str, Any] | None = None,
    rank: int = 0,
    live: Mapping[str, Any] | None = None,
    replaced: Iterable[tuple[Any, ...]] = (),
    partial: bool = False,
    fall_back: bool = False,
    remote: str | None = None,
    remote_storage_options: Mapping[str, Any] | None = None,
) -> tuple[LoadedCheckpoint, RestoreEvent]:
    """Restore ``step`` of ``directory`` (verified) with ``rank``'s per-rank state, and the
    event to report. ``live``: a state whose tensors are filled in place (no second copy; its
    DTensors receive the boxes they hold, on any mesh); ``replaced``: paths in it whose
    ``load_state_dict`` replaces their whole state (see ``InPlaceTargets``); ``partial``:
    tensors of ``live`` that the checkpoint has no value for are allowed (else
    ``StateMismatchError``).
    ``fall_back``: the newest intact checkpoint from ``step`` on, of ``directory`` or the
    ``remote`` tier, as a resume takes it (past damaged ones).

    Raises:
        NoCheckpointError, CorruptCheckpointError, StateMismatchError, StorageError: as
            :meth:`CheckpointManager.restore <coci_core.CheckpointManager.restore>`.
    """
    targets = InPlaceTargets(live, replaced, partial=partial) if live is not None else None
    storage = open_storage(str(directory), **dict(storage_options or {}))
    if fall_back:
        remote_storage = None
        if remote is not None:
            remote_storage = open_storage(remote, **dict(remote_storage_options or {}))
        loaded, event = restore_newest(
            storage, start_at=step, rank=rank, targets=targets, remote=remote_storage
        )
    else:
        loaded, event = restore_newest(storage, step, rank=rank, targets=targets)
    if targets is not None:
        targets.check(loaded.step)
    return loaded, event
