"""Signs of life of the ranks that save together, through the job's key-value store.

A rank SIGKILLed (or lost with its node) writes no commit record: without a sign of life the
ranks waiting for it learn nothing until the commit timeout (``RankGroup.timeout_s``, 600 s by
default; twice that for ranks > 0), and a survivor whose training loop already failed on a
collective with the dead rank waits that long at exit, where it makes its pending save durable.
So each manager of a group of several ranks adds 1 to its rank's counter in the job's store
every ``PULSE_S``, and a rank waiting for another's part of a save watches that counter: seen
alive, then silent for ``RANK_SILENT_S``, the rank is taken for dead and the save fails at
once, naming it. A rank never seen alive (no store, a group made by hand) is waited for the
timeout, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from coci_core.engine.agreement import RestoreAgreement, job_store
from coci_core.engine.group import RankGroup
from coci_core.knobs import PULSE_S, RANK_SILENT_S, RESTORE_AGREE_TIMEOUT_S

__all__ = ["Carry", "Pulse", "Watch", "restore_watched"]

logger = logging.getLogger(__name__)


def _key(session: str, rank: int) -> str:
    return f"coci/pulse/{session}/r{rank}"


def _own_connection(store: Any) -> Any:
    """A connection of its own to ``store`` (``Store.clone``): a client runs one call at a
    time, and a thread of the process blocked in a ``wait`` or ``get`` on the job's client
    (NCCL's set-up, a restore's agreement) would otherwise hold the beats back until this
    rank looked dead.

    A clone connects anew, retrying for the store's whole timeout (30 min by default) when
    the store's host has exited (rank 0 killed): waited for ``RANK_SILENT_S`` at most, then
    the job's own client is used (its calls fail at once on a host that is gone)."""
    made: list[Any] = []

    def clone() -> None:
        with contextlib.suppress(AttributeError, RuntimeError, NotImplementedError):
            made.append(store.clone())  # a store that cannot clone: the store itself

    thread = threading.Thread(target=clone, name="coci-store-connect", daemon=True)
    thread.start()
    thread.join(RANK_SILENT_S)
    if not made and thread.is_alive():
        logger.info("coci: no connection of its own to the job's store within %s s", RANK_SILENT_S)
    return made[0] if made else store


_side_connections: dict[int, tuple[Any, Any]] = {}  # id(job store) -> (it, its clone)
_side_lock = threading.Lock()


def _side_connection(store: Any) -> Any:
    """The process's one connection of its own to the job's ``store``, made once and shared
    by every pulse and watch of the process (their calls never block: ``add``, ``check``,
    ``multi_get`` of keys that exist). One per manager or restore before: a rank opened a
    connection to rank 0's store for each, each a DNS lookup and a socket on the host."""
    with _side_lock:
        held = _side_connections.get(id(store))
        if held is None or held[0] is not store:
            held = (store, _own_connection(store))
            if held[1] is not store:  # a clone that timed out is tried again next time
                _side_connections[id(store)] = held
        return held[1]


class Pulse:
    """This rank's sign of life, given while its manager is open (a daemon thread)."""

    def __init__(self, store: Any, key: str) -> None:
        self._store, self._key = store, key
        self._stop = threading.Event()
        # a carried pulse's end (time.monotonic()), when no restore takes it (see Carry)
        self._until: float | None = None
        self._ended = False
        self._lock = threading.Lock()
        self._beat()  # seen alive before the first save
        self._thread = threading.Thread(target=self._run, name="coci-pulse", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, group: RankGroup) -> Pulse | None:
        """The pulse of ``group``'s rank; None with one rank or no job store."""
        if group.world_size == 1:
            return None
        store = job_store()
        if store is None:
            return None
        try:
            return cls(_side_connection(store), _key(group.session, group.rank))
        except RuntimeError as e:  # the store does not answer: the others wait the timeout
            logger.info("coci: no sign of life through the job's store: %s", e)
            return None

    def _beat(self) -> None:
        self._store.add(self._key, 1)

    def _run(self) -> None:
        # On after ``destroy_process_group()`` too (this holds the store): a save still
        # persisting then, the job's last, is waited for by the others.
        while not self._stop.wait(PULSE_S):
            with self._lock:
                if self._until is not None and time.monotonic() > self._until:
                    self._ended = True  # carried, and no restore took it
                    return
            # a beat that failed (an overloaded store, its host gone) is tried again
            with contextlib.suppress(RuntimeError):
                self._beat()

    def stop(self) -> None:
        """Stop the pulse (once this rank's saves are durable: its manager closes)."""
        self._stop.set()

    def end_by(self, until: float | None) -> bool:
        """Stop beating at ``until`` (``time.monotonic()``; None: not before :meth:`stop`);
        False when the pulse already ended by an earlier such time."""
        with self._lock:
            self._until = until
            return not self._ended


