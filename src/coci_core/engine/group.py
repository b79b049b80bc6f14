"""The ranks that write one checkpoint together, and how they agree on a save attempt.

The background writers of a sharded save coordinate through the storage only (marker files in
the staging directory, see ``commit.py``), never with collectives on the training process
group, so a save can neither deadlock nor slow training. What the ranks must share up front is
a *session*: a name that is the same on every rank and new for every run attempt, so that
markers left by a killed attempt are never mistaken for this one's.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from coci_core.errors import ConfigError
from coci_core.knobs import DEFAULT_COMMIT_TIMEOUT_S, JOIN_TIMEOUT_S

__all__ = ["DEFAULT_COMMIT_TIMEOUT_S", "JOIN_TIMEOUT_S", "RankGroup"]

_SESSION = re.compile(r"^[A-Za-z0-9]{1,64}$")


@dataclass(frozen=True)
class RankGroup:
    """This process's place among the ranks that write each checkpoint.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``; rank 0 coordinates the commit.
        world_size: how many ranks write each checkpoint.
        session: the same letters-and-digits name on every rank, new for every run attempt
            (:meth:`from_torch_distributed` makes one).
        timeout_s: how long a rank waits for the others' part of a save before the save fails.
    """

    rank: int
    world_size: int
    session: str
    timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S

    def __post_init__(self) -> None:
        if type(self.world_size) is not int or self.world_size < 1:
            raise ConfigError(f"'world_size' must be an integer >= 1: {self.world_size!r}")
        if type(self.rank) is not int or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"'rank' must be an integer in [0, {self.world_size - 1}]: {self.rank!r}"
            )
        if not isinstance(self.session, str) or not _SESSION.match(self.session):
            raise ConfigError(
                f"'session' must be 1-64 letters or digits, the same on every rank: "
                f"{self.session!r}"
            )
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError(f"'timeout_s' must be a number > 0: {self.timeout_s!r}")

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank writes the manifest (rank 0)."""
        return self.rank == 0

    @classmethod
    def single(cls) -> RankGroup:
        """One process writing alone."""
        return cls(0, 1, uuid.uuid4().hex[:16])

    @classmethod
    def from_torch_distributed(
        cls, *, group: Any = None, timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S
    ) -> RankGroup:
        """The group of an initialized ``torch.distributed`` process group (the default one
        unless ``group``). Call it on every rank at set-up: it broadcasts a new session name
        once (the only collective coci runs on the training group)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls(0, 1, uuid.uuid4().hex[:16], timeout_s)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box: list[Any] = [uuid.uuid4().hex[:16] if rank == 0 else None]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(group, 0) if group else 0, group=group
        )
        return cls(rank, world, str(box[0]), timeout_s)

    @classmethod
    def default(cls, *, timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> RankGroup:
        """The default group of an initialized ``torch.distributed`` job of several processes
        (every rank then writes its share of each checkpoint), else this process alone.

        Every rank must make its manager (in the same order): the ranks agree on a session
        through the job's rendezvous store, not a collective, so a manager made on one rank
        only fails within ``JOIN_TIMEOUT_S`` with an error saying so instead of hanging.

        Raises:
            ConfigError: another rank did not make its manager within ``JOIN_TIMEOUT_S``.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(0, 1, uuid.uuid4().hex[:16], timeout_s)
        try:
            # Private, but the only handle on the job's own key-value store without running a
            # collective (which would hang if only some ranks made a manager).
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except (ImportError, RuntimeError, ValueError):
            return cls.from_torch_distributed(timeout_s=timeout_s)
        rank, world = dist.get_rank(), dist.get_world_size()
        gone = (
            "the job's key-value store stopped answering while the ranks joined their "
            "CheckpointManagers (the process that hosts it, rank 0 unless torchrun's agent "
            "does, has most likely exited; see its error)"
        )
        try:
            n = store.add(f"coci/managers/r{rank}", 1)  # the n-th manager of this rank
        except RuntimeError as e:  # DistNetworkError
            raise ConfigError(f"{gone}: {e}") from e
        session_key = f"coci/session/{n}"
        wait = timedelta(seconds=JOIN_TIMEOUT_S)
        hint = (
            "with an initialized torch.distributed job, make a CheckpointManager on every "
            "rank (each writes its share of the state), or pass group=RankGroup.single() for "
            "a manager of this process alone, with a directory of its own"
        )
        if rank == 0:
            session = uuid.uuid4().hex[:16]
            store.set(session_key, session)
            missing = []
            for other in range(1, world):
                try:
                    store.wait([f"coci/joined/{n}/r{other}"], wait)
                except RuntimeError:
                    missing.append(other)
            if missing:
                raise ConfigError(
                    f"rank(s) {missing} made no CheckpointManager within {JOIN_TIMEOUT_S:g} s of "
                    f"rank 0's: {hint}"
                )
            return cls(0, world, session, timeout_s)
        started = time.monotonic()
        try:
            store.wait([session_key], wait)
            session = store.get(session_key).decode("ascii")
        except RuntimeError as e:
            if time.monotonic() - started < JOIN_TIMEOUT_S:
                raise ConfigError(f"{gone}: {e}") from e
            raise ConfigError(
                f"rank 0 made no CheckpointManager within {JOIN_TIMEOUT_S:g} s of rank "
                f"{rank}'s: {hint}"
            ) from e
        try:
            store.set(f"coci/joined/{n}/r{rank}", "1")
        except RuntimeError as e:
            raise ConfigError(f"{gone}: {e}") from e
        return cls(rank, world, session, timeout_s)
