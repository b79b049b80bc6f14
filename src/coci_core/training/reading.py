"""Finding and reading checkpoints by their step directories, for an adapter whose framework
picks and loads a checkpoint by path itself (Lightning's ``ckpt_path``), not through
:meth:`Checkpointer.restore <coci_core.training.Checkpointer.restore>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from coci_core.engine.agreement import (
    RestoreAgreement,
    agreed_error,
    error_report,
    job_store,
    job_timeout_s,
)
from coci_core.engine.format.manifest import MANIFEST_NAME, parse_step_version, step_dir_name
from coci_core.engine.format.torch_saved import check_saved_pickle, load_weights_only
from coci_core.engine.pulse import restore_watched
from coci_core.engine.restore.inplace import InPlaceTargets
from coci_core.engine.restore.restore import (
    CheckpointRef,
    LoadedCheckpoint,
    restore_newest,
    resume_order,
    step_versions,
)
from coci_core.errors import CociError, CorruptCheckpointError
from coci_core.storage import Storage, open_storage, open_storage_named
from coci_core.telemetry import RestoreEvent

__all__ = [
    "newest_step_dir",
    "ranks_read_alike",
    "read_checkpoint",
    "read_torch_file",
    "run_step_dir",
    "step_dir_of",
]


def _ref(name: str) -> CheckpointRef | None:
    """The step of a plain step directory's name, the name itself for one saved beside
    another run's checkpoint of the step (``step-...-v1``), else None."""
    parsed = parse_step_version(name)
    if parsed is None:
        return None
    return parsed[0] if parsed[1] == 0 else name


def step_dir_of(
    path: Any, storage_options: Mapping[str, Any] | None = None
) -> tuple[Path | str, CheckpointRef] | None:
    """(root, step) when ``path`` is a committed coci step directory, else None; ``step`` is
    the directory's name instead for a checkpoint saved beside another run's of the same step
    (``step-0000000004-v1``): :func:`read_checkpoint` takes either. An fsspec URL
    (``s3://bucket/run/step-...``) stays a string, its root too; ``storage_options`` reach its
    file system."""
    if isinstance(path, str) and "://" in path:
        root, _, name = path.rstrip("/").rpartition("/")
        step = _ref(name)
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
    step = _ref(p.name)
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
        remote_storage = open_storage_named("remote", remote, remote_storage_options or {})
    candidates = resume_order(
        open_storage(str(directory), **dict(storage_options or {})), remote_storage
    )
    if not candidates:
        return None
    newest = candidates[0]
    base = directory if newest.tier == "local" or remote is None else remote
    if isinstance(base, str):
        return base.rstrip("/") + "/" + newest.name
    return base / newest.name


