"""Retention: which committed steps a run keeps, and the clean-up of what crashes leave.

Called by the manager's writer thread after each commit (``keep_last`` of the run's own steps,
never a base that a kept step or the next delta needs), when a resumed training run closes
without a commit of its own (what a kill right after the run's last commit left), before a
save when the storage reports too little free space (the steps retention would delete
anyway go first), after a re-save (the later steps whose deltas the old contents were the base
of) and at startup under the directory's lease (uncommitted leftovers). Deleting a step
un-publishes it first where the storage can, so that no crash leaves a manifest without its
data.

A step is deleted only after every listed step whose deltas need it (dependants first, newest
step number first: a base always has a lower step number than its deltas), and never while a
listed step that stays needs it. So at every moment, also after a SIGKILL part way, each listed
step's bases are there, and a reader that finds a base gone finds the step itself gone too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Collection, Iterable

from coci_core.engine.directory.shared import PROBE_PREFIX, shared_probe
from coci_core.engine.directory.steps import StepInfo, committed_dirs, step_infos, step_versions
from coci_core.engine.format.manifest import MANIFEST_NAME, parse_step_dir, step_dir_name
from coci_core.engine.group import RankGroup
from coci_core.errors import ConfigError, StorageError
from coci_core.storage import STAGING_MARK, Storage

__all__ = [
    "apply_keep_last",
    "check_keep_last",
    "drop_dependants",
    "explain_full_disk",
    "make_room",
    "own_steps",
    "remove_uncommitted",
    "retire",
    "trim_resumed_run",
]

logger = logging.getLogger(__name__)


def check_keep_last(value: object, name: str = "keep_last") -> int | None:
    """``value`` if it is an integer >= 1 or None, else a ConfigError naming ``name``."""
    if value is not None and (type(value) is not int or value < 1):
        raise ConfigError(f"'{name}' must be an integer >= 1 or None: {value!r}")
    return value


def retire(storage: Storage, step: int, version: int = 0) -> None:
    """Delete a committed step (its directory of ``version``) so that no crash leaves its
    manifest without its data: the storage un-publishes it first where it can
    (:meth:`Storage.retire`)."""
    storage.retire(step_dir_name(step, version))


def own_steps(storage: Storage, run_id: str) -> list[StepInfo]:
    """The run's intact committed steps, oldest first (in commit order, never by a wall clock:
    a run that went back to an older step and trained on has its abandoned later steps first)."""
    infos: list[StepInfo] = step_infos(storage)
    return [i for i in reversed(infos) if i.intact and i.run == run_id]


def _bases_of(infos: Iterable[StepInfo]) -> set[int]:
    """The steps whose data these checkpoints' deltas need (kept with them)."""
    return {base for info in infos for base in info.bases}


def _deletable(
    infos: list[StepInfo], wanted: Iterable[StepInfo], protected: set[int]
) -> list[StepInfo]:
    """Of the checkpoints ``wanted`` gone, those that can go: not of a ``protected`` step,
    and not of a step that a listed checkpoint that stays (``infos``: every listed one, of
    every run) needs as a base; highest step first (a delta's step is above its bases')."""
    doomed = {i.name: i for i in wanted if i.step not in protected}
    while True:  # until no staying checkpoint needs a doomed one
        staying = [i for i in infos if i.name not in doomed]
        needed = _bases_of(staying)
        kept = [name for name, i in doomed.items() if i.step in needed]
        if not kept:
            return sorted(doomed.values(), key=lambda i: (i.step, i.version), reverse=True)
        for name in kept:
            del doomed[name]


def _counted(
    infos: list[StepInfo], run_id: str, damaged: Collection[tuple[int, int]]
) -> list[StepInfo]:
    """The run's listed intact steps, oldest first, but those its restore found ``damaged``
    (``(step, version)``): not counted among the kept, nor deleted (the run replaces them
    when it reaches their steps)."""
    return [
        i
        for i in reversed(infos)
        if i.intact and i.run == run_id and (i.step, i.version) not in damaged
    ]


