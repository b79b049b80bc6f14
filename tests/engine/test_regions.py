"""Regions of a global array: DTensor layouts (checked against torch's own splitting), tiling,
who writes which bytes, and the reads that fill a region from pieces cut by another mesh."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor.placement_types import _StridedShard

from coci_core.engine.format.regions import (
    Coordinate,
    Region,
    byte_runs,
    check_tiling,
    clip_runs,
    dtensor_regions,
    plan_read,
    writers,
)
from coci_core.errors import CorruptCheckpointError, UnsupportedValueError
from tests.sharding._dist_child import launch

Layout = tuple[tuple[int, ...], tuple[int, ...], list[Any]]


class _Mesh:
    """The one DeviceMesh method torch's shard-order conversions call."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)

    def size(self, dim: int) -> int:
        return self.shape[dim]


def torch_local(
    full: torch.Tensor, mesh: Sequence[int], placements: Sequence[Any], coord: Sequence[int]
) -> torch.Tensor | None:
    """What torch holds at ``coord``: ``distribute_tensor``'s split for Shard placements; for
    ``_StridedShard`` the shard order torch reads from them (None when it reads none)."""
    local = full
    if not any(isinstance(p, _StridedShard) for p in placements):
        for parts, p, index in zip(mesh, placements, coord, strict=True):
            if not p.is_replicate():
                local = p._split_tensor(local, parts, with_padding=False)[0][index]
        return local
    order = DTensorSpec._maybe_convert_StridedShard_to_shard_order(tuple(placements), _Mesh(mesh))  # type: ignore[arg-type]
    if order is None:
        return None
    for entry in order:
        for mesh_dim in entry.mesh_dims:
            chunks = torch.chunk(local, mesh[mesh_dim], dim=entry.tensor_dim)
            index = coord[mesh_dim]
            local = chunks[index] if index < len(chunks) else local.narrow(entry.tensor_dim, 0, 0)
    return local


def random_layout(rng: random.Random, shape: tuple[int, ...] | None = None) -> Layout:
    if shape is None:
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
    ndim = len(shape)
    mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
    placements: list[Any] = []
    for _ in mesh:
        kind = rng.random()
        dim = rng.randrange(ndim)
        if kind < 0.3:
            placements.append(Replicate())
        elif kind < 0.85:
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=rng.randint(2, 4)))
    return shape, mesh, placements


def test_region_basics() -> None:
    a, b = Region((0, 2), (4, 5)), Region((3, 0), (4, 4))
    assert a.intersect(b) == Region((3, 2), (1, 2))
    assert a.intersect(Region((4, 0), (1, 1))) is None
    assert a.volume == 20 and a.ends == (4, 7)
    assert a.contains(Region((1, 3), (2, 2))) and not a.contains(b)
    assert Region((1, 3), (2, 2)).slices(a) == (slice(1, 3), slice(1, 3))
    assert Region.whole(()).volume == 1
    with pytest.raises(ValueError, match="rank"):
        Region((0,), (1, 2))


def test_byte_runs_read_any_box_out_of_any_stored_box() -> None:
    rng = random.Random(1)
    for _ in range(300):
        ndim = rng.randint(0, 4)
        within_shape = tuple(rng.randint(1, 5) for _ in range(ndim))
        within = Region(tuple(rng.randint(0, 3) for _ in range(ndim)), within_shape)
        starts = [rng.randint(0, n) for n in within_shape]
        sub = Region(
            tuple(o + s for o, s in zip(within.offsets, starts, strict=True)),
            tuple(rng.randint(0, n - s) for n, s in zip(within_shape, starts, strict=True)),
        )
        stored = torch.randn(within_shape, dtype=torch.float64)
        data = stored.contiguous().reshape(-1).view(torch.uint8).flatten()
        runs = byte_runs(sub, within, stored.element_size())
        got = torch.cat([data[o : o + n] for o, n in runs]) if runs else data[:0]
        want = stored[sub.slices(within)].contiguous().reshape(-1).view(torch.uint8).flatten()
        assert torch.equal(got, want)
        assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(runs))  # merged, in order
    assert byte_runs(Region((0, 0), (2, 4)), Region((0, 0), (2, 4)), 4) == [(0, 32)]
    assert byte_runs(Region((0, 1), (2, 2)), Region((0, 0), (2, 4)), 1) == [(1, 2), (5, 2)]
    with pytest.raises(ValueError, match="not inside"):
        byte_runs(Region((0,), (3,)), Region((1,), (3,)))


