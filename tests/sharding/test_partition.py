"""The partition of a state's bytes over ranks, and the sampler that survives a world change."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coci_core import ConfigError, GlobalSampler, partition
from coci_core.engine.save.partition import LEAF_ALIGN_BYTES


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), max_size=30),
    world=st.integers(1, 8),
    chunk_units=st.integers(1, 16),
)
def test_partition_tiles_every_array_once_and_balances_within_a_chunk(
    sizes: list[int], world: int, chunk_units: int
) -> None:
    chunk = chunk_units * LEAF_ALIGN_BYTES
    shares = partition(sizes, world, chunk_bytes=chunk)
    assert len(shares) == world
    covered: dict[int, list[tuple[int, int]]] = {}
    for rank_shares in shares:
        for s in rank_shares:
            assert 0 <= s.start < s.stop <= sizes[s.leaf]
            covered.setdefault(s.leaf, []).append((s.start, s.stop))
    for leaf, size in enumerate(sizes):
        ranges = sorted(covered.get(leaf, []))
        if size == 0:
            assert not ranges
            continue
        # exactly once: the ranges tile [0, size) without gaps or overlaps
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    # cuts fall on 64-byte boundaries of each array (so on element boundaries)
    assert all(s.start % LEAF_ALIGN_BYTES == 0 for r in shares for s in r)
    per_rank = [sum(s.nbytes for s in r) for r in shares]
    padding = LEAF_ALIGN_BYTES * len(sizes)  # alignment gaps count in the stream, not in bytes
    assert max(per_rank) - min(per_rank) <= chunk + padding


def test_one_large_tensor_is_split_over_every_rank() -> None:
    shares = partition([64 * 1024 * 1024, 100], 4, chunk_bytes=1024 * 1024)
    assert [len(r) for r in shares][:3] == [1, 1, 1]
    assert all(r[0].leaf == 0 and r[0].nbytes == 16 * 1024 * 1024 for r in shares[:3])


def test_partition_is_a_pure_function_of_sizes_and_world() -> None:
    assert partition([10, 2000, 7], 3, chunk_bytes=64) == partition(
        [10, 2000, 7], 3, chunk_bytes=64
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "'world_size' must be an integer >= 1"),
        ({"world_size": 2, "chunk_bytes": 100}, "'chunk_bytes' must be a positive multiple of 64"),
        ({"world_size": 2, "sizes": [-1]}, r"'sizes\[0\]' must be an integer >= 0"),
    ],
)
def test_partition_rejects_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    args = {"sizes": [1], **kwargs}
    with pytest.raises(ConfigError, match=message):
        partition(**args)  # type: ignore[arg-type]


def _take(sampler: GlobalSampler, n: int) -> list[int]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (4, 2), (2, 3), (3, 4)])
def test_sampler_resumed_on_another_world_size_sees_each_sample_once(
    before: int, after: int
) -> None:
    size, taken_per_rank = 96, 7
    old = [GlobalSampler(size, num_replicas=before, rank=r, seed=3) for r in range(before)]
    for s in old:
        s.set_epoch(2)
    seen = [i for s in old for i in _take(s, taken_per_rank)]
    states = {repr(s.state_dict()) for s in old}
    assert len(states) == 1  # the same on every rank
    state = old[0].state_dict()
    assert state == {"seed": 3, "epoch": 2, "consumed": before * taken_per_rank}
    new = [GlobalSampler(size, num_replicas=after, rank=r, seed=3) for r in range(after)]
    for s in new:
        s.load_state_dict(state)
        s.set_epoch(2)  # what the trainer does at the start of the resumed epoch
    rest = [i for s in new for i in s]
    if (size - len(seen)) % after == 0:
        assert sorted(seen + rest) == list(range(size))
    else:  # padded so that every rank takes as many: only the padding repeats
        assert set(seen + rest) == set(range(size))
        assert len(seen + rest) - size < after
    assert sorted(seen) == sorted(set(seen))
    assert not set(seen) & set(old[0].permutation(2)[len(seen) :])


def test_sampler_drop_last_and_next_epoch() -> None:
    s = GlobalSampler(10, num_replicas=3, rank=0, drop_last=True)
    assert len(s) == 3 and len(list(s)) == 3
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first  # a new permutation
    assert s.state_dict()["consumed"] == 0


def test_sampler_rejects_bad_state_and_arguments() -> None:
    with pytest.raises(ConfigError, match="'rank' must be an integer in"):
        GlobalSampler(10, num_replicas=2, rank=2)
    s = GlobalSampler(10, num_replicas=1, rank=0, seed=1)
    with pytest.raises(ConfigError, match="used seed 2"):
        s.load_state_dict({"seed": 2, "epoch": 0, "consumed": 0})
    with pytest.raises(ConfigError, match="not a GlobalSampler state"):
        s.load_state_dict({"epoch": 0})
