"""Restore: which checkpoint a resume takes (newest first across the tiers, past damaged
ones), and the one restore path every caller uses. Reading arrays is in
:mod:`~coci_core.engine.restore.read`, loading one step in
:mod:`~coci_core.engine.restore.load`, the committed steps and their order in
:mod:`~coci_core.engine.directory.steps`; their public names are importable from here too."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast

from coci_core.engine.agreement import (
    Found,
    RestoreAgreement,
    agreed_error,
    asked_apart,
    error_report,
)
from coci_core.engine.directory.steps import (
    StepInfo,
    checkpoint_storage,
    committed_dirs,
    committed_steps,
    gc_paused,
    highest_sequence,
    newest_first,
    newest_first_key,
    read_manifest,
    step_infos,
    step_versions,
)
from coci_core.engine.format.manifest import MAX_STEP, parse_step_version
from coci_core.engine.restore.inplace import InPlaceTargets
from coci_core.engine.restore.load import (
    LoadedCheckpoint,
    RestoreCache,
    check_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from coci_core.engine.restore.read import MAX_DELTA_CHAIN, ZSTD_MAX_RATIO, read_checked
from coci_core.errors import (
    CociError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
)
from coci_core.storage import Storage
from coci_core.telemetry.events import RestoreEvent

__all__ = [
    "MAX_DELTA_CHAIN",
    "ZSTD_MAX_RATIO",
    "Candidate",
    "CheckpointRef",
    "LoadedCheckpoint",
    "RestoreCache",
    "RestoreAgreement",
    "ResumePoint",
    "StepInfo",
    "check_checkpoint",
    "checkpoint_storage",
    "committed_dirs",
    "committed_steps",
    "find_checkpoint",
    "highest_sequence",
    "load_checkpoint",
    "newest_first",
    "read_checked",
    "read_manifest",
    "restore_newest",
    "resume_order",
    "resume_step",
    "step_infos",
    "step_versions",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

TierName = Literal["local", "remote"]

#: How a caller names a checkpoint: a step (its newest checkpoint, when two runs hold it), or
#: a step directory's name (``"step-0000000004-v1"``: that one).
CheckpointRef = int | str


@dataclass(frozen=True)
class Candidate:
    """A committed step of one tier, as a resume tries it. ``storage`` reads it as step
    ``step`` (see :func:`checkpoint_storage`); ``tier_storage`` is the tier's own."""

    tier: TierName
    storage: Storage
    info: StepInfo
    tier_storage: Storage | None = None

    @property
    def step(self) -> int:
        return self.info.step

    @property
    def name(self) -> str:
        """The step directory's name."""
        return self.info.name

    def matches(self, ref: CheckpointRef) -> bool:
        """Whether ``ref`` (a step or a step directory's name) names this checkpoint."""
        return self.info.name == ref if isinstance(ref, str) else self.info.step == ref


def check_ref(name: str, ref: object) -> None:
    """Raise unless ``ref`` names a checkpoint: a step (an integer in ``[0, 2**63-1]``) or a
    step directory's name (a string).

    Raises:
        ConfigError: naming ``name`` and what it may be.
    """
    if isinstance(ref, str) or (type(ref) is int and 0 <= ref <= MAX_STEP):
        return
    big = isinstance(ref, int) and ref.bit_length() > 64  # str() of a huge one may raise
    shown = f"a {ref.bit_length()}-bit integer" if isinstance(ref, int) and big else f"{ref!r:.100}"
    raise ConfigError(
        f"{name!r} must be a step (an integer in [0, 2**63-1]) or a step directory's name "
        f'("step-0000000004"), got {shown}'
    )


