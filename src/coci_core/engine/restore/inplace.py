"""Restore into the caller's tensors: which stored arrays can be read straight into which live
tensors (``restore(into=...)`` or ``restore(targets=...)``), and what a failed attempt may have
overwritten.

A stored array is read in place when the live tensor at the same path of the state (the same
dict keys, of the same types, and list positions) is a plain CPU tensor of the same dtype and
shape, contiguous, and shares no memory with another tensor filled in place. Its bytes are
then read into the tensor's memory and their checksum verified there; the restored state holds
that tensor, and ``load_state_dict`` copies nothing (a module's ``copy_`` of a tensor into
itself is skipped; an optimizer adopts the tensors it is given). A live DTensor of the same
dtype and global shape, on any mesh and with any placements (but ``Partial``), gets the part
of the array its local tensor holds, read from only the pieces that hold it (resharding).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from coci_core.engine.format.manifest import TensorEntry
from coci_core.engine.format.regions import Coordinate, Region, dtensor_layout, dtensor_regions
from coci_core.engine.format.tree import MAX_TREE_DEPTH
from coci_core.errors import (
    CheckpointError,
    ConfigError,
    StateMismatchError,
    UnsupportedValueError,
)

__all__ = ["Fill", "InPlaceTargets", "in_place_targets"]

#: A position in a state: dict keys (as JSON text of their manifest form) and list indices.
Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Fill:
    """One stored array read in place: the live tensor, its bytes and where it is; for a
    DTensor (or an array stored as boxes), the box of the array its local tensor holds."""

    tensor: torch.Tensor
    raw: torch.Tensor  # uint8 view of the memory written (``tensor``'s, or ``local``'s)
    path: Path
    box: Region | None = None  # None: the stored bytes are read straight into ``raw``
    local: torch.Tensor | None = None  # with ``box``: the tensor that holds it


_NOT_A_KEY = object()


def _key_node(key: Any) -> Any:
    """A dict key as the manifest's tree spells it (see ``tree._Flattener._encode_key``), or
    ``_NOT_A_KEY`` for a key that a stored state cannot hold."""
    if key is None or type(key) in (str, int, bool, float):
        return key
    if type(key) is tuple:
        items = [_key_node(k) for k in key]
        return _NOT_A_KEY if _NOT_A_KEY in items else {"t": "tuple", "v": items}
    return _NOT_A_KEY


def _key_text(node: Any) -> str:
    return json.dumps(node, sort_keys=True)


def manifest_paths(tree: Any, every: set[Path] | None = None) -> dict[int, list[Path]]:
    """The paths of every ``tensor`` node of a checked manifest tree, by array id (a tied
    tensor has several); ``every`` gets the path of every node, of any kind."""
    found: dict[int, list[Path]] = {}
    stack: list[tuple[Any, Path]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if every is not None:
            every.add(path)
        if type(node) is not dict:
            continue
        tag, value = node.get("t"), node.get("v")
        if tag == "tensor":
            found.setdefault(node["id"], []).append(path)
        elif tag in ("dict", "odict"):
            if isinstance(value, dict):
                stack.extend((v, (*path, _key_text(k))) for k, v in value.items())
            for k, v in node.get("items") or ():
                stack.append((v, (*path, _key_text(k))))
        elif tag in ("list", "tuple") and isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))
    return found


def _live_tensors(state: Any) -> dict[Path, torch.Tensor]:
    """The plain tensors of a live state (a ``state_dict()``), by path."""
    found: dict[Path, torch.Tensor] = {}
    stack: list[tuple[Any, Path]] = [(state, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_TREE_DEPTH:
            continue
        if isinstance(value, torch.Tensor):
            if type(value) in (torch.Tensor, torch.nn.Parameter) or _is_dtensor(value):
                found[path] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                node = _key_node(k)
                if node is not _NOT_A_KEY:
                    stack.append((v, (*path, _key_text(node))))
        elif type(value) in (list, tuple):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))
    return found


def _byte_view(t: torch.Tensor, entry: TensorEntry) -> torch.Tensor | None:
    """A uint8 view of ``t``'s memory when the stored array can be read into it, else None."""
    if (
        entry.kind != "tensor"
        or t.device.type != "cpu"
        or t.layout != torch.strided
        or str(t.dtype).removeprefix("torch.") != entry.dtype
        or tuple(t.shape) != entry.shape
        or not t.is_contiguous()
        or t.is_conj()
        or t.is_neg()
        or t.numel() == 0
    ):
        return None
    try:
        raw = t.detach().reshape(-1).view(torch.uint8)
    except (RuntimeError, TypeError):
        return None
    if raw.data_ptr() != t.data_ptr() or raw.numel() != entry.raw_nbytes:
        return None
    return raw


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


@functools.lru_cache(maxsize=4096)
def _held(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Any, ...],
    order: tuple[tuple[int, tuple[int, ...]], ...] | None,
) -> dict[Coordinate, Region]:
    return dtensor_regions(
        shape, mesh_shape, placements, shard_order=None if order is None else dict(order)
    )