def test_clip_runs_reads_runs_out_of_byte_cut_pieces() -> None:
    """A box stored as several byte ranges (pieces cut at chunk boundaries): the runs clipped to
    each piece put every byte of the sub-box where it belongs."""
    rng = random.Random(6)
    for _ in range(200):
        within = Region((0, 0, 0), (rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 5)))
        lo = [rng.randint(0, n - 1) for n in within.shape]
        sub = Region(
            tuple(lo), tuple(rng.randint(1, n - o) for n, o in zip(within.shape, lo, strict=True))
        )
        stored = bytes(rng.randrange(256) for _ in range(within.volume * 2))
        runs = byte_runs(sub, within, 2)
        want = b"".join(stored[o : o + n] for o, n in runs)
        cuts = sorted({0, len(stored), *(rng.randint(0, len(stored)) for _ in range(3))})
        got, filled = bytearray(len(want)), 0
        for start, stop in itertools.pairwise(cuts):
            for at, length, to in clip_runs(runs, start, stop):
                got[to : to + length] = stored[start + at : start + at + length]
                filled += length
        assert bytes(got) == want and filled == len(want)
    assert clip_runs([(0, 4), (8, 4)], 2, 10) == [(0, 2, 2), (6, 2, 4)]


def test_dtensor_regions_match_torch_splitting_for_random_layouts() -> None:
    rng = random.Random(2)
    checked = refused = 0
    for _ in range(400):
        shape, mesh, placements = random_layout(rng)
        full = torch.arange(math.prod(shape)).reshape(shape)
        coords = list(itertools.product(*(range(n) for n in mesh)))
        locals_ = [torch_local(full, mesh, placements, c) for c in coords]
        if any(local is None for local in locals_):
            with pytest.raises(UnsupportedValueError, match="interleave"):
                dtensor_regions(shape, mesh, placements)
            refused += 1
            continue
        regions = dtensor_regions(shape, mesh, placements)
        assert set(regions) == set(coords)
        for coord, local in zip(coords, locals_, strict=True):
            region = regions[coord]
            assert local is not None
            assert tuple(local.shape) == region.shape, (shape, mesh, placements, coord)
            assert torch.equal(local, full[region.slices()])
        check_tiling(shape, regions.values())
        checked += 1
    assert checked > 250 and refused > 5


def test_fsdp_over_tp_strided_shard_and_uneven_shards() -> None:
    regions = dtensor_regions((34, 16), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)])
    assert {c: (r.offsets[0], r.shape[0]) for c, r in regions.items()} == {
        (0, 0): (0, 9),
        (0, 1): (17, 9),
        (1, 0): (9, 8),
        (1, 1): (26, 8),
    }
    empty = dtensor_regions((2, 3), (4,), [Shard(0)])
    assert [r.shape for r in empty.values()] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    assert dtensor_regions((5, 10), (4,), [Shard(-1)])[(3,)] == Region((0, 9), (5, 1))
    assert dtensor_regions((), (3,), [Replicate()])[(2,)] == Region((), ())


def test_uneven_fsdp_over_tp_follows_the_tensor_parallel_split_first() -> None:
    """FSDP2 over tensor parallelism on a 3x2 mesh, 7 rows (checked with six gloo ranks): tp
    splits 4 | 3, then dp splits each, so (2, 0) holds nothing and (2, 1) row 6, where
    ``_StridedShard._split_tensor`` (distribute_tensor's reading) would put row 6 at (2, 0)."""
    regions = dtensor_regions((7, 3), (3, 2), [_StridedShard(0, split_factor=2), Shard(0)])
    rows = {c: range(r.offsets[0], r.offsets[0] + r.shape[0]) for c, r in regions.items()}
    assert {c: list(r) for c, r in rows.items()} == {
        (0, 0): [0, 1],
        (0, 1): [4],
        (1, 0): [2, 3],
        (1, 1): [5],
        (2, 0): [],
        (2, 1): [6],
    }