def apply_keep_last(
    storage: Storage,
    *,
    keep_last: int,
    run_id: str,
    newest: int,
    next_base: int | None,
    damaged: Collection[tuple[int, int]] = (),
    also_keep: Collection[int] = (),
) -> None:
    """Delete the run's steps beyond the newest ``keep_last``, except ``newest``, the bases of
    the kept ones, ``next_base`` (the base the next deltas will use) and the steps
    ``also_keep`` (kept besides the newest ``keep_last``: an adapter's best step, as the
    Trainer's rotation keeps its best checkpoint); a step whose deltas need another is deleted
    before it. ``damaged``: see :func:`_counted`."""
    infos = step_infos(storage)
    own = _counted(infos, run_id, damaged)
    cut = max(0, len(own) - keep_last)
    protected = {i.step for i in own[cut:]} | {newest} | set(also_keep)
    if next_base is not None:
        protected.add(next_base)
    for info in _deletable(infos, own[:cut], protected):  # deltas before their bases
        retire(storage, info.step, info.version)
        logger.debug("coci: retention removed step %d", info.step)


def trim_resumed_run(
    storage: Storage,
    *,
    keep_last: int,
    run_id: str,
    sequence: int,
    next_base: int | None,
    also_keep: Collection[int] = (),
) -> None:
    """Apply ``keep_last`` for a training run that resumed from its newest checkpoint (commit
    ``sequence``) and committed nothing since: a run killed between its last commit and that
    commit's retention otherwise keeps one step too many until it saves again (a resume at the
    run's end never does). Nothing happens unless exactly that one step is over, after a
    restore of an older step, or once the run committed again (retention ran then). Never
    raises: it is logged.
    """
    try:
        own = [i for i in step_infos(storage) if i.intact and i.run == run_id]  # newest first
        if len(own) != keep_last + 1 or own[0].sequence != sequence:
            return
        apply_keep_last(
            storage,
            keep_last=keep_last,
            run_id=run_id,
            newest=own[0].step,
            next_base=next_base,
            also_keep=also_keep,
        )
    except Exception as e:  # the run's checkpoints are durable: never a reason to fail
        logger.warning("coci: retention of the resumed run failed: %s", e)


def drop_dependants(storage: Storage, step: int, run_id: str) -> None:
    """A re-saved step (now run ``run_id``'s) replaced the base that later steps' deltas were
    taken against (those of ``run_id``, or of a run that holds no other checkpoint of
    ``step``): those steps can no longer be restored (their base checks would fail), so they
    go. Never raises (restore would detect what is left)."""
    try:
        holders = {i.run for i in step_versions(storage, step) if i.intact} - {run_id}
        for info in step_infos(storage):
            other = info.step
            if other == step or not info.intact or info.run in holders:
                continue
            if step in info.bases:
                logger.warning(
                    "coci: step %d was re-saved and step %d was a delta against its old "
                    "contents: step %d is removed",
                    step,
                    other,
                    other,
                )
                retire(storage, other, info.version)
    except Exception as e:  # never fails a save that is durable
        logger.warning("coci: after re-saving step %d: %s", step, e)