def find_checkpoint(storage: Storage, ref: CheckpointRef) -> StepInfo:
    """The checkpoint ``ref`` names in ``storage``: a step directory's name, or a step's newest
    checkpoint (by commit sequence: two runs may each hold one of that step). A step or name
    with no committed checkpoint gives an info that reading then reports as missing.

    Raises:
        NoCheckpointError: ``ref`` is a string that names no step directory.
    """
    check_ref("step", ref)
    if isinstance(ref, str):
        parsed = parse_step_version(ref)
        if parsed is None:
            raise NoCheckpointError(f"{ref!r} is not the name of a step directory")
        step, version = parsed
        versions = [i for i in step_versions(storage, step) if i.version == version]
    else:
        step, version = ref, 0
        versions = step_versions(storage, step)
    if versions:
        return versions[0]
    return StepInfo(step, "", 0.0, intact=True, version=version)


def _candidate(
    tier: TierName, storage: Storage, info: StepInfo, infos: list[StepInfo]
) -> Candidate:
    return Candidate(tier, checkpoint_storage(storage, info, infos), info, storage)


def _tiers(storage: Storage, remote: Storage | None) -> list[tuple[TierName, Storage]]:
    tiers: list[tuple[TierName, Storage]] = [("local", storage)]
    if remote is not None:
        tiers.append(("remote", remote))
    return tiers