def run_step_dir(
    directory: Path | str,
    step: int,
    run: str | None,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """The step directory of ``run``'s checkpoint of ``step`` in ``directory`` (when two runs
    hold the step, see :func:`~coci_core.engine.format.manifest.step_dir_name`), else the step's
    plain name. A URL stays a string."""
    name = step_dir_name(step)
    if run:
        storage = open_storage(str(directory), **dict(storage_options or {}))
        own = [i for i in step_versions(storage, step) if i.intact and i.run == run]
        name = own[0].name if own else name
    if isinstance(directory, str):
        return directory.rstrip("/") + "/" + name
    return directory / name


def read_checkpoint(
    directory: Path | str | Storage,
    step: CheckpointRef,
    *,
    storage_options: Mapping[str, Any] | None = None,
    rank: int = 0,
    live: Mapping[str, Any] | None = None,
    replaced: Iterable[tuple[Any, ...]] = (),
    partial: bool = False,
    fall_back: bool = False,
    remote: str | None = None,
    remote_storage_options: Mapping[str, Any] | None = None,
    agree: bool = True,
    check: Callable[[int, dict[str, Any]], None] | None = None,
) -> tuple[LoadedCheckpoint, RestoreEvent]:
    """Restore ``step`` of ``directory`` (verified; a step directory's name, as
    :func:`step_dir_of` gives it, names that checkpoint of a step two runs hold) with
    ``rank``'s per-rank state, and the event to report. ``live``: a state whose tensors are
    filled in place (no second copy; its DTensors receive the boxes they hold, on any mesh);
    ``replaced``: paths in it whose ``load_state_dict`` replaces their whole state (see
    ``InPlaceTargets``).
    ``partial``: tensors of ``live`` that the checkpoint has no value for are allowed (else
    ``StateMismatchError``).
    ``fall_back``: the newest intact checkpoint from ``step`` on, of ``directory`` or the
    ``remote`` tier, as a resume takes it (past damaged ones). ``agree``: every process of an
    initialized ``torch.distributed`` job reads together, and all end on one step (the newest
    intact for every one of them) or raise the same error (when a process is killed while it
    reads, once it has been silent for ``RANK_SILENT_S``: see :mod:`~coci_core.engine.pulse`).
    ``check``: as for :meth:`CheckpointManager.restore <coci_core.CheckpointManager.restore>`
    (a checkpoint it finds damaged is passed over with ``fall_back``, else raised).

    Raises:
        NoCheckpointError, CorruptCheckpointError, StateMismatchError, StorageError: as
            :meth:`CheckpointManager.restore <coci_core.CheckpointManager.restore>`.
    """
    targets = InPlaceTargets(live, replaced, partial=partial) if live is not None else None
    agreement = RestoreAgreement.for_job() if agree else None
    storage = (
        directory
        if isinstance(directory, Storage)  # a manager's own (a wrapper stays one)
        else open_storage(str(directory), **dict(storage_options or {}))
    )
    with restore_watched(agreement):  # a rank killed meanwhile fails it once silent
        if fall_back:
            remote_storage = None
            if remote is not None:
                remote_storage = open_storage_named("remote", remote, remote_storage_options or {})
            loaded, event = restore_newest(
                storage,
                start_at=step,
                rank=rank,
                targets=targets,
                remote=remote_storage,
                agreement=agreement,
                check=check,
            )
        else:
            loaded, event = restore_newest(
                storage, step, rank=rank, targets=targets, agreement=agreement, check=check
            )
    if targets is not None:
        targets.check(loaded.step)
    return loaded, event


def ranks_read_alike(
    source: str | None,
    why_not: CociError | None = None,
    *,
    name: str | None = None,
    coci: bool = True,
) -> None:
    """Raise the same error on every process of the initialized ``torch.distributed`` job
    unless all of them read a coci checkpoint, or none does: for a framework that resolves the
    checkpoint to read on each process alone (Lightning's ``ckpt_path``), before it reads.
    ``source``: the coci checkpoint this process reads; None: it reads none, for ``why_not``
    (a ``NoCheckpointError`` when it found none). A process killed meanwhile fails the others'
    check once silent for ``RANK_SILENT_S``; when every process reads, its signs of life go on
    until its read (:func:`read_checkpoint`, of the job's next agreement) ends, so that a
    process killed in between fails the others' read once silent too.

    ``name``: what names the checkpoint this process reads the same on every process that reads
    the same one (a Trainer's ``checkpoint-6``, a framework's own file when ``source`` is None),
    None when it reads none: processes that name different ones raise too (one that reads a
    framework's file while another reads nothing, included). ``coci=False``: the read that
    follows is the framework's own, not coci's (no signs of life are left on for it).

    Raises:
        CorruptCheckpointError, CheckpointError: some processes read a checkpoint, others
            not (the reasons of each of those; see
            :func:`~coci_core.engine.agreement.agreed_error`), or they name different ones.
    """
    store = job_store()
    if store is None:
        return
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return
    agreement = RestoreAgreement(
        store, dist.get_rank(), world, name="alike", timeout_s=job_timeout_s(store)
    )
    report: dict[str, Any] = {"found": source, "name": name}
    if source is None:
        report = {**error_report(why_not or CociError("it reads no coci checkpoint")), "name": name}
    with restore_watched(agreement) as watched:  # a process killed meanwhile fails it
        reports = agreement.exchange(report)
        failed = sum(1 for r in reports if r.get("error"))
        # every process reads next: the read watches these beats, so that a process killed
        # before its read began (seen alive here) fails the others' read once silent too
        watched.carry = failed == 0 and coci
    names = [r.get("name") for r in reports]
    if failed in (0, len(reports)) and any(n != names[0] for n in names):
        said = ", ".join(f"process {r}: {n or 'nothing'}" for r, n in enumerate(names))
        raise CorruptCheckpointError(
            f"the processes would resume from different checkpoints ({said}). Each process "
            "resolves the checkpoint on its own: every process must see the same checkpoint "
            "directory (a shared file system or an object store, not each node's own disk)"
        )
    if 0 < failed < len(reports):
        e = agreed_error(reports)
        raise type(e)(
            f"{e}. Each process resolves the checkpoint on its own: every process must see "
            "the same checkpoint directory (a shared file system or an object store, not each "
            "node's own disk) and resume from the same checkpoint"
        )


def read_torch_file(source: bytes | Path, *, what: str) -> Any:
    """A ``torch.save`` file of the framework's own (its bytes, or a local path, then
    memory-mapped), loaded on the CPU with ``torch.load(weights_only=True)`` once every pickle
    in it is measured: a crafted file is an error, never a crash of the process.

    Raises:
        CorruptCheckpointError: the file is damaged or crafted (``UnsafeCheckpointError``
            when loading it would run code).
    """
    check_saved_pickle(source, what=what, legacy=True)
    return load_weights_only(source, what=what, map_location="cpu", mmap=True)