def test_interleaved_strided_shard_and_partial_are_refused_by_name() -> None:
    with pytest.raises(
        UnsupportedValueError, match=r"w: .*_StridedShard\(dim=0, sf=2\).*interleave"
    ):
        dtensor_regions((8,), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)], key="w")
    with pytest.raises(
        UnsupportedValueError, match=r"opt/m: placement Partial\(sum\) on mesh dim 1"
    ):
        dtensor_regions((8,), (2, 2), [Shard(0), Partial()], key="opt/m")
    with pytest.raises(UnsupportedValueError, match="2 placements for a 1-d mesh"):
        dtensor_regions((8,), (2,), [Shard(0), Shard(0)])
    with pytest.raises(UnsupportedValueError, match="shards dim 2"):
        dtensor_regions((8, 2), (2,), [Shard(2)])


def test_shard_order_matches_torchs_strided_shard_form() -> None:
    """A tensor dim sharded over several mesh dims in a non-default order lays out as torch's
    equivalent _StridedShard placements (evenly divisible sizes, as torch requires there)."""
    rng = random.Random(3)
    for _ in range(100):
        mesh = tuple(rng.randint(1, 3) for _ in range(rng.randint(2, 3)))
        shape = (math.prod(mesh) * rng.randint(1, 2), rng.randint(1, 3))
        order = list(range(len(mesh)))
        rng.shuffle(order)
        placements = tuple(Shard(0) for _ in mesh)
        strided = DTensorSpec._convert_shard_order_to_StridedShard(
            (ShardOrderEntry(tensor_dim=0, mesh_dims=tuple(order)),),
            placements,
            _Mesh(mesh),  # type: ignore[arg-type]
        )
        assert dtensor_regions(shape, mesh, placements, shard_order={0: order}) == dtensor_regions(
            shape, mesh, strided
        )
    with pytest.raises(UnsupportedValueError, match="does not match"):
        dtensor_regions((4,), (2, 2), [Shard(0), Replicate()], shard_order={0: [1, 0]})


def test_check_tiling_names_overlaps_gaps_and_strays() -> None:
    check_tiling((4, 4), [Region((0, 0), (2, 4)), Region((2, 0), (2, 4)), Region((2, 0), (2, 4))])
    with pytest.raises(UnsupportedValueError, match="overlap"):
        check_tiling((4,), [Region((0,), (3,)), Region((2,), (2,))])
    with pytest.raises(UnsupportedValueError, match="cover 3 of the 4"):
        check_tiling((4,), [Region((0,), (3,))])
    with pytest.raises(UnsupportedValueError, match="outside"):
        check_tiling((4,), [Region((0,), (4,)), Region((3,), (2,))])


def test_writers_write_every_element_once_and_share_replicas_evenly() -> None:
    rng = random.Random(4)
    for trial in range(400):
        shape, mesh, placements = random_layout(rng)
        try:
            regions = dtensor_regions(shape, mesh, placements)
        except UnsupportedValueError:
            continue
        parts = writers(regions, rotate=trial)
        assert parts == writers(dict(reversed(list(regions.items()))), rotate=trial)
        counts = torch.zeros(shape, dtype=torch.int64)
        for coord, part in parts.items():
            assert part.volume and regions[coord].contains(part)
            counts[part.slices()] += 1
        assert bool((counts == 1).all())
        for region in set(regions.values()):
            holders = [c for c, r in regions.items() if r == region]
            sizes = [parts[c].volume if c in parts else 0 for c in holders]
            split = [n for n in region.shape if n >= len(holders)][:1]
            if region.volume and split:  # slices differ by at most one index of the split dim
                assert max(sizes) - min(sizes) <= region.volume // split[0]


def test_writers_rotate_small_replicated_tensors() -> None:
    regions: dict[Coordinate, Region] = {(i,): Region((0,), (1,)) for i in range(4)}
    assert [list(writers(regions, rotate=r)) for r in range(4)] == [[(i,)] for i in range(4)]
    scalar: dict[Coordinate, Region] = {(i,): Region((), ()) for i in range(3)}
    assert writers(scalar, rotate=5) == {(2,): Region((), ())}
    wide: dict[Coordinate, Region] = {(i,): Region((0, 0), (1, 8)) for i in range(4)}
    assert [p.shape for p in writers(wide).values()] == [(1, 2)] * 4  # split along dim 1