class Watch:
    """Which of ``group``'s ranks went silent while this one waits for them."""

    def __init__(self, store: Any, session: str, silent_s: float) -> None:
        self._store, self._session, self._silent_s = store, session, silent_s
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it changed)
        self._looked: float | None = None
        self._gone: float | None = None  # since when the store has not answered

    @classmethod
    def of(cls, group: RankGroup) -> Watch | None:
        """A watch of ``group``'s ranks; None with one rank or no job store."""
        if group.world_size == 1:
            return None
        store = job_store()
        if store is None:
            return None
        return cls(_side_connection(store), group.session, RANK_SILENT_S)

    def silent(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` seen alive whose counter has not moved for ``silent_s``; all of
        them once the store has not answered for that long (its host, rank 0 without an
        agent, exited). Looks at most once per ``PULSE_S``; after a gap of its own (this
        process stopped, a whole job suspended), the silence is counted from now."""
        now = time.monotonic()
        if self._looked is not None and now - self._looked < PULSE_S:
            return []
        if self._looked is not None and now - self._looked > 3 * PULSE_S:
            self._seen = {rank: (count, now) for rank, (count, _) in self._seen.items()}
        self._looked = now
        try:
            counts = self._counts(ranks)
        except RuntimeError:  # DistNetworkError: the store is gone, or did not answer
            self._gone = now if self._gone is None else self._gone
            return list(ranks) if now - self._gone >= self._silent_s else []
        self._gone = None
        out = []
        for rank in ranks:
            count, last = counts[rank], self._seen.get(rank)
            if last is None:
                if count > 0:  # a rank that never beat is left to the timeout
                    self._seen[rank] = (count, now)
            elif count > last[0]:
                self._seen[rank] = (count, now)
            elif now - last[1] >= self._silent_s:
                out.append(rank)
        return out

    def _counts(self, ranks: list[int]) -> dict[int, int]:
        """Each rank's counter: in one call of the store for the ranks whose counter exists
        (thousands of ranks are one request a second, not thousands), one call each for the
        others (a rank that has not beaten yet: ``multi_get`` would wait for its key)."""
        keys = {rank: _key(self._session, rank) for rank in ranks}
        known = [rank for rank in ranks if rank in self._seen]
        unknown = [rank for rank in ranks if rank not in self._seen]
        if unknown and self._store.check([keys[rank] for rank in unknown]):
            known, unknown = list(ranks), []
        counts = {rank: int(self._store.add(keys[rank], 0)) for rank in unknown}
        if known:
            values = self._store.multi_get([keys[rank] for rank in known])
            counts.update((rank, int(value)) for rank, value in zip(known, values, strict=True))
        return counts


class Carry:
    """What :func:`restore_watched` yields: set ``carry`` (once every rank is known to read
    next, under the job's next agreement) to leave this rank's beats on after the block, for
    the watch of that read."""

    carry = False


# The beats an agreement of the job left on for the job's next restore (see Carry): the store,
# the session they are given under (the same on every rank) and the pulse.
_carried: list[tuple[Any, str, Pulse]] = []
_carried_lock = threading.Lock()
#: How long carried beats go on with no restore to take them (an error between the agreement
#: and the read; a process that goes on): the read's own agreement waits no longer.
CARRY_S = RESTORE_AGREE_TIMEOUT_S


def _take_carried(store: Any) -> tuple[str, Pulse] | None:
    with _carried_lock:
        held = _carried.pop() if _carried else None
    if held is None:
        return None
    if held[0] is not store:  # another job's (a process group made anew): not this one's
        held[2].stop()
        return None
    return held[1], held[2]


@contextlib.contextmanager
def restore_watched(agreement: RestoreAgreement | None) -> Iterator[Carry]:
    """Signs of life for a restore of the job's ranks that no manager's pulse covers (a
    framework that reads by path: Lightning's ``ckpt_path``, :func:`read_checkpoint
    <coci_core.training.read_checkpoint>`): while it runs, this rank beats under a key of this
    restore's own and ``agreement`` watches the others' beats, so that a rank killed while it
    read fails the others' restore once silent for ``RANK_SILENT_S``, not after the
    agreement's timeout (30 min). A rank that never beat (killed before it came) is waited for
    the timeout, as before.

    An agreement before the read (Lightning's, that every rank reads a coci checkpoint: see
    :func:`~coci_core.training.ranks_read_alike`) sets the yielded :class:`Carry`: its beats
    go on after it, and the job's next restore watches them instead of beats of its own, so
    that a rank killed between the two (seen alive in the first) fails the read once silent
    too; beats that no restore takes (an error between the two) stop after ``CARRY_S``."""
    carry = Carry()
    if agreement is None or agreement.watch is not None:
        yield carry
        return
    carried = _take_carried(agreement.store)
    pulse = None
    try:
        if carried is not None:
            session, pulse = carried  # beating since the agreement before, on every rank
            if not pulse.end_by(None):  # it outlived CARRY_S: beat again, under its key
                pulse = Pulse(_side_connection(agreement.store), _key(session, agreement.rank))
        else:
            session = f"restore/{agreement.instance}"
            pulse = Pulse(_side_connection(agreement.store), _key(session, agreement.rank))
        agreement.watch = Watch(_side_connection(agreement.store), session, RANK_SILENT_S)
    except RuntimeError as e:  # the store does not answer: the agreement says so
        logger.info("coci: no sign of life through the job's store: %s", e)
    done = False
    try:
        yield carry
        done = True
    finally:
        if pulse is not None:
            if done and carry.carry:
                pulse.end_by(time.monotonic() + CARRY_S)  # a read that never comes
                with _carried_lock:
                    _carried.append((agreement.store, session, pulse))
            else:
                pulse.stop()