def _fill(live: torch.Tensor, entry: TensorEntry, path: Path) -> Fill | None:
    """How the stored array ``entry`` is read into ``live`` in place, or None."""
    if not _is_dtensor(live):
        raw = _byte_view(live, entry)
        if raw is None:
            return None
        if entry.boxes is None:
            return Fill(live, raw, path)
        return Fill(live, raw, path, Region.whole(entry.shape), live)
    if (
        entry.kind != "tensor"
        or str(live.dtype).removeprefix("torch.") != entry.dtype
        or tuple(live.shape) != entry.shape
    ):
        return None
    shape, mesh_shape, placements, order = dtensor_layout(live)
    try:
        held = _held(
            shape,
            mesh_shape,
            placements,
            None if order is None else tuple((d, tuple(m)) for d, m in sorted(order.items())),
        )
    except UnsupportedValueError:
        return None  # Partial, interleaved: restored as a whole tensor
    dtensor: Any = live
    box = held.get(tuple(dtensor.device_mesh.get_coordinate() or ()))
    local = dtensor.to_local()
    if box is None or tuple(local.shape) != box.shape or not local.is_contiguous():
        return None
    try:
        raw = local.detach().reshape(-1).view(torch.uint8)
    except (RuntimeError, TypeError):
        return None
    return Fill(live, raw, path, box, local)


class InPlaceTargets:
    """The live tensors a restore fills in place, and the paths any attempt wrote into.

    ``state`` is shaped as the saved state (for model-parallel training, what
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives, DTensors included):
    ``CheckpointManager.restore(targets=InPlaceTargets(state))`` reads each stored array
    into the live tensor at the same path when it can (see the module's docstring), and the
    restored state holds those tensors.

    The checkpoint must match ``state``, as DCP's ``load`` requires: a live tensor that it has
    no value for, or whose stored array has another shape (a DTensor's global shape), makes
    the restore raise :class:`~coci_core.errors.StateMismatchError` before anything is read.
    ``partial=True`` allows the missing ones (they are left as they are); a shape never
    differs. Values the checkpoint holds and ``state`` does not are restored as stored.

    Use one for one restore (its fallbacks included): a damaged step may have overwritten a
    tensor before its damage was found, and :meth:`check` then makes sure the step finally
    restored puts a value at each such path (``load_state_dict`` then overwrites it again),
    except under the paths in ``replaced`` (keys and list indices, such as ``("optim",)``),
    whose ``load_state_dict`` replaces their whole state (an optimizer's: the tensors it is not
    given are dropped; they may be missing from the checkpoint).
    """

    def __init__(
        self,
        state: Mapping[str, Any],
        replaced: Iterable[tuple[Any, ...]] = (),
        *,
        partial: bool = False,
    ) -> None:
        if type(partial) is not bool:
            raise ConfigError(f"'partial' must be True or False: {partial!r}")
        self._live = _live_tensors(dict(state))
        self._replaced = [
            tuple(k if type(k) is int else _key_text(_key_node(k)) for k in prefix)
            for prefix in replaced
        ]
        self.partial = partial
        self.written: set[Path] = set()
        self._present: set[Path] = set()

    def __len__(self) -> int:
        return len(self._live)

    def _is_replaced(self, path: Path) -> bool:
        return any(path[: len(r)] == r for r in self._replaced)

    def check_match(
        self,
        trees: Iterable[tuple[Any, tuple[TensorEntry, ...]]],
        step: int,
        absent: Any = None,
    ) -> None:
        """Raise unless the (checked) trees of ``step`` hold a value for every live tensor
        (but under ``replaced``, or with ``partial``) and an array of the same shape for each.
        ``absent``: the per-rank tree of another rank, when the checkpoint has none for this
        one (a restore onto more ranks): its paths are not missing, this rank gets none.

        Raises:
            StateMismatchError: naming each missing path and each shape that differs.
        """
        every: set[Path] = set()
        if absent is not None:
            manifest_paths(absent, every)
        stored: dict[Path, TensorEntry] = {}
        for tree, entries in trees:
            for i, paths in manifest_paths(tree, every).items():
                stored.update((p, entries[i]) for p in paths)
        missing = sorted(
            _show(p) for p in self._live if p not in every and not self._is_replaced(p)
        )
        mismatched = sorted(
            f"{_show(p)}: stored {entry.shape}, live {tuple(live.shape)}"
            for p, live in self._live.items()
            if (entry := stored.get(p)) is not None
            and entry.kind == "tensor"
            and entry.shape != tuple(live.shape)
        )
        if self.partial:
            missing = []
        self._check_layouts(stored, step)
        if not missing and not mismatched:
            return
        parts = []
        if missing:
            parts.append(
                f"it has no value for {len(missing)} live tensor(s): {_few(missing)} (pass "
                "partial=True to restore the rest and leave these as they are)"
            )
        if mismatched:
            parts.append(
                f"{len(mismatched)} stored shape(s) differ: {_few(mismatched)} (the "
                "checkpoint holds another model: resume with the model it was saved from, or "
                "train the changed one as a new run, in a directory of its own)"
            )
        raise StateMismatchError(
            f"step {step} does not match the state to restore into: " + "; ".join(parts),
            missing=missing,
            mismatched=mismatched,
            step=step,
        )

    def _check_layouts(self, stored: Mapping[Path, TensorEntry], step: int) -> None:
        """Raise when the checkpoint holds arrays of a replaced state (an optimizer's) with
        DTensors but none at the path of any of them: that state in another layout
        (``get_state_dict``'s, keyed by parameter names, against ``optimizer.state_dict()``'s),
        whose whole tensors ``load_state_dict`` would take and its next step could not mix with
        DTensors. (An optimizer saved with no state yet holds no array there: restored, it
        has none again.)"""
        for prefix in self._replaced:
            n = len(prefix)
            sharded = [p for p, t in self._live.items() if p[:n] == prefix and _is_dtensor(t)]
            held = any(p[:n] == prefix for p in stored)
            if sharded and held and not any(p in stored for p in sharded):
                raise StateMismatchError(
                    f"step {step} holds {_show(prefix)} in another layout than the live "
                    f"optimizer's state_dict() (no value at any of its {len(sharded)} sharded "
                    f"tensors, e.g. {_show(sharded[0])}): it was saved as get_state_dict gives "
                    "it; restore it the same way (targets=InPlaceTargets(get_state_dict(...)) "
                    "and set_state_dict, see docs/sharding.md)",
                    missing=sorted(_show(p) for p in sharded),
                    mismatched=[],
                    step=step,
                )

    def plan(
        self,
        trees: Iterable[tuple[Any, tuple[TensorEntry, ...]]],
        step: int = -1,
        absent: Any = None,
    ) -> list[dict[int, Fill]]:
        """For each (checked) tree and its arrays, the arrays to read in place, by id, once
        :meth:`check_match` passed (``absent``: see there).

        Tensors that share memory with one another are left out (each would be written twice).
        """
        trees = list(trees)
        self.check_match(trees, step, absent)
        self._present = set()
        plans: list[dict[int, Fill]] = []
        for tree, entries in trees:
            fills: dict[int, Fill] = {}
            for i, paths in manifest_paths(tree).items():
                self._present.update(paths)
                for path in paths:
                    live = self._live.get(path)
                    fill = None if live is None else _fill(live, entries[i], path)
                    if fill is not None:
                        fills[i] = fill
                        break
            plans.append(fills)
        _drop_overlaps(plans)
        return plans

    def check(self, step: int) -> None:
        """Raise if an attempt wrote into a tensor that the restored ``step`` has no value for.

        Raises:
            CheckpointError: naming the paths (their tensors hold bytes of a damaged step).
        """
        missing = sorted(_show(p) for p in self.written - self._present if not self._is_replaced(p))
        if missing:
            raise CheckpointError(
                f"a damaged checkpoint was partly read into the given objects before its damage "
                f"was found, and step {step}, restored instead, has no value for {missing[:5]}: "
                "those tensors were left overwritten"
            )


