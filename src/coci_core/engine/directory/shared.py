"""Whether the ranks of a job see one directory.

Rank 0 commits a checkpoint from the shares the other ranks write into its directory: a
directory that is each node's own (a node-local ``/scratch`` or ``$TMPDIR`` given as the same
path on every node) would stall every save for the group's timeout and then blame the ranks
that did write. Before a manager's first save of several ranks, rank 0 writes a probe there
and every rank says, through the job's store, whether it sees it: the same error on every
rank when one does not.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from coci_core.engine.agreement import RestoreAgreement
from coci_core.engine.group import RankGroup
from coci_core.errors import CheckpointError, ConfigError, StorageError
from coci_core.storage import Storage

__all__ = ["PROBE_PREFIX", "check_shared_directory", "meets_every_rank", "shared_probe"]

logger = logging.getLogger(__name__)

#: the probe's directory, ``{PROBE_PREFIX}{session}`` (removed once every rank has looked)
PROBE_PREFIX = ".coci-shared-"


def _job_processes() -> int:
    """The processes of the initialized ``torch.distributed`` job (0 without one)."""
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
    except (ImportError, RuntimeError, ValueError):
        return 0


def meets_every_rank(group: RankGroup, agreement: RestoreAgreement | None) -> bool:
    """Whether :func:`check_shared_directory` exchanges with every rank of ``group`` (none
    of them writes this save before it returns), rather than returning at once (one rank, no
    job store, ranks made by hand in fewer processes)."""
    return agreement is not None and group.world_size > 1 and _job_processes() >= group.world_size


def _exchange(agreement: RestoreAgreement, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``report``; raises when a rank did not give one (it went silent: the
    agreement's watch reported an error for it, as only rank 0 reports one itself)."""
    try:
        reports = agreement.exchange(report)
    except CheckpointError as e:  # its words are a restore's
        raise _not_reached(str(e)) from e
    gone = [rep["error"][1] for r, rep in enumerate(reports) if r > 0 and rep.get("error")]
    if gone:
        raise _not_reached(gone[0])
    return reports


def _not_reached(why: str) -> CheckpointError:
    return CheckpointError(
        "the ranks did not all reach the first save's check that they share the checkpoint "
        f"directory (a rank killed, hung, or saving at other steps); nothing was written: {why}"
    )


def shared_probe(group: RankGroup) -> str:
    """The probe's directory of ``group``'s session."""
    return f"{PROBE_PREFIX}{group.session}"


def _words(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:500]}"


def check_shared_directory(
    storage: Storage,
    group: RankGroup,
    agreement: RestoreAgreement | None,
    *,
    failed: BaseException | None = None,
) -> None:
    """Raise on every rank of ``group`` unless each sees what rank 0 writes in ``storage``
    (nothing to check without ``agreement``, the ranks' exchange through the job's store).

    ``failed``: this rank's save failed before the check (its input checks): the others are
    told at once instead of waiting for it for the group's timeout; the caller raises
    ``failed`` itself.

    Raises:
        CheckpointError: another rank's save failed before the check (on the other ranks).
        ConfigError: a rank does not see rank 0's probe (not one shared directory).
        StorageError: rank 0 could not write the probe (on every rank).
    """
    if agreement is None or not meets_every_rank(group, agreement):
        return  # ranks made by hand in fewer processes: no exchange can meet them all
    probe = shared_probe(group)
    report = {} if failed is None else {"failed": _words(failed)}
    try:
        if group.rank == 0 and failed is None:
            try:
                storage.write_file(f"{probe}/rank-0", [memoryview(b"coci")])
            except Exception as e:  # said to every rank: none waits for a save that cannot be
                report = {"error": _words(e)}
        reports = _exchange(agreement, report)  # rank 0's probe is written once this returns
        failing = [r for r, rep in enumerate(reports) if rep.get("failed")]
        if failing and failed is None:
            raise CheckpointError(
                f"the save of rank(s) {failing} failed before anything was written, so no rank "
                f"saves this step: rank {failing[0]}: {reports[failing[0]]['failed']}"
            )
        if failing:
            return
        if reports[0].get("error"):
            raise StorageError(
                f"rank 0 cannot write in the checkpoint directory {str(storage.url)!r}, so no "
                f"rank saves: {reports[0]['error']}"
            )
        sees = group.rank == 0 or storage.exists(f"{probe}/rank-0")
        reports = _exchange(agreement, {"sees": sees, "url": str(storage.url)})
    finally:
        if group.rank == 0:
            with contextlib.suppress(Exception):  # one left behind is removed at startup
                storage.remove_dir(probe)
    blind = [r for r, report in enumerate(reports) if not report.get("sees")]
    if blind:
        raise ConfigError(
            f"the ranks do not share one checkpoint directory: rank(s) {blind} do not see "
            f"what rank 0 writes in {reports[0].get('url')!r} (a disk of each node's own, "
            "such as /scratch or $TMPDIR?); rank 0 commits each checkpoint from the shares "
            "every rank writes there: give every rank a directory on a shared file system, or "
            "an object store URL"
        )
