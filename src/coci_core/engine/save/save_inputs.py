"""A save's inputs, checked, and the byte regions of the state that this rank copies and
writes (:func:`rank_regions`)."""

from __future__ import annotations

import hashlib
import json
import numbers
import threading
from collections.abc import Collection, Mapping
from typing import Any

from coci_core.engine.directory.steps import step_versions
from coci_core.engine.format.manifest import MANIFEST_NAME, MAX_SEQUENCE, MAX_STEP, step_dir_name
from coci_core.engine.format.tree import ArrayLeaf, FlatState, FlattenCache, flatten_state
from coci_core.engine.group import RankGroup
from coci_core.engine.save.partition import Share, partition
from coci_core.errors import ConfigError, StepExistsError, StorageError
from coci_core.storage import Storage

__all__ = [
    "check_run_position",
    "check_step",
    "check_timeout",
    "committed_elsewhere",
    "flatten_per_rank",
    "json_metadata",
    "layout_digest",
    "rank_regions",
    "save_version",
]


def check_timeout(name: str, value: Any) -> float | None:
    """``value`` as a wait's timeout: None (no limit), or a number >= 0 (``inf`` and anything
    beyond what a wait accepts: as long as a wait may be).

    Raises:
        ConfigError: naming ``name``: not a number, NaN or negative.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise ConfigError(f"'{name}' must be None or a number of seconds >= 0: {value!r}")
    if value < 0:
        raise ConfigError(f"'{name}' must be >= 0: {value!r}")
    try:
        return min(float(value), threading.TIMEOUT_MAX)
    except OverflowError:  # an integer beyond a float: as long as a wait may be
        return threading.TIMEOUT_MAX


def check_step(step: Any) -> int:
    """``step``, if it is a step a checkpoint can have (one a resume reads back).

    Raises:
        ConfigError: it is not an integer in ``[0, 2**63-1]``.
    """
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        big = type(step) is int and step.bit_length() > 64  # str() of a huge one may raise
        shown = f"a {step.bit_length()}-bit integer" if big else f"{step!r:.100}"
        raise ConfigError(f"'step' must be an integer in [0, 2**63-1], got {shown}")
    return step


def check_run_position(run: Any, sequence: Any) -> None:
    """Raise unless ``run`` and ``sequence`` are a run id and a commit sequence a manifest
    can record (what :meth:`CheckpointManager.continue_run` is given).

    Raises:
        ConfigError: naming the argument and what is allowed.
    """
    if type(run) is not str or not run.isascii() or not run.isalnum() or len(run) > 64:
        raise ConfigError(f"'run' must be 1-64 ASCII letters or digits, got {run!r:.100}")
    if type(sequence) is not int or not 0 <= sequence <= MAX_SEQUENCE:
        big = type(sequence) is int and sequence.bit_length() > 64
        shown = f"a {sequence.bit_length()}-bit integer" if big else f"{sequence!r:.100}"
        raise ConfigError(f"'sequence' must be an integer in [0, 2**62], got {shown}")


def save_version(
    storage: Storage,
    step: int,
    run_id: str,
    *,
    overwrite: bool,
    passed_over: Collection[tuple[int, int]] = (),
) -> int:
    """The version of the step directory that a save of ``step`` by run ``run_id`` goes to
    (see :func:`~coci_core.engine.format.manifest.step_dir_name`): 0 for a step the directory does
    not hold; the run's own directory of it with ``overwrite``, or when that directory is in
    ``passed_over`` (``(step, version)`` of the run's checkpoints that the restore it continues
    passed over as damaged: training reached them again);
    with ``overwrite``, the step's newest checkpoint of another run (replaced); else a version
    no run holds yet, so that another run's checkpoint of the step is never touched.

    One request when the step is not held (a version is made only beside a held plain
    name). With ``overwrite``, a store that cannot be reached gives the plain name: the write
    itself then fails in the background, as any write to it.

    Raises:
        StepExistsError: the directory holds this run's checkpoint of ``step``, ``overwrite``
            is False and that checkpoint is not in ``passed_over``.
        StorageError: the store cannot be reached (without ``overwrite``).
    """
    try:
        if not storage.exists(f"{step_dir_name(step)}/{MANIFEST_NAME}"):
            return 0
        held = step_versions(storage, step)
    except StorageError:
        if overwrite:
            return 0
        raise
    if not held:
        return 0
    own = [i for i in held if i.intact and i.run == run_id]
    if own and not overwrite and not any((step, i.version) in passed_over for i in own):
        raise StepExistsError(
            f"{storage.url} already holds this run's checkpoint of step {step}; pass "
            "overwrite=True to replace it, or save into another directory",
            step=step,
            run=run_id,
            own=True,
        )
    if own or overwrite:
        return (own or held)[0].version
    return max(i.version for i in held) + 1


def committed_elsewhere(
    storage: Storage,
    error: StepExistsError,
    *,
    restored: tuple[int, int],
    first_own: int | None,
) -> StepExistsError:
    """``error`` (this run's ``error.step`` exists), said for what it is when another process
    committed that checkpoint after this manager restored the run's newest one, ``restored``
    (its step and commit sequence): a checkpoint of the run numbered above the restored one
    and below this manager's first commit, ``first_own``, is not this manager's. That is two
    processes continuing one run: a script started again while the first one still wrote
    its final save resumed from the checkpoint before it."""
    step, sequence = restored
    try:
        held = step_versions(storage, error.step)
    except StorageError:
        return error
    if not any(
        i.intact
        and i.run == error.run
        and i.sequence > sequence
        and (first_own is None or i.sequence < first_own)
        for i in held
    ):
        return error
    return StepExistsError(
        f"{storage.url} holds step {error.step} of the run this manager continues, committed "
        f"by another writer after this manager restored step {step}, then the newest: two "
        "processes continued one run (a script started again while the first one was still "
        "writing its final save?). Restore again to continue from the newest checkpoint, or "
        "pass overwrite=True to replace it",
        step=error.step,
        run=error.run,
        own=True,
        elsewhere=True,
    )


def flatten_per_rank(
    state: Mapping[str, Any],
    per_rank: Mapping[str, Any] | None,
    *,
    allow_torch_save: bool,
    cache: FlattenCache | None = None,
) -> FlatState | None:
    """The flattened ``per_rank`` state (None without one); its keys must not be ``state``'s.
    ``cache``: see :func:`~coci_core.engine.format.tree.flatten_state`."""
    if per_rank is None:
        return None
    if not isinstance(per_rank, Mapping):
        raise ConfigError(f"'per_rank' must be a mapping or None, got {type(per_rank)}")
    clash = sorted(str(k) for k in per_rank if k in state)
    if clash:
        raise ConfigError(f"'per_rank' keys {clash} are also keys of 'state'")
    return flatten_state(per_rank, allow_torch_save=allow_torch_save, cache=cache)


def rank_regions(
    group: RankGroup,
    chunk_bytes: int,
    shared: tuple[ArrayLeaf, ...],
    leaves: tuple[ArrayLeaf, ...],
) -> tuple[Share, ...] | None:
    """The regions of ``leaves`` (``shared``, then this rank's own) that this rank of
    ``group`` writes; None: every leaf whole (a group of one)."""
    # One rank writes every leaf whole; several split the replicated leaves and each writes
    # its shards of sharded tensors and its own per-rank leaves whole.
    if group.world_size == 1:
        partial = [leaf.key for leaf in shared if leaf.owned and leaf.shape != leaf.tensor.shape]
        if partial:
            raise ConfigError(
                f"{partial[:3]} are shards of DTensors: every rank must save, with a "
                "'group' (RankGroup.from_torch_distributed())"
            )
        return None
    mine = partition(
        [0 if leaf.owned else leaf.nbytes for leaf in shared],
        group.world_size,
        chunk_bytes=chunk_bytes,
    )[group.rank]
    owned = tuple(Share(i, 0, leaf.nbytes) for i, leaf in enumerate(shared) if leaf.owned)
    own = tuple(Share(i, 0, leaves[i].nbytes) for i in range(len(shared), len(leaves)))
    return mine + owned + own


def layout_digest(leaves: tuple[ArrayLeaf, ...], chunk_bytes: int) -> str:
    """What every rank must agree on to split the state the same way: a digest of the leaves
    in order, then one of the same leaves sorted by key (equal when only the order of the
    keys differs, so that the error can say so)."""
    rows = [(leaf.key, str(leaf.tensor.dtype), leaf.shape, leaf.owned) for leaf in leaves]
    text = repr([(*row, leaf.boxes) for row, leaf in zip(rows, leaves, strict=True)])
    keys = repr(sorted(rows, key=lambda row: row[0]))
    return "-".join(
        hashlib.sha1(f"{chunk_bytes}|{t}".encode()).hexdigest()[:16] for t in (text, keys)
    )


def json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as plain JSON values (a copy).

    Raises:
        ConfigError: it holds a value that is not JSON.
    """
    if metadata is None:
        return {}
    try:
        decoded: dict[str, Any] = json.loads(json.dumps(dict(metadata), allow_nan=False))
        return decoded
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(f"'metadata' must hold JSON values only: {e}") from e
