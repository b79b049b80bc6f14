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

from coci_core.engine.agreement import RestoreAgreement, agreed_error, error_report
from coci_core.engine.group import RankGroup
from coci_core.errors import ConfigError
from coci_core.storage import Storage

__all__ = ["PROBE_PREFIX", "check_shared_directory", "shared_probe"]

logger = logging.getLogger(__name__)

#: the probe's directory, ``{PROBE_PREFIX}{session}`` (removed once every rank has looked)
PROBE_PREFIX = ".coci-shared-"


def shared_probe(group: RankGroup) -> str:
    """The probe's directory of ``group``'s session."""
    return f"{PROBE_PREFIX}{group.session}"


def check_shared_directory(
    storage: Storage, group: RankGroup, agreement: RestoreAgreement | None
) -> None:
    """Raise on every rank of ``group`` unless each sees what rank 0 writes in ``storage``
    (nothing to check without ``agreement``, the ranks' exchange through the job's store).

    Raises:
        ConfigError: a rank does not see rank 0's probe (not one shared directory).
        StorageError: rank 0 could not write the probe (on every rank).
    """
    if agreement is None or group.world_size == 1:
        return
    probe = shared_probe(group)
    report = {}
    if group.rank == 0:
        try:
            storage.write_file(f"{probe}/rank-0", [memoryview(b"coci")])
        except Exception as e:  # said to every rank: none waits for a save that cannot be
            report = error_report(e)
    reports = agreement.exchange(report)  # rank 0's probe is written once this returns
    if any(r.get("error") for r in reports):
        raise agreed_error(reports)
    sees = group.rank == 0 or storage.exists(f"{probe}/rank-0")
    reports = agreement.exchange({"sees": sees, "url": str(storage.url)})
    if group.rank == 0:
        with contextlib.suppress(Exception):  # a probe left behind is removed at startup
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