def _show(path: Path) -> str:
    return "/" + "/".join(str(json.loads(p)) if isinstance(p, str) else str(p) for p in path)


def _few(items: list[str], n: int = 10) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _drop_overlaps(plans: list[dict[int, Fill]]) -> None:
    spans = sorted(
        (f.raw.data_ptr(), f.raw.data_ptr() + f.raw.numel(), n, i)
        for n, fills in enumerate(plans)
        for i, f in fills.items()
    )
    overlapping: set[tuple[int, int]] = set()
    end, last = -1, None
    for start, stop, n, i in spans:
        if start < end and last is not None:
            overlapping.update((last, (n, i)))
        if stop > end:
            end, last = stop, (n, i)
    for n, i in overlapping:
        del plans[n][i]


def _make_sharded_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the state of an optimizer of DTensor parameters that has none yet, as
    ``get_state_dict`` does (one step with zero gradients and a learning rate of 0): its moments
    are then DTensors that a restore fills with only this rank's part, where the optimizer
    would otherwise be given whole tensors that its next step cannot mix with DTensors."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or not any(_is_dtensor(p) for p in params):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def in_place_targets(into: Mapping[str, Any], *, partial: bool = False) -> InPlaceTargets | None:
    """The targets for ``restore(into=...)``: the ``state_dict()`` tensors of the modules and
    torch optimizers in ``into`` (whose ``load_state_dict`` keeps or adopts them), or None.
    An optimizer of DTensor parameters without a state yet gets it made first (see
    :func:`_make_sharded_state`)."""
    for obj in into.values():
        if isinstance(obj, torch.optim.Optimizer):
            _make_sharded_state(obj)
    live = {
        key: obj.state_dict()
        for key, obj in into.items()
        if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
    }
    optimizers = [(k,) for k, obj in into.items() if isinstance(obj, torch.optim.Optimizer)]
    targets = InPlaceTargets(live, optimizers, partial=partial) if live else None
    return targets if targets is not None and len(targets) else None
