"""The committed steps of a storage: which exist, their manifests, and their order (newest
first by commit sequence), as resume and retention see them."""

from __future__ import annotations

from dataclasses import dataclass

from coci_core.engine.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    parse_step_dir,
    step_dir_name,
)
from coci_core.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from coci_core.storage import Storage

__all__ = [
    "StepInfo",
    "committed_steps",
    "highest_sequence",
    "newest_first",
    "newest_first_key",
    "read_manifest",
    "step_infos",
]


def committed_steps(storage: Storage) -> list[int]:
    """Steps that have a committed manifest, ascending (damage is found on read, not here)."""
    steps = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is not None and storage.exists(f"{name}/{MANIFEST_NAME}"):
            steps.append(step)
    return sorted(steps)


@dataclass(frozen=True)
class StepInfo:
    """What ordering and retention need of a committed step: its run, creation time, commit
    sequence (see :attr:`Manifest.sequence`) and the steps its deltas need (``intact`` False:
    its manifest cannot be read; the rest is then unknown, and ``sequence`` and
    ``created_unix`` are those of the newest intact step below it)."""

    step: int
    run: str
    created_unix: float
    intact: bool
    bases: tuple[int, ...] = ()
    sequence: int = 0

    @property
    def order(self) -> tuple[int, float]:
        """Newer is greater: the commit sequence; the creation time only between manifests
        that record no sequence (an earlier 0.1.0.dev0's)."""
        return (self.sequence, self.created_unix if self.sequence == 0 else 0.0)


def newest_first_key(info: StepInfo) -> tuple[tuple[int, float], bool, int]:
    """The sort key of :func:`step_infos` (descending): a damaged manifest just before the
    intact step whose place it takes."""
    return (info.order, info.intact is False, info.step)


def step_infos(storage: Storage) -> list[StepInfo]:
    """Every committed step, newest first: by commit sequence (never by a wall clock), so
    that the newest checkpoint of the newest run comes first even when an older run left
    higher step numbers (and a run that went back to an older step and trained on prefers its
    new branch).

    A step whose manifest cannot be read is placed where its step number would place it in
    one run (tried just before the newest intact step below it), so that restore reports it.
    """
    infos: list[StepInfo] = []
    newest_below: StepInfo | None = None  # steps ascend: the newest intact step below this one
    for step in committed_steps(storage):
        try:
            m = read_manifest(storage, step)
        except NoCheckpointError:
            continue  # removed meanwhile (retention)
        except CorruptCheckpointError:
            below = newest_below
            created, sequence = (below.created_unix, below.sequence) if below else (-1.0, 0)
            infos.append(StepInfo(step, "", created, intact=False, sequence=sequence))
        else:
            info = StepInfo(step, m.run, m.created_unix, True, m.bases, m.sequence)
            infos.append(info)
            if newest_below is None or info.order > newest_below.order:
                newest_below = info
    return sorted(infos, key=newest_first_key, reverse=True)


def highest_sequence(storage: Storage) -> int:
    """The highest commit sequence of the intact committed steps of ``storage`` (0: none)."""
    return max((i.sequence for i in step_infos(storage) if i.intact), default=0)


def newest_first(storage: Storage) -> list[int]:
    """Committed steps in the order a resume tries them (see :func:`step_infos`)."""
    return [i.step for i in step_infos(storage)]


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The manifest of ``step``, checked (see :meth:`Manifest.from_json`).

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest is too large, cannot be read or parsed, fails
            its checksum or a check, or names another step.
    """
    path = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if not storage.exists(path):
        raise NoCheckpointError(f"no committed checkpoint at step {step} in {storage.url}")
    where = f"manifest of step {step} in {storage.url}"
    try:
        size = storage.size(path)
        if size is not None and size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{where} has {size} bytes, more than {MAX_MANIFEST_BYTES}", step=step
            )
        data = storage.read_bytes(path)
    except StorageError as e:
        raise CorruptCheckpointError(f"cannot read manifest of step {step}: {e}", step=step) from e
    manifest = Manifest.from_json(data, where=where, step=step)
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"manifest in {step_dir_name(step)} says step {manifest.step}", step=step
        )
    return manifest
