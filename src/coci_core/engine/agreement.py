"""How the ranks that restore one checkpoint together agree on its step.

Each rank reads on its own (its pieces, its per-rank state); then the ranks tell each other,
through the job's key-value store, which step each found intact. The oldest of those is
proposed to all; a rank for which it is damaged goes on to older steps, and the ranks tell each
other again, until all hold the same step or one has none left, and then all raise the same
error. The store, not a collective: a rank that fails says so and the others raise with it, and
a rank that never came is waited for the job's own timeout (``init_process_group``'s
``timeout``, which its store keeps; ``RESTORE_AGREE_TIMEOUT_S`` where none is known), as a
collective of the job would wait for it; with a watch of the ranks' signs of life (a
manager's restore: see :mod:`~coci_core.engine.pulse`), only until it has gone silent for
``RANK_SILENT_S``.

Every rank of a group restores together: the n-th restore of each rank agrees with the n-th
restore of the others (as the n-th manager of each rank joins the others', see
:meth:`RankGroup.default <coci_core.engine.group.RankGroup.default>`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from coci_core.engine.group import RankGroup
from coci_core.errors import (
    CheckpointError,
    CociError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    StateMismatchError,
    StorageError,
)
from coci_core.knobs import PULSE_S, RESTORE_AGREE_TIMEOUT_S

__all__ = [
    "RestoreAgreement",
    "agreed_error",
    "asked_apart",
    "job_store",
    "job_timeout_s",
    "store_gone",
]

logger = logging.getLogger(__name__)

#: What a rank reports: the checkpoint it holds (commit sequence, creation time when the
#: manifest records no sequence, step, run), or why it holds none.
Found = tuple[int, float, int, str]

_READ_WAIT_S = 60.0


def unset(store: Any, keys: list[str], ranks: Sequence[int]) -> list[int]:
    """Those of ``ranks`` whose key (``keys[rank]``) is not in ``store`` yet, found by
    halving (``check`` of many keys at once): a few missing of thousands of ranks cost a few
    dozen calls of the store, not one a rank.

    Raises:
        RuntimeError: the store does not answer.
    """
    ranks = list(ranks)
    if not ranks or store.check([keys[r] for r in ranks]):
        return []
    if len(ranks) == 1:
        return ranks
    half = len(ranks) // 2
    return unset(store, keys, ranks[:half]) + unset(store, keys, ranks[half:])


class RestoreAgreement:
    """One restore's exchange between the ranks of ``group`` through ``store`` (a
    ``torch.distributed.Store``): :meth:`exchange` gives every rank's report, in rank order.
    ``watch``: the ranks' signs of life (a ``pulse.Watch``, its ``silent(ranks)``): a rank
    that went silent while the others waited for its report fails the restore at once."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        name: str = "job",
        timeout_s: float = RESTORE_AGREE_TIMEOUT_S,
        watch: Any = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.watch = watch
        # the n-th restore of this rank meets the n-th restore of the others
        try:
            n = int(store.add(f"coci/restore/{name}/count/r{rank}", 1))
        except RuntimeError as e:  # DistNetworkError and the like
            raise store_gone(e) from e
        self._prefix = f"coci/restore/{name}/{n}"
        self.instance = f"{name}/{n}"  # this restore's name, the same on every rank
        self._round = 0

    @classmethod
    def for_group(
        cls,
        group: RankGroup | None,
        *,
        timeout_s: float | None = None,
        topic: str = "",
        watch: Any = None,
    ) -> RestoreAgreement | None:
        """The agreement of ``group``'s ranks through the job's store; None when there is
        nothing to agree on (one rank) or no store to agree through (``torch.distributed`` not
        initialized: ranks made by hand in one process restore each on its own). ``topic``:
        exchanges apart from the restores' (their own count of rounds); ``watch``: see the
        class; ``timeout_s``: by default the job's (:func:`job_timeout_s`)."""
        if group is None or group.world_size == 1:
            return None
        store = job_store()
        if store is None:
            return None
        name = f"{group.session}{topic}"
        timeout_s = job_timeout_s(store) if timeout_s is None else timeout_s
        return cls(store, group.rank, group.world_size, name=name, timeout_s=timeout_s, watch=watch)

    @classmethod
    def for_job(cls, *, timeout_s: float | None = None) -> RestoreAgreement | None:
        """The agreement of every process of the initialized ``torch.distributed`` job (for a
        framework whose every rank loads a checkpoint by path); None with one process.
        ``timeout_s``: by default the job's (:func:`job_timeout_s`)."""
        store = job_store()
        if store is None:
            return None
        import torch.distributed as dist

        world = dist.get_world_size()
        if world == 1:
            return None
        timeout_s = job_timeout_s(store) if timeout_s is None else timeout_s
        return cls(store, dist.get_rank(), world, timeout_s=timeout_s)

    def exchange(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        """Post this rank's ``report`` (JSON) and return every rank's, in rank order.

        Raises:
            CheckpointError: a rank did not report within ``timeout_s``.
        """
        key = f"{self._prefix}/{self._round}"
        self._round += 1
        keys = [f"{key}/r{r}" for r in range(self.world_size)]
        try:
            self.store.set(f"{key}/r{self.rank}", json.dumps(report))
        except RuntimeError as e:
            raise store_gone(e) from e
        self._wait(key, keys)
        try:
            reports = [json.loads(self.store.get(k)) for k in keys]
        except RuntimeError as e:
            raise store_gone(e) from e
        self._wait_until_all_read(key)
        return reports

    def _wait(self, key: str, keys: list[str]) -> None:
        """Until every rank's report of this round (``key``) is in the store.

        With a watch, rank 0 looks once a second for ranks silent and posts a report for each
        (an error: the others then raise the same agreed error), the others look at rank 0
        only: a dead rank costs every rank ``RANK_SILENT_S``, and the store a number of looks
        that grows with the ranks, not with their square.

        Raises:
            CheckpointError: a rank did not report within ``timeout_s``, or rank 0 went
                silent (see ``watch``); or the store stopped answering.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                wait_s = left if self.watch is None else min(left, PULSE_S)
                self.store.wait(keys, timedelta(seconds=wait_s))
                return
            except RuntimeError as e:  # the store's timeout, or a store that went away
                try:
                    self.store.check([keys[self.rank]])  # raises when the store is gone
                    if self.watch is not None and time.monotonic() < deadline:
                        self._look_for_silent(key, keys)
                        continue
                    missing = unset(self.store, keys, range(self.world_size))
                except RuntimeError:
                    raise store_gone(e) from e
                if not missing:
                    return
                raise CheckpointError(
                    f"rank(s) {missing} did not say within {self.timeout_s:g} s which "
                    f"checkpoint they could restore; this rank restores nothing ({e})"
                ) from e

    def _look_for_silent(self, key: str, keys: list[str]) -> None:
        """Rank 0: post a report for each rank gone silent before it reported (and mark it
        read); another rank: raise if rank 0 went silent."""
        if self.rank != 0:
            if self.watch.silent([0]):
                raise CheckpointError(
                    "rank 0 stopped giving signs of life before saying which checkpoint it "
                    "could restore (killed, or its node lost); this rank restores nothing"
                )
            return
        missing = unset(self.store, keys, range(1, self.world_size))
        for r in self.watch.silent(missing) if missing else []:
            gone = CheckpointError(
                f"rank {r} stopped giving signs of life before saying which checkpoint it "
                "could restore (killed, or its node lost)"
            )
            self.store.compare_set(keys[r], "", json.dumps(error_report(gone)))
            self.store.set(f"{key}/read/r{r}", "1")

    def _wait_until_all_read(self, key: str) -> None:
        """Keep rank 0 here until every rank has read this round's reports.

        Rank 0 hosts the store when the job was started without an agent (``env://`` with
        ``MASTER_ADDR``, ``mp.spawn``): after an agreed error it raises and may exit, and the
        store goes with it, under a rank still reading (which then failed with the store's
        "connection reset" instead of the agreed error). Every live rank reads within moments
        of rank 0 (all reports are there when rank 0 reads them); a rank that died after
        posting is waited for ``_READ_WAIT_S`` at most, with a watch only until it is silent.
        """
        try:
            if self.rank != 0:
                self.store.set(f"{key}/read/r{self.rank}", "1")
                return
            read = [f"{key}/read/r{r}" for r in range(self.world_size)]
            deadline = time.monotonic() + min(self.timeout_s, _READ_WAIT_S)
            while True:
                left = max(deadline - time.monotonic(), 0.001)
                try:
                    wait_s = left if self.watch is None else min(left, PULSE_S)
                    self.store.wait(read[1:], timedelta(seconds=wait_s))
                    return
                except RuntimeError:
                    if self.watch is None or time.monotonic() >= deadline:
                        raise
                unread = unset(self.store, read, range(1, self.world_size))
                if unread and self.watch.silent(unread) == unread:
                    raise RuntimeError(f"rank(s) {unread} went silent")
        except RuntimeError as e:  # every report is in hand: nothing to raise for
            logger.warning("coci: a rank did not read the ranks' restore reports (%s)", e)


def job_timeout_s(store: Any) -> float:
    """How long the job's collectives wait for a rank: the ``timeout`` given to
    ``init_process_group`` (Lightning's ``DDPStrategy(timeout=...)``, Accelerate's
    ``InitProcessGroupKwargs``, the ``Trainer``'s ``ddp_timeout``), which the job's store
    keeps; ``RESTORE_AGREE_TIMEOUT_S`` where the store tells none."""
    try:
        seconds = float(store.timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return RESTORE_AGREE_TIMEOUT_S
    return seconds if 0 < seconds < float("inf") else RESTORE_AGREE_TIMEOUT_S


def store_gone(e: BaseException) -> CheckpointError:
    """The error of a rank whose job store stopped answering (a DistNetworkError): the
    process that hosts it (rank 0, unless an agent such as torchrun's does) has most likely
    exited."""
    return CheckpointError(
        "the job's key-value store stopped answering while the ranks agreed on the step to "
        "restore (the process that hosts it, rank 0 unless torchrun's agent does, has most "
        f"likely exited; see its error): this rank restores nothing ({type(e).__name__}: "
        f"{str(e)[:200]})"
    )


def job_store() -> Any:
    """The initialized job's key-value store, or None."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        # Private, but the job's own store, reachable without a collective (as in
        # RankGroup.default).
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError) as e:
        logger.warning("coci: the ranks cannot agree on the restored step (%s)", e)
        return None


_KINDS: dict[str, type[CociError]] = {
    "NoCheckpointError": NoCheckpointError,
    "CorruptCheckpointError": CorruptCheckpointError,
    "StorageError": StorageError,
    "StateMismatchError": StateMismatchError,
    "CheckpointError": CheckpointError,
}


def error_report(e: BaseException) -> dict[str, Any]:
    """What a rank reports when it holds no checkpoint: the kind of error and why."""
    kind = next((k for k, cls in _KINDS.items() if isinstance(e, cls)), "CheckpointError")
    return {"error": [kind, f"{type(e).__name__}: {str(e)[:500]}"]}


def asked_apart(reports: list[dict[str, Any]]) -> ConfigError | None:
    """The error of ranks that asked for different checkpoints (``restore(step=...)``: each
    report's ``asked``), or None."""
    asked = [r.get("asked") for r in reports]
    if len(set(map(str, asked))) <= 1:
        return None
    said = ", ".join(
        f"rank {r}: {'the newest' if a is None else f'step {a}'}" for r, a in enumerate(asked)
    )
    return ConfigError(
        f"the ranks asked to restore different checkpoints ({said}): every rank restores "
        "the same one; pass the same step (or none) on every rank"
    )


def agreed_error(reports: list[dict[str, Any]]) -> CociError:
    """The one error every rank raises when some rank holds no checkpoint: of the kind of
    the failures when they are all alike (every rank found nothing: NoCheckpointError), else
    a CorruptCheckpointError, its message naming each failed rank's reason; a ConfigError when
    the ranks asked for different checkpoints (:func:`asked_apart`)."""
    apart = asked_apart(reports)
    if apart is not None:
        return apart
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep.get("error")]
    kinds = {kind for _, (kind, _) in failed}
    if len(failed) < len(reports) and kinds <= {"NoCheckpointError"}:
        # Some ranks hold a checkpoint that others do not have at all (node-local disks, one
        # of them new): restoring on some ranks only would split the job.
        held = [r for r, rep in enumerate(reports) if not rep.get("error")]
        kinds = {"CorruptCheckpointError"}
        detail = f"; rank(s) {held} hold one"
    else:
        detail = ""
    kind = kinds.pop() if len(kinds) == 1 else "CorruptCheckpointError"
    reasons = "; ".join(f"rank {r}: {why}" for r, (_, why) in failed)
    message = f"no checkpoint can be restored on every rank ({reasons}{detail})"
    cls = _KINDS[kind]
    if cls is StorageError:
        return StorageError(message)
    return cls(message)