def save_pieces(
    full: torch.Tensor, layout: tuple[Sequence[int], list[Any]]
) -> list[tuple[Region, bytes]]:
    """The pieces a save on ``layout`` (mesh shape, placements) writes: each writer's box."""
    mesh, placements = layout
    parts = writers(dtensor_regions(full.shape, mesh, placements))
    return [
        (p, full[p.slices()].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for p in parts.values()
    ]


def read_region(
    full: torch.Tensor, target: Region, pieces: list[tuple[Region, bytes]]
) -> torch.Tensor:
    out = torch.full(target.shape, -1, dtype=full.dtype)
    for step in plan_read(target, [(r, i) for i, (r, _) in enumerate(pieces)], full.element_size()):
        data = b"".join(pieces[step.piece][1][o : o + n] for o, n in step.runs)
        src = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            .view(full.dtype)
            .reshape(step.source.shape)
        )
        out[step.destination] = src
    return out


MESHES: dict[str, tuple[Sequence[int], list[Any]]] = {
    "2x2 s0s1": ((2, 2), [Shard(0), Shard(1)]),
    "2x2 fsdp-tp": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    "2x2 s0rep": ((2, 2), [Shard(0), Replicate()]),
    "4x1": ((4, 1), [Shard(0), Shard(1)]),
    "1x4": ((1, 4), [Shard(0), Shard(1)]),
    "4 s1": ((4,), [Shard(1)]),
    "3 s0": ((3,), [Shard(0)]),
    "one process": ((1,), [Replicate()]),
}


@pytest.mark.parametrize("source", list(MESHES))
@pytest.mark.parametrize("dest", list(MESHES))
def test_plan_read_reshards_between_meshes(source: str, dest: str) -> None:
    full = torch.randn(11, 7)  # uneven on every mesh above
    pieces = save_pieces(full, MESHES[source])
    mesh, placements = MESHES[dest]
    for region in dtensor_regions(full.shape, mesh, placements).values():
        assert torch.equal(read_region(full, region, pieces), full[region.slices()])


def test_plan_read_reshards_random_layouts() -> None:
    rng = random.Random(5)
    done = 0
    while done < 150:
        shape, m1, p1 = random_layout(rng)
        _, m2, p2 = random_layout(rng, shape)
        try:
            source = dtensor_regions(shape, m1, p1)
            target = dtensor_regions(shape, m2, p2)
        except UnsupportedValueError:
            continue
        full = torch.randn(shape, dtype=torch.float64)
        pieces = [
            (r, full[r.slices()].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for r in writers(source).values()
        ]
        for region in target.values():
            assert torch.equal(read_region(full, region, pieces), full[region.slices()])
        done += 1


def test_plan_read_refuses_gaps_and_overlaps() -> None:
    target = Region((0, 0), (4, 2))
    with pytest.raises(CorruptCheckpointError, match="cover 6 of the 8"):
        plan_read(target, [(Region((0, 0), (3, 2)), "a")], 4)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        plan_read(target, [(Region((0, 0), (3, 2)), "a"), (Region((2, 0), (2, 2)), "b")], 4)
    with pytest.raises(CorruptCheckpointError, match="same region"):
        plan_read(target, [(Region((0, 0), (4, 2)), "a"), (Region((0, 0), (4, 2)), "b")], 4)
    assert plan_read(Region((0, 0), (0, 2)), [], 4) == []


@pytest.mark.dist
@pytest.mark.slow
def test_regions_match_dtensors_on_a_2x2_mesh() -> None:
    """Four gloo ranks on a 2x2 mesh: every DTensor's local tensor (distribute_tensor and FSDP2
    over tensor parallelism, _StridedShard included) is the full tensor at its region, torch
    reassembles locals cut at those regions, and the writers' bytes tile every tensor."""
    results = launch(4, {}, module="tests.engine._regions_child", timeout_s=120)
    assert all(code == 0 and r is not None for code, r in results), results
    by_rank = [r for _, r in results if r is not None]
    names = set(by_rank[0]["tensors"])
    assert {"fsdp_tp.0.weight", "fsdp_tp.2.weight", "strided"} <= names
    assert any("_StridedShard" in by_rank[0]["tensors"][n]["placements"] for n in names)
    for name in names:
        infos = [r["tensors"][name] for r in by_rank]
        assert all(i["local_equal"] and i["rebuilt_equal"] for i in infos), (name, infos)
        shape, itemsize = infos[0]["shape"], infos[0]["itemsize"]
        written = [
            Region(tuple(i["writes"][0]), tuple(i["writes"][1])) for i in infos if i["writes"]
        ]
        assert sum(w.volume for w in written) * itemsize == math.prod(shape) * itemsize
        check_tiling(shape, written)