def resume_order(
    storage: Storage,
    remote: Storage | None = None,
    *,
    caches: dict[int, RestoreCache] | None = None,
) -> list[Candidate]:
    """Every committed step of ``storage`` and of its ``remote`` tier, in the order a resume
    tries them: newest first by commit sequence across both tiers (see :func:`step_infos`),
    the local copy of a checkpoint before the remote one. A remote tier that cannot be read
    (down, refusing the credentials) leaves the local tier's steps, with a warning.

    ``caches`` (per tier, by ``id`` of its storage): where the restore that follows finds the
    manifests parsed here.

    Raises:
        StorageError: a tier cannot be read, and no other has a step (never an empty list).
    """

    def infos_of(s: Storage) -> list[StepInfo]:
        if caches is None:
            return step_infos(s)
        return step_infos(s, kept=caches.setdefault(id(s), RestoreCache(s)).manifests)

    local = infos_of(storage)
    candidates = [_candidate("local", storage, info, local) for info in local]
    if remote is not None:
        try:
            infos = infos_of(remote)
        except StorageError as e:
            if not candidates:
                raise
            logger.warning("coci: the remote tier cannot be read (%s); resuming from local", e)
            infos = []
        candidates += [_candidate("remote", remote, info, infos) for info in infos]
    # stable: of equal keys, the local tier (listed first) stays first
    return sorted(candidates, key=lambda c: newest_first_key(c.info), reverse=True)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resume takes (``candidate``) and the newer ones it passes over as
    damaged, each with why (``skipped``)."""

    candidate: Candidate
    skipped: tuple[tuple[Candidate, str], ...] = ()

    @property
    def step(self) -> int:
        return self.candidate.step

    @property
    def tier(self) -> TierName:
        return self.candidate.tier


_T = TypeVar("_T")


def _same_checkpoint(c: Candidate, newest: StepInfo) -> bool:
    """Whether ``c`` is a copy of ``newest`` (in the other tier: same step, run, sequence)."""
    info = c.info
    return info.intact and (info.step, info.run, info.sequence) == (
        newest.step,
        newest.run,
        newest.sequence,
    )


def _urls(storage: Storage, remote: Storage | None) -> str:
    return storage.url if remote is None else f"{storage.url} or {remote.url}"


def _found(c: Candidate) -> Found:
    """What a rank reports of the candidate it holds: its place in the order, and its run."""
    sequence, created = c.info.order
    return (sequence, created, c.step, c.info.run)


def _place(found: Found) -> tuple[int, float, int]:
    return found[:3]


class _Search(Generic[_T]):
    """The candidates of one restore, tried newest first; what was passed over and why."""

    def __init__(
        self,
        candidates: list[Candidate],
        storage: Storage,
        remote: Storage | None,
        step: CheckpointRef | None,
        strict: bool,
        attempt: Callable[[Candidate, RestoreCache], _T],
        caches: dict[int, RestoreCache],
        on_damaged: Callable[[Candidate, CorruptCheckpointError], None] | None,
    ) -> None:
        self.candidates = candidates
        self.storage, self.remote, self.step, self.strict = storage, remote, step, strict
        self.attempt, self.caches, self.on_damaged = attempt, caches, on_damaged
        self.skipped: list[tuple[Candidate, str]] = []
        self.errors: list[str] = []
        self.damage: CorruptCheckpointError | None = None
        self.absence: NoCheckpointError | None = None

    def first_from(self, start: int) -> tuple[int, _T]:
        """The first candidate from ``start`` on that ``attempt`` reads without damage."""
        step, remote = self.step, self.remote
        newest = self.candidates[0].info
        for i in range(start, len(self.candidates)):
            c = self.candidates[i]
            strict_stop = self.strict and step is None and self.damage is not None
            if strict_stop and not _same_checkpoint(c, newest):
                assert self.damage is not None
                raise self.damage  # strict: only another tier's copy of the newest
            cache = self.caches.setdefault(id(c.storage), RestoreCache(c.storage))
            try:
                return i, self.attempt(c, cache)
            except NoCheckpointError as e:
                self.absence = self.absence or e
                if step is None:  # removed while we read it (the writer's retention)
                    logger.info(
                        "coci: step %d was removed from %s while restoring it", c.step, c.tier
                    )
                    self.errors.append(f"step {c.step} ({c.tier}) was removed")
            except CorruptCheckpointError as e:
                self.damage = self.damage or e
                if self.on_damaged is not None:
                    self.on_damaged(c, e)
                if step is None:
                    where = f" ({c.tier})" if remote is not None else ""
                    logger.warning(
                        "coci: step %d%s is damaged, trying an older one: %s", c.step, where, e
                    )
                elif c.tier == "local" and remote is not None:
                    logger.warning(
                        "coci: step %s (local) is damaged, trying the remote tier's copy: %s",
                        step,
                        e,
                    )
                self.skipped.append((c, str(e)))
                self.errors.append(str(e))
        if step is not None:  # damage before absence
            why = f" ({'; '.join(self.errors)})" if self.errors else ""
            raise self.damage or self.absence or NoCheckpointError(f"no step {step}{why}")
        raise CorruptCheckpointError(
            f"no intact checkpoint in {_urls(self.storage, remote)}: " + "; ".join(self.errors),
            bad=[],
        )

    def said_of(self, i: int) -> tuple[list[int] | None, str | None]:
        """What candidate ``i``'s manifest, as this rank read it, says of the ranks that saved
        it (see :attr:`ManifestCache.ranks`), and its seal (``ManifestCache.seals``: the first
        32 hex digits, enough to tell a forged copy); None for each when it was not read."""
        c = self.candidates[i]
        cache = self.caches.get(id(c.storage))
        said = cache.manifests.ranks.get(c.step) if cache is not None else None
        seal = cache.manifests.seals.get(c.step) if cache is not None else None
        return (list(said) if said is not None else None), (seal[:32] if seal else None)

    def pass_over(self, start: int, end: int, why: str) -> None:
        """Candidates ``start`` to ``end`` (excluded) are passed over for ``why``."""
        for c in self.candidates[start:end]:
            if not any(s is c for s, _ in self.skipped):
                self.skipped.append((c, why))
                self.errors.append(f"step {c.step}: {why}")


def _first_intact(
    storage: Storage,
    remote: Storage | None,
    step: CheckpointRef | None,
    start_at: CheckpointRef | None,
    strict: bool,
    attempt: Callable[[Candidate, RestoreCache], _T],
    caches: dict[int, RestoreCache],
    on_damaged: Callable[[Candidate, CorruptCheckpointError], None] | None = None,
    agreement: RestoreAgreement | None = None,
) -> tuple[ResumePoint, _T]:
    """The one decision of which checkpoint a resume takes: the candidates in
    :func:`resume_order` (or ``step`` in each tier), the first that ``attempt`` reads without
    damage. Restore, ``coci ls``, ``coci export`` and the adapters all come here. With
    ``agreement``, the first that every rank of it reads without damage (see
    :mod:`~coci_core.engine.agreement`), or the same error on every rank."""
    # the checkpoint this rank asked for: ranks that ask for different ones are told so (a
    # search from ``start_at`` on may start apart: the ranks then agree on the oldest found)
    asked = None if step is None else str(step)
    try:
        # The collector stays paused from the listing to the end of the load: the manifests
        # decoded for the listing and the state built from the one read are many new objects in
        # no cycle, and each pause that ended between them set off a collection walking them
        # all (in a new process a full one: 0.09 s of a 0.3-0.4 s restore of 3,092 arrays).
        with gc_paused():
            if step is not None:
                # the newest checkpoint of that step (or the one named) in each tier, newest first
                candidates = []
                for tier, s in _tiers(storage, remote):
                    info = find_checkpoint(s, step)
                    candidates.append(Candidate(tier, checkpoint_storage(s, info), info, s))
                candidates.sort(key=lambda c: newest_first_key(c.info), reverse=True)
                if candidates:  # the checkpoint it names, however named (5, "step-0000000005")
                    info = candidates[0].info
                    asked = f"{info.step}-v{info.version}" if info.version else str(info.step)
                search = _Search(
                    candidates, storage, remote, step, strict, attempt, caches, on_damaged
                )
                i, result = search.first_from(0)
            else:
                search, i, result = _newest_intact(
                    storage, remote, start_at, strict, attempt, caches, on_damaged
                )
    except CociError as e:
        if agreement is None:
            raise
        raise agreed_error(agreement.exchange({**error_report(e), "asked": asked})) from e
    if agreement is not None:
        i, result = _agree(search, i, result, agreement, asked)
    return ResumePoint(search.candidates[i], tuple(search.skipped)), result


#: listings a restore without ``step`` takes when every checkpoint it listed was removed while
#: it read (a writer's retention with a small ``keep_last``): the newer ones were committed
#: meanwhile, and a listing that raced a commit and a removal may even have seen neither
RELIST_TRIES = 4


def _newest_intact(
    storage: Storage,
    remote: Storage | None,
    start_at: CheckpointRef | None,
    strict: bool,
    attempt: Callable[[Candidate, RestoreCache], _T],
    caches: dict[int, RestoreCache],
    on_damaged: Callable[[Candidate, CorruptCheckpointError], None] | None,
) -> tuple[_Search[_T], int, _T]:
    """The search of :func:`_first_intact` for the newest intact checkpoint, listed again
    while what it listed was all removed under it (never after damage)."""
    for tries_left in range(RELIST_TRIES - 1, -1, -1):
        candidates = resume_order(storage, remote, caches=caches)
        if not candidates:
            if tries_left and _has_steps_or_leftovers(storage):
                continue  # listed between a commit and a removal
            raise NoCheckpointError(f"no committed checkpoint in {_urls(storage, remote)}")
        starts = [
            i for i, c in enumerate(candidates) if start_at is not None and c.matches(start_at)
        ]
        if starts:
            candidates = candidates[starts[0] :]
        search = _Search(candidates, storage, remote, None, strict, attempt, caches, on_damaged)
        try:
            i, result = search.first_from(0)
        except CorruptCheckpointError:
            # Every one listed (from ``start_at``, the newest when it was resolved, on) was
            # removed: newer ones were committed meanwhile, and the newest is what is asked for.
            if tries_left and search.damage is None:
                logger.info("coci: every step listed was removed while restoring: listing again")
                continue
            raise
        return search, i, result
    raise AssertionError("unreachable")  # the last try returns or raises


def _has_steps_or_leftovers(storage: Storage) -> bool:
    """Whether the directory holds anything a writer makes (a step, committed or not): only
    then can an empty listing have raced a commit."""
    try:
        return any(name.startswith("step-") for name in storage.list_dir(""))
    except Exception:
        return False


#: Why a rank passes over a checkpoint that is not the one the other ranks hold, though of the
#: same step and place: node-local directories that hold different runs' checkpoints.
OTHER_RUN = "passed over: of another run than the other ranks' checkpoint of that step"


#: Why ranks pass over a checkpoint that they all hold in one place, of one run, whose
#: manifests say different things of the ranks that saved it (world size, ranks' own states).
RANKS_APART = (
    "passed over: its manifest names another world size or other ranks' own states on some "
    "ranks than on the others"
)


#: Why ranks pass over a checkpoint that they all hold in one place, of one run, of the same
#: ranks, whose manifests are not the same on every rank (another seal: a forged or mixed-up
#: copy on a node's own disk, saying other values or another layout).
MANIFESTS_APART = (
    "passed over: its manifest on some ranks is not the same as on the others (copies of "
    "one checkpoint that differ: a forged or mixed-up copy on a node's own disk)"
)


def _agree(
    search: _Search[_T], i: int, result: _T, agreement: RestoreAgreement, asked: str | None
) -> tuple[int, _T]:
    """Exchange what each rank holds until all hold the same checkpoint (the oldest of those
    found, or an older one): every rank ends on one step, or raises the same error."""
    while True:
        ranks, seal = search.said_of(i)
        reports = agreement.exchange(
            {
                "found": list(_found(search.candidates[i])),
                "ranks": ranks,
                "seal": seal,
                "asked": asked,
            }
        )
        if any(r.get("error") for r in reports) or asked_apart(reports) is not None:
            raise agreed_error(reports)  # asked apart first, else the ranks' failures
        found = [cast(Found, tuple(r["found"])) for r in reports]
        agreed = min(found, key=_place)
        if all(f == agreed for f in found):
            ranks_alike = all(r.get("ranks") == reports[0].get("ranks") for r in reports)
            if ranks_alike and all(r.get("seal") == reports[0].get("seal") for r in reports):
                return i, result
            # One checkpoint by its place and run, whose manifest says another world on some
            # rank, or other values or another layout (a forged or mixed-up copy on a
            # node-local disk, resealed): not the same checkpoint on every rank, passed over by
            # all (before: restored, the rank whose copy named fewer ranks silently without its
            # own state, or with its copy's values).
            search.pass_over(i, i + 1, RANKS_APART if not ranks_alike else MANIFESTS_APART)
            try:
                i, result = search.first_from(i + 1)
            except CociError as e:
                raise agreed_error(agreement.exchange({**error_report(e), "asked": asked})) from e
            continue
        if _found(search.candidates[i]) == agreed:
            continue  # this rank holds it; the others look again
        # The newest this rank read is damaged or missing on another rank: take the agreed one,
        # or the next older intact one, and tell the others. One in the agreed one's place but
        # of another run (node-local disks that hold different runs' checkpoints) is not it:
        # passed over too (before: this rank took it again, and the ranks exchanged the same
        # reports for ever).
        start = next(
            (
                j
                for j, c in enumerate(search.candidates)
                if _place(_found(c)) < _place(agreed) or _found(c) == agreed
            ),
            len(search.candidates),
        )
        for j in range(i, start):
            # of another run only in the agreed one's place; a newer one is on no other rank
            held = _found(search.candidates[j])
            other = _place(held) == _place(agreed) and held[3] != agreed[3]
            why = OTHER_RUN if other else "passed over: not intact on every rank"
            search.pass_over(j, j + 1, why)
        try:
            i, result = search.first_from(start)
        except CociError as e:
            raise agreed_error(agreement.exchange({**error_report(e), "asked": asked})) from e


def resume_step(
    storage: Storage,
    *,
    remote: Storage | None = None,
    rank: int = 0,
    strict: bool = False,
    on_damaged: Callable[[Candidate, CorruptCheckpointError], None] | None = None,
    agreement: RestoreAgreement | None = None,
) -> ResumePoint:
    """The checkpoint a resume takes from ``storage`` and its ``remote`` tier, as
    :func:`restore_newest` decides it, found by checking the candidates (newest first, every
    array that ``rank`` reads) without keeping their states. ``on_damaged`` is given each
    newer candidate found damaged, as it is found (also when none is intact).

    Raises:
        NoCheckpointError: nothing is committed.
        CorruptCheckpointError: no intact checkpoint is left (or, with ``strict``, the newest
            is damaged).
    """

    def check(c: Candidate, cache: RestoreCache) -> None:
        check_checkpoint(c.storage, c.step, rank=rank, cache=cache)

    return _first_intact(storage, remote, None, None, strict, check, {}, on_damaged, agreement)[0]


def restore_newest(
    storage: Storage,
    step: CheckpointRef | None = None,
    *,
    start_at: CheckpointRef | None = None,
    rank: int = 0,
    strict: bool = False,
    targets: InPlaceTargets | None = None,
    remote: Storage | None = None,
    agreement: RestoreAgreement | None = None,
    check: Callable[[int, dict[str, Any]], None] | None = None,
) -> tuple[LoadedCheckpoint, RestoreEvent]:
    """Restore ``step`` (a step: its newest checkpoint; or a step directory's name), or without it
    the newest checkpoint of the newest run (from ``start_at`` on, in that order, when given),
    falling back past damaged ones unless ``strict``: the one restore path that every caller (the
    manager, the Lightning adapter, ``coci export``) uses, returning the event to report. With
    ``remote`` (a second tier), the newest intact checkpoint of either tier (see
    :func:`resume_order`), or ``step`` from the first tier where it is intact. ``targets``: live
    tensors to fill in place (see :func:`load_checkpoint`; call ``targets.check`` once a step is
    restored). ``agreement``: the ranks restoring together (:meth:`RestoreAgreement.for_group`),
    which then all restore the newest step intact for every one of them, or all raise the same
    error. ``check``: called with each candidate's step and state once it is read (an adapter's
    check that the state it wrote is whole and of its types); a ``CorruptCheckpointError`` it
    raises makes that candidate damaged, as damage the restore finds itself (the next older is
    tried, and with ``agreement`` every rank passes over it).

    Raises:
        NoCheckpointError: nothing is committed (or not ``step``).
        CorruptCheckpointError: ``step`` (or, with ``strict``, the newest) is damaged, or no
            intact checkpoint is left.
        StorageError: the storage cannot be listed or read (see :func:`load_checkpoint`).
    """
    if start_at is not None:
        check_ref("start_at", start_at)
    started = time.perf_counter()
    caches: dict[int, RestoreCache] = {}  # per tier: a base found damaged is not read again

    def load(c: Candidate, cache: RestoreCache) -> LoadedCheckpoint:
        loaded = load_checkpoint(c.storage, c.step, rank=rank, cache=cache, targets=targets)
        if check is not None:
            check(loaded.step, loaded.state)
        return loaded

    point, loaded = _first_intact(
        storage, remote, step, start_at, strict, load, caches, agreement=agreement
    )
    passed = tuple(c.info for c, _ in point.skipped if c.tier == "local")
    loaded = dataclasses.replace(loaded, passed_over=passed)
    times = [cache.times for cache in caches.values()]
    event = RestoreEvent(
        step=loaded.step,
        seconds=time.perf_counter() - started,
        bytes_read=loaded.bytes_read,
        skipped_steps=tuple(dict.fromkeys(c.step for c, _ in point.skipped)),  # once per step
        rank_state_restored=loaded.rank_state_restored,
        tier=point.tier,
        read_s=sum(t.read_s for t in times),
        verify_s=sum(t.verify_s for t in times),
        decode_s=sum(t.decode_s for t in times),
    )
    logger.info(
        "coci: restored step %d from %s (%.1f MB, %.3f s)",
        loaded.step,
        point.candidate.storage.url,
        loaded.bytes_read / 1e6,
        event.seconds,
    )
    return loaded, event
