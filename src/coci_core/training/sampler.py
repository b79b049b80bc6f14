"""A sampler whose position survives a change of world size.

Its state is ``(seed, epoch, consumed)`` over one global permutation per epoch: ``consumed``
counts the samples every rank together has taken. Rank ``r`` of ``W`` takes the remaining
permutation round-robin (``remaining[r::W]``), so after each rank took ``k`` samples the
ranks together took exactly ``remaining[:k * W]``. A run resumed on any number of ranks
therefore continues with ``permutation[consumed:]`` and sees each remaining sample of the
epoch exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from coci_core.errors import ConfigError

__all__ = ["GlobalSampler"]


class GlobalSampler(Sampler[int]):
    """Shuffled (or ordered) indices for one rank, resumable on any number of ranks.

    Args:
        data_source: the dataset (or anything with ``len``) or its length.
        num_replicas: the world size (default: ``torch.distributed``'s, else 1).
        rank: this rank (default: ``torch.distributed``'s, else 0).
        shuffle: a new permutation of the data every epoch (seeded by ``seed + epoch``).
        seed: the permutation's seed, the same on every rank.
        drop_last: when the remaining samples do not split evenly over the ranks, drop the
            last few (True) or repeat the first few of the epoch (False, as
            ``DistributedSampler`` does) so that every rank takes as many.

    Use ``set_epoch(epoch)`` before each epoch (Lightning and Accelerate do it), and keep
    ``state_dict()`` in the checkpoint; it is the same on every rank.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        size = data_source if isinstance(data_source, int) else len(data_source)
        if type(size) is not int or size < 0:
            raise ConfigError(f"'data_source' must have a length >= 0: {size!r}")
        if num_replicas is None or rank is None:
            dist_rank, dist_world = _dist_rank_and_world()
            num_replicas = dist_world if num_replicas is None else num_replicas
            rank = dist_rank if rank is None else rank
        if type(num_replicas) is not int or num_replicas < 1:
            raise ConfigError(f"'num_replicas' must be an integer >= 1: {num_replicas!r}")
        if type(rank) is not int or not 0 <= rank < num_replicas:
            raise ConfigError(f"'rank' must be an integer in [0, {num_replicas - 1}]: {rank!r}")
        if type(seed) is not int or not -(2**63) <= seed < 2**64 - 2**31:  # seed + epoch
            raise ConfigError(f"'seed' must be an integer in [-2**63, 2**64 - 2**31): {seed!r:.60}")
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if type(flag) is not bool:  # "no" would be true
                raise ConfigError(f"{name!r} must be True or False: {flag!r:.100}")
        self.size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start = 0  # samples of this epoch taken before the current iteration
        self._taken = 0  # samples this rank took in the current iteration

    def permutation(self, epoch: int | None = None) -> list[int]:
        """The epoch's global order of sample indices."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def _remaining(self) -> list[int]:
        perm = self.permutation()
        remaining = perm[self._start :]
        extra = len(remaining) % self.num_replicas
        if extra and self.drop_last:
            remaining = remaining[: len(remaining) - extra]
        elif extra:
            pad = self.num_replicas - extra
            remaining += (perm * (pad // len(perm) + 1))[:pad]
        return remaining

    def __len__(self) -> int:
        return len(self._remaining()) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        self._taken = 0
        for index in self._remaining()[self.rank :: self.num_replicas]:
            self._taken += 1
            yield index
        self._start = 0  # the epoch is over: the next one starts from its beginning
        self._taken = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s permutation from now on (a new epoch starts at its beginning)."""
        if epoch != self.epoch:
            self._start = 0
            self._taken = 0
        self.epoch = epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch taken by all ranks together."""
        return min(self.size, self._start + self._taken * self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "epoch", "consumed"}``: the same on every rank."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken, on this sampler's number of ranks."""
        try:
            seed, epoch, consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a GlobalSampler state: {state!r} ({e})") from e
        if seed != self.seed:
            raise ConfigError(
                f"the saved sampler used seed {seed}, this one {self.seed}: the permutations "
                "would differ"
            )
        if not 0 <= consumed <= self.size:
            raise ConfigError(f"'consumed' must be in [0, {self.size}]: {consumed}")
        self.epoch = epoch
        self._start = consumed
        self._taken = 0


def _dist_rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
