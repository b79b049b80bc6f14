"""The device meshes of DTensors as a save sees them: how many copies of a sub-mesh the ranks
form (FSDP2's ``mesh["dp"]`` of a ``(dp, tp)`` mesh, one per ``tp`` rank) and which one this
rank is in, so that the copies of a part are written once like any replica."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from coci_core.errors import UnsupportedValueError

__all__ = ["REPLICATE", "mesh_copies", "with_copies"]


class _Replicated:
    """A ``Replicate()`` placement, as :mod:`~coci_core.engine.format.regions` reads placements."""

    def is_partial(self) -> bool:
        return False

    def is_replicate(self) -> bool:
        return True

    def is_shard(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "Replicate()"


REPLICATE = _Replicated()


@functools.lru_cache(maxsize=64)
def mesh_copies(mesh: Any) -> tuple[int, int]:
    """How many disjoint copies of ``mesh`` its root mesh holds, and which one this rank is in:
    ``(1, 0)`` for a root mesh; for a sub-mesh (``mesh["dp"]`` of a ``(dp, tp)`` mesh), one
    per coordinate of the dims left out, in the order torch lays out their groups. Every rank
    computes the same groups, so the copies of a coordinate (its holders of the same region)
    are told apart without a collective.

    Raises:
        UnsupportedValueError: the groups of a sub-mesh cannot be found (a torch without
            mesh layouts, and a sub-mesh whose dim names are not its root mesh's).
    """
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    if layout is not None and rank_map is not None:
        groups = layout.remap_to_tensor(rank_map).reshape(-1, mesh.size())
    else:  # torch < 2.9: a sub-mesh sliced by dim names from its root mesh
        from torch.distributed.device_mesh import _mesh_resources

        root = _mesh_resources.get_root_mesh(mesh)
        names, own = root.mesh_dim_names or (), mesh.mesh_dim_names or ()
        if root is mesh:
            groups = mesh.mesh.reshape(1, -1)
        elif own and all(n in names for n in own):
            dims = [names.index(n) for n in own]
            rest = [d for d in range(root.ndim) if d not in dims]
            groups = root.mesh.permute(*rest, *dims).reshape(-1, mesh.size())
        else:
            raise UnsupportedValueError(
                f"a DTensor on the sub-mesh {own} of mesh {names}: its copies over the other "
                "mesh dims cannot be found with this torch version (use torch >= 2.9, or "
                "a sub-mesh sliced by dim names)"
            )
    rows = (groups == mesh.get_rank()).any(dim=1).nonzero()
    return int(groups.shape[0]), int(rows[0, 0]) if len(rows) else 0


def with_copies(
    mesh: Any, placements: Sequence[Any], order: dict[int, list[int]] | None
) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...], dict[int, list[int]] | None]:
    """``(mesh shape, placements, this rank's coordinate, shard order)`` of a DTensor on
    ``mesh``, as the save lays it out: a sub-mesh's copies (see :func:`mesh_copies`) as one more
    mesh dim, leading and replicated, so that one rank of each copy holds the same part."""
    shape, coord = tuple(mesh.shape), tuple(mesh.get_coordinate() or ())
    copies, copy = mesh_copies(mesh)
    if copies == 1:
        return shape, tuple(placements), coord, order
    if order is not None:
        order = {d: [m + 1 for m in dims] for d, dims in order.items()}
    return (copies, *shape), (REPLICATE, *placements), (copy, *coord), order