def remove_uncommitted(
    storage: Storage,
    group: RankGroup,
    *,
    done_seq: int | None,
    newest: int | None = None,
    abort_uploads: bool = True,
) -> None:
    """Remove what saves left uncommitted: only names coci writes (``step-...``), never a
    directory with a manifest, never a save another rank of this session may still be writing
    (only another session's leftovers and this session's saves older than ``done_seq``). A step
    that a crash left renamed aside mid-publish is put back first.

    Call only while holding the directory's lease, so no other writer owns what goes.
    ``abort_uploads``: at startup, also abort the uploads left open (only where no rank of
    this group can have begun one).
    """
    sharded = group.world_size > 1
    if done_seq is None and abort_uploads:  # at startup: nothing of ours is open
        try:
            aborted = storage.abort_uploads()
        except Exception as e:  # invisible leftovers: never a reason to fail
            logger.warning("coci: could not abort the uploads left open in %s: %s", storage.url, e)
        else:
            if aborted:
                logger.warning("coci: aborted %d upload(s) a killed writer left open", aborted)
    for name in storage.list_dir(""):
        if done_seq is None and name.startswith(PROBE_PREFIX) and name != shared_probe(group):
            with contextlib.suppress(Exception):  # a killed rank 0's probe: never a failure
                storage.remove_dir(name)
            continue
        if not name.startswith("step-"):
            continue
        step = parse_step_dir(name)
        if step is not None:
            if storage.exists(f"{name}/{MANIFEST_NAME}"):
                continue
            # A storage that stages in the final directory (fsspec) names no session.
            if sharded and (newest is None or step >= newest):
                continue
        elif ".coci-old-" in name:
            final = name.split(".coci-old-", 1)[0]
            if (
                parse_step_dir(final) is not None
                and not storage.exists(f"{final}/{MANIFEST_NAME}")
                and storage.exists(f"{name}/{MANIFEST_NAME}")
            ):
                # A crash between the two renames of a re-save: the old step comes back.
                storage.remove_dir(final)
                storage.publish(name, final)
                logger.warning("coci: restored step %s, left aside by a crash", final)
                continue
        elif ".coci-" not in name:
            continue  # not a name coci writes: someone else's, left alone
        elif sharded and STAGING_MARK in name:
            session, _, seq = name.rsplit(STAGING_MARK, 1)[1].rpartition("-")
            if session == group.session and (
                done_seq is None or not seq.isdigit() or int(seq) >= done_seq
            ):
                continue
        storage.remove_dir(name)
        logger.debug("coci: removed uncommitted %s", name)


def make_room(
    storage: Storage,
    *,
    keep_last: int | None,
    run_id: str,
    step: int,
    needed_bytes: int,
    next_base: int | None,
    damaged: Collection[tuple[int, int]] = (),
    also_keep: Collection[int] = (),
) -> None:
    """When the storage reports less free space than ``needed_bytes`` for the save of ``step``,
    delete now the old steps that retention would delete once it commits (never the newest
    step, nor a base that a kept step or the next delta needs, nor ``also_keep``)."""
    if keep_last is None:
        return
    free = storage.free_bytes()
    if free is None or free >= needed_bytes:
        return
    infos = step_infos(storage)
    own = _counted(infos, run_id, damaged)
    if not own:
        return
    keep = [*own[max(0, len(own) - (keep_last - 1)) :], own[-1]]
    protected = {i.step for i in keep} | _bases_of(keep) | {step} | set(also_keep)
    if next_base is not None:
        protected.add(next_base)
    doomed = _deletable(infos, own, protected)
    for old in [i for i in own if i in doomed]:  # oldest first
        if old not in doomed:
            continue
        # with the doomed checkpoints whose deltas need it, those first
        group = [old, *(i for i in doomed if i is not old and old.step in i.bases)]
        for gone in sorted(group, key=lambda i: (i.step, i.version), reverse=True):
            retire(storage, gone.step, gone.version)
            doomed.remove(gone)
            logger.warning(
                "coci: %.1f MB free, step %d needs about %.1f MB: removed step %d early (it "
                "was beyond keep_last=%d once this save commits)",
                free / 1e6,
                step,
                needed_bytes / 1e6,
                gone.step,
                keep_last,
            )
        free = storage.free_bytes()
        if free is None or free >= needed_bytes:
            return


def explain_full_disk(
    storage: Storage, error: BaseException, keep_last: int | None
) -> BaseException:
    """``error``, or for a full storage (ENOSPC) a StorageError saying what is kept and what
    to do."""
    if not isinstance(error, OSError) or error.errno != errno.ENOSPC:
        return error
    steps = committed_dirs(storage)
    new = StorageError(
        errno.ENOSPC,
        f"{error.strerror or error}. The storage is full: {len(steps)} committed "
        f"checkpoint(s) are kept (keep_last={keep_last}) and none was deleted for "
        "this save; free space, lower keep_last, or enable compression",
    )
    new.__cause__ = error
    return new
