"""Phase 1: copy the state's arrays into host buffers that are allocated once and reused.

All leaves of a save live in one flat, page-aligned host *arena*, so that phase 2 can checksum
and write the arena as it is, with large sequential writes and no serialization pass. Small
whole leaves lie end to end at the start of the arena (each at a multiple of its element size),
so that from the second save of the same tensors on, their copy is one ``torch.cat`` over byte
views of them rather than one copy per tensor (``PACKED_COPY_BYTES``). With
several ranks a snapshot holds only this rank's *regions* (byte ranges of leaves, see
``partition.py``), so each rank copies only what it writes. The arena is kept and reused while
later saves have the same layout (dtypes, shapes and regions); a new layout allocates a new
arena. When any leaf is on CUDA the arena is pinned and the copies run
non-blocking on a side stream.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coci_core.engine.format.tree import ArrayLeaf
from coci_core.engine.save.partition import Share
from coci_core.errors import StateChangedError
from coci_core.knobs import (
    CHECK_GRACE_COPIES,
    CHECK_GRACE_S,
    OWNER_POLL_S,
    PACKED_COPY_BYTES,
    SMALL_COPY_BYTES,
)

__all__ = [
    "SMALL_COPY_BYTES",
    "Arena",
    "LeafSlot",
    "Snapshot",
    "Snapshotter",
    "plan_layout",
    "whole_leaves",
]

ALIGN_BYTES = 64
PAGE_BYTES = 4096


@dataclass(frozen=True)
class LeafSlot:
    """Where bytes ``[start, start + nbytes)`` of leaf ``leaf`` sit in the arena (and so in the
    data file). ``shape`` is the leaf's shape for a whole leaf, else the region's length."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    leaf: int = 0
    start: int = 0
    whole: bool = True


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def whole_leaves(leaves: tuple[ArrayLeaf, ...]) -> tuple[Share, ...]:
    """One region per leaf, covering all of it."""
    return tuple(Share(i, 0, leaf.nbytes) for i, leaf in enumerate(leaves))


def plan_layout(
    leaves: tuple[ArrayLeaf, ...], regions: tuple[Share, ...] | None = None
) -> tuple[tuple[LeafSlot, ...], int]:
    """Offsets of every region (in the order of ``regions``) and the arena's total size (a
    whole number of pages).

    Whole leaves (``regions`` None) of at most ``PACKED_COPY_BYTES`` come first, end to end,
    by element size from the largest (so each lies at a multiple of its own), then the larger
    ones, each at a multiple of ``ALIGN_BYTES``. The regions of a save of several ranks lie
    in their order, each at a multiple of ``ALIGN_BYTES``.
    """
    packed = regions is None
    shares = whole_leaves(leaves) if regions is None else regions
    offsets = [0] * len(shares)
    order = list(range(len(shares)))
    small: list[int] = []
    if packed:
        small = [i for i in order if shares[i].nbytes <= PACKED_COPY_BYTES]
        small.sort(key=lambda i: -leaves[shares[i].leaf].tensor.element_size())
        order = small + [i for i in order if shares[i].nbytes > PACKED_COPY_BYTES]
    offset = 0
    for n, i in enumerate(order):
        if n >= len(small):
            offset = _round_up(offset, ALIGN_BYTES)
        offsets[i] = offset
        offset += shares[i].nbytes
    slots = []
    for region, at in zip(shares, offsets, strict=True):
        t = leaves[region.leaf].tensor
        whole = region.start == 0 and region.nbytes == leaves[region.leaf].nbytes
        shape = tuple(t.shape) if whole else (region.nbytes // t.element_size(),)
        slots.append(LeafSlot(at, region.nbytes, t.dtype, shape, region.leaf, region.start, whole))
    return tuple(slots), max(_round_up(offset, PAGE_BYTES), PAGE_BYTES)


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (each in-place change adds one), or None."""
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):  # inference tensors have none
        return None


_TENSOR = operator.attrgetter("tensor")
_VERSION = operator.attrgetter("_version")


def _versions(leaves: tuple[ArrayLeaf, ...]) -> tuple[int | None, ...]:
    """Every leaf's version counter (see :func:`_version`)."""
    try:
        return tuple(map(_VERSION, map(_TENSOR, leaves)))
    except (RuntimeError, AttributeError):  # an inference tensor among them
        return tuple(_version(leaf.tensor) for leaf in leaves)


def _byte_view(t: torch.Tensor) -> torch.Tensor | None:
    """A flat ``uint8`` view of a contiguous host tensor's bytes, or None where there is none
    that holds its values as they read (lazy conjugate or negative views, quantized, sparse)."""
    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
        or not t.is_contiguous()
    ):
        return None
    try:
        return t.detach().view(-1).view(torch.uint8)
    except RuntimeError:
        return None


@dataclass(frozen=True)
class CopyRuns:
    """A snapshot's copy as one ``torch.cat`` per run of small slots that lie end to end in the
    arena, from byte views of the leaves made once (valid while the leaves keep their memory:
    the flatten's layout token says so; none of a leaf that ``moves``), and one
    ``torch._foreach_copy_`` for the others."""

    arena: Arena
    runs: tuple[tuple[torch.Tensor, list[torch.Tensor]], ...]
    rest: tuple[int, ...]
    rest_leaves: tuple[int, ...] = ()  # the leaf of each slot of ``rest``

    @classmethod
    def plan(
        cls, arena: Arena, slots: tuple[LeafSlot, ...], leaves: tuple[ArrayLeaf, ...]
    ) -> CopyRuns:
        """The runs of whole host ``leaves`` laid out as ``slots`` in ``arena``."""
        runs: list[tuple[int, list[torch.Tensor]]] = []  # (first byte, byte views)
        rest: list[int] = []
        end = -1  # one past the last byte of the current run
        for i in sorted(range(len(slots)), key=lambda i: slots[i].offset):
            slot = slots[i]
            leaf = leaves[slot.leaf]
            small = slot.nbytes <= PACKED_COPY_BYTES and not leaf.moves  # moves: copied anew
            view = _byte_view(leaf.tensor) if small else None
            if view is None or view.numel() != slot.nbytes:
                rest.append(i)
                continue
            if slot.offset != end:
                runs.append((slot.offset, []))
                end = slot.offset
            runs[-1][1].append(view)
            end += slot.nbytes
        return cls(
            arena,
            tuple(
                (arena.bytes[start : start + sum(v.numel() for v in views)], views)
                for start, views in runs
            ),
            tuple(rest),
            tuple(slots[i].leaf for i in rest),
        )

    def copy(self, snap: Snapshot) -> None:
        """Copy every slot of ``snap`` (laid out as when the runs were planned)."""
        for out, sources in self.runs:
            torch.cat(sources, out=out)
        if self.rest:
            torch._foreach_copy_(
                list(map(snap.views.__getitem__, self.rest)),
                list(map(_TENSOR, map(snap.leaves.__getitem__, self.rest_leaves))),
            )


def _copy_whole(snap: Snapshot) -> None:
    """Copy every slot of a snapshot of whole host leaves in a few calls (no Python loop)."""
    if not snap.slots:
        return
    with torch.no_grad():
        if snap.runs is not None:
            snap.runs.copy(snap)
        else:
            leaves = snap.leaves
            sources = [leaves[slot.leaf].tensor for slot in snap.slots]
            torch._foreach_copy_(snap.views, sources)


def _source(tensor: torch.Tensor, slot: LeafSlot) -> torch.Tensor:
    if slot.whole:
        return tensor
    item = tensor.element_size()
    return tensor.reshape(-1)[slot.start // item : (slot.start + slot.nbytes) // item]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_bits(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A zero-copy numpy view of a CPU tensor's bits (any dtype, any strides)."""
    if t.element_size() in _SAME_SIZE_INT:
        return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()
    return torch.view_as_real(t).numpy()  # complex128: two float64 per element


def copy_outside_torch(dst: torch.Tensor, tensor: torch.Tensor, slot: LeafSlot) -> None:
    """Copy ``slot``'s bytes of CPU ``tensor`` into ``dst`` with numpy, not a torch op.

    For a helper thread: a torch op there makes OpenMP give that long-lived thread a team of
    its own; with more OpenMP threads than cores, libgomp stops spinning at its barriers, and
    every step of the training thread ran 25-45% slower here for as long as the helper lived.
    """
    src = tensor.detach()
    if src.is_conj() or src.is_neg() or src.layout != torch.strided or src.is_quantized:
        dst.copy_(_source(src, slot))  # no numpy view of these (conj/neg views, sparse): rare
        return
    bits = _numpy_bits(src)
    out = _numpy_bits(dst)
    if not slot.whole:
        item = 8 if src.dtype == torch.complex128 else src.element_size()
        bits = bits.reshape(-1)[slot.start // item : (slot.start + slot.nbytes) // item]
        out = out.reshape(-1)
    np.copyto(out, bits.reshape(out.shape), casting="no")


class Arena:
    """One page-aligned host buffer holding every leaf of a save."""

    def __init__(self, total_bytes: int, *, pinned: bool) -> None:
        raw = torch.empty(total_bytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pinned)
        start = (-raw.data_ptr()) % PAGE_BYTES
        self._raw = raw
        self.bytes = raw[start : start + total_bytes]
        self.pinned = pinned
        self.total_bytes = total_bytes
        self._array: np.ndarray[Any, Any] | None = None

    def view(self, slot: LeafSlot) -> torch.Tensor:
        """The typed, shaped view of ``slot``'s bytes."""
        region = self.bytes[slot.offset : slot.offset + slot.nbytes]
        return region.view(slot.dtype).view(slot.shape)

    def memoryview(self, start: int = 0, stop: int | None = None) -> memoryview:
        """A zero-copy memoryview of a byte range of the arena."""
        if self._array is None:
            self._array = self.bytes.numpy()
        return self._array[start:stop].data


@dataclass
class Snapshot:
    """A state's leaves, being (or having been) copied into an arena."""

    arena: Arena
    slots: tuple[LeafSlot, ...]
    leaves: tuple[ArrayLeaf, ...]
    allocated: bool
    copied: threading.Event
    # each slot's typed, shaped view of the arena (``Arena.view``), made once per arena
    views: list[torch.Tensor] = field(default_factory=list)
    # every slot a whole leaf in host memory: copied with one ``torch._foreach_copy_``, or
    # by ``runs`` where the same leaves were saved before
    host_whole: bool = False
    runs: CopyRuns | None = None
    copy_s: float = 0.0
    copied_at: float = 0.0
    error: BaseException | None = None
    _cuda_event: Any = None
    # each leaf's version counter when the save was asked for (see ``check_unchanged``)
    versions: tuple[int | None, ...] = ()
    # slots already copied by ``save()`` itself (``Snapshotter.copy_small``)
    precopied: frozenset[int] = frozenset()
    _small_cuda_event: Any = None
    # the thread that asked for the save: a background copy is checked on it (``check_copy``)
    owner: threading.Thread = field(default_factory=threading.current_thread)
    # set once the copy is known to hold the state of the save (or ``changed`` says why not)
    checked: threading.Event = field(default_factory=threading.Event)
    changed: StateChangedError | None = None
    _check_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait_copied(self) -> None:
        """Block until every leaf is in host memory (re-raises a failed copy)."""
        self.copied.wait()
        for event in (self._small_cuda_event, self._cuda_event):
            if event is not None:
                event.synchronize()
        self._small_cuda_event = self._cuda_event = None
        if self.error is not None:
            raise self.error

    def order_current_stream(self) -> None:
        """Make later work on the current CUDA stream run after the device-to-host copy (of a
        copy that has finished on the host side; nothing to do without CUDA)."""
        event = self._cuda_event
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def check_unchanged(self) -> None:
        """Raise if a leaf was changed in place since the save was asked for (its version
        counter moved): its copy may hold newer values than the step's. Writes that move no
        version counter (through ``.data``, numpy or the storage) are not seen.

        Raises:
            StateChangedError: naming the changed leaves.
        """
        changed = self.changed_leaves()
        if changed:
            raise StateChangedError(
                f"{changed[:5]} changed while the save's background copy was under way "
                f"({len(changed)} tensors): this save is given up rather than stored with "
                "newer values; coci copies them before save() returns from now on. Changes by "
                "torch optimizers wait for the copy by themselves; for other in-place changes "
                "call before_update() first, or save with block=True",
                keys=changed,
            )

    def may_check_here(self) -> bool:
        """Whether this thread may run :meth:`check_copy`: the thread that asked for the save
        (when it is back in coci, every in-place write it started has returned, so its version
        counter moved), or any thread once that one has ended."""
        return self.owner is threading.current_thread() or not self.owner.is_alive()

    def check_copy(self) -> None:
        """Wait for the copy, then record whether a leaf changed in place since the save was
        asked for (``changed``) and set ``checked``: the commit waits for it
        (:meth:`wait_checked`). Call it where :meth:`may_check_here` is true.

        Not on the writer thread right after its copy: torch bumps a tensor's version counter
        after an in-place kernel has written it, so a write still running on the training
        thread when the copy ends was not seen there yet.
        """
        self.copied.wait()
        with self._check_lock:
            if self.checked.is_set():
                return
            try:
                self.check_unchanged()
            except StateChangedError as e:
                self.changed = e
            self.checked.set()

    def wait_checked(self) -> None:
        """On the writer thread, before the commit: wait until :meth:`check_copy` ran (on the
        thread that saved, or here once that thread has ended or the grace time after the
        copy, :data:`CHECK_GRACE_S`, has passed).

        Raises:
            StateChangedError: a leaf changed in place before the copy was checked.
        """
        grace = max(CHECK_GRACE_S, CHECK_GRACE_COPIES * self.copy_s)
        while not self.checked.wait(OWNER_POLL_S):
            if not self.owner.is_alive() or time.perf_counter() - self.copied_at > grace:
                self.check_copy()
        if self.changed is not None:
            raise self.changed

    def changed_leaves(self) -> list[str]:
        """The keys of the leaves whose version counter moved since the save was asked for
        (those copied by the save itself excluded)."""
        return [
            leaf.key
            for leaf, before in zip(self.leaves, self.versions, strict=False)
            if before is not None and _version(leaf.tensor) != before
        ]


class Snapshotter:
    """Copies states into a reused arena; one snapshot may be in use at a time."""

    def __init__(self) -> None:
        self._arena: Arena | None = None
        self._layout_key: tuple[Any, ...] | None = None
        # the flatten's layout token and the regions of the current arena (see ``prepare``)
        self._layout: tuple[object, ...] | None = None
        self._regions: tuple[Share, ...] | None = None
        self._slots: tuple[LeafSlot, ...] = ()
        self._views: list[torch.Tensor] | None = None
        self._host_whole = False
        # the copy runs of the current arena and the layout token they hold for, and the
        # token of the last prepare: runs are planned when a token comes twice in a row
        self._runs: CopyRuns | None = None
        self._runs_layout: tuple[object, ...] | None = None
        self._last_layout: tuple[object, ...] | None = None
        self._stream: Any = None
        self._lock = threading.Lock()  # held while an arena is allocated (and faulted in)

    @staticmethod
    def _key(leaves: tuple[ArrayLeaf, ...], regions: tuple[Share, ...] | None) -> tuple[Any, ...]:
        on_cuda = any(leaf.tensor.device.type == "cuda" for leaf in leaves)
        return (
            on_cuda,
            regions,
            *((leaf.tensor.dtype, tuple(leaf.tensor.shape)) for leaf in leaves),
        )

    def _allocate(
        self,
        leaves: tuple[ArrayLeaf, ...],
        regions: tuple[Share, ...] | None,
        *,
        touch: bool,
        layout: tuple[object, ...] | None = None,
    ) -> bool:
        """Make the arena of this layout the current one (under ``_lock``); whether one was
        allocated. ``touch`` writes every page, so that the kernel maps them now. ``layout``:
        the flatten's layout tokens (see :class:`~coci_core.engine.format.tree.FlattenCache`), the
        same ones for the same leaves' layout, or None."""
        if (
            layout is not None
            and self._arena is not None
            and layout == self._layout
            and regions == self._regions
        ):
            return False
        key = self._key(leaves, regions)
        self._layout, self._regions = layout, regions
        if self._arena is not None and key == self._layout_key:
            return False
        # free the old arena before allocating the new one
        self._arena = self._views = self._runs = None
        self._slots, total = plan_layout(leaves, regions)
        on_cuda = key[0]
        arena = Arena(total, pinned=on_cuda and torch.cuda.is_available())
        if touch:
            arena.bytes.fill_(0)
        self._arena = arena
        self._layout_key = key
        self._host_whole = not on_cuda and all(slot.whole for slot in self._slots)
        return True

    def reserve(
        self, leaves: tuple[ArrayLeaf, ...], regions: tuple[Share, ...] | None = None
    ) -> threading.Thread:
        """Allocate the arena for this layout and fault its pages in on a helper thread, so
        that the first snapshot of it copies at the steady speed; :meth:`prepare` waits for it.
        """

        def run() -> None:
            with self._lock:
                self._allocate(leaves, regions, touch=True)

        # Not a daemon: Python waits for it at exit. A daemon thread still filling the arena
        # (a torch op, without the GIL) when the interpreter finalizes aborts the process.
        thread = threading.Thread(target=run, name="coci-arena")
        thread.start()
        return thread

    def prepare(
        self,
        leaves: tuple[ArrayLeaf, ...],
        regions: tuple[Share, ...] | None = None,
        layout: tuple[object, ...] | None = None,
        *,
        background: bool = True,
    ) -> Snapshot:
        """Bind ``regions`` of ``leaves`` (default: all of every leaf) to an arena, allocating
        one only when the layout changed. ``layout``: the flatten's layout tokens, which
        spare comparing every leaf's dtype and shape with the arena's. ``background``: part
        of the copy may run after the caller goes on (each leaf's version counter is read now,
        to check it by); False: all of it is copied by the caller before it goes on."""
        with self._lock:
            allocated = self._allocate(leaves, regions, touch=False, layout=layout)
            arena = self._arena
            assert arena is not None
            if self._views is None:
                self._views = [arena.view(slot) for slot in self._slots]
            runs = self._copy_runs(arena, leaves, layout)
            return Snapshot(
                arena,
                self._slots,
                leaves,
                allocated,
                threading.Event(),
                views=self._views,
                host_whole=self._host_whole,
                runs=runs,
                versions=_versions(leaves) if background else (),
            )

    def _copy_runs(
        self, arena: Arena, leaves: tuple[ArrayLeaf, ...], layout: tuple[object, ...] | None
    ) -> CopyRuns | None:
        """The copy runs for these leaves, planned the second time in a row that the flatten
        says they are the same tensors at the same addresses (a byte view costs more than one
        copy of a small tensor: not made for leaves that move between saves)."""
        last, self._last_layout = self._last_layout, layout
        if not self._host_whole or layout is None:
            return None
        runs = self._runs
        if runs is not None and runs.arena is arena and self._runs_layout == layout:
            return runs
        self._runs = None  # its byte views would keep the old leaves' memory alive
        if last != layout:
            return None
        self._runs = CopyRuns.plan(arena, self._slots, leaves)
        self._runs_layout = layout
        return self._runs

    def copy_small(
        self,
        snap: Snapshot,
        max_bytes: int = SMALL_COPY_BYTES,
        also: Collection[str] = (),
    ) -> None:
        """Copy now, on the caller's thread, the regions of at most ``max_bytes``, those of
        the leaves named in ``also``, and every numpy array (for a ``block=False`` save:
        :meth:`copy` then skips them, and later changes to them do not matter). CUDA regions
        are copied on the current stream, ahead of any later work on it.

        Numpy arrays always: a write to one (``arr += 1``) moves no version counter, so a
        background copy could not tell that it read newer values.
        """
        done = []
        cuda = False
        host: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # copied in one call
        for i, slot in enumerate(snap.slots):
            leaf = snap.leaves[slot.leaf]
            if slot.nbytes > max_bytes and leaf.key not in also and leaf.kind != "ndarray":
                continue
            tensor = leaf.tensor
            if tensor.device.type == "cuda":
                snap.views[i].copy_(_source(tensor, slot), non_blocking=snap.arena.pinned)
                cuda = True
            else:
                host[0].append(snap.views[i])
                host[1].append(_source(tensor, slot))
            done.append(i)
        if host[0]:
            with torch.no_grad():
                torch._foreach_copy_(*host)
        if cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            snap._small_cuda_event = event
        snap.precopied = frozenset(done)
        pending = {snap.slots[i].leaf for i in range(len(snap.slots)) if i not in snap.precopied}
        snap.versions = tuple(v if i in pending else None for i, v in enumerate(snap.versions))

    def copy(self, snap: Snapshot, *, background: bool = False) -> None:
        """Copy every leaf into the arena; sets ``snap.copied`` even when the copy fails.

        ``background``: the caller is a helper thread, not the training thread (see
        :func:`copy_outside_torch`).
        """
        start = time.perf_counter()
        try:
            cuda_leaves = []
            if snap.host_whole and not background and not snap.precopied:
                _copy_whole(snap)
            else:
                for i, slot in enumerate(snap.slots):
                    if i in snap.precopied:
                        continue
                    leaf = snap.leaves[slot.leaf]
                    if leaf.tensor.device.type == "cuda":
                        cuda_leaves.append((i, leaf, slot))
                    elif background:
                        copy_outside_torch(snap.views[i], leaf.tensor, slot)
                    else:
                        snap.views[i].copy_(_source(leaf.tensor, slot))
            if cuda_leaves:
                snap._cuda_event = self._copy_from_cuda(snap, cuda_leaves)
            if background:
                snap.check_unchanged()  # early out only: the check that counts is check_copy
            else:
                snap.checked.set()  # copied on the thread that saved: nothing to check
        except BaseException as e:
            snap.error = e
        finally:
            snap.copied_at = time.perf_counter()
            snap.copy_s = snap.copied_at - start
            snap.copied.set()

    def _copy_from_cuda(self, snap: Snapshot, items: list[tuple[int, ArrayLeaf, LeafSlot]]) -> Any:
        # Device-to-host copies on a side stream so that they overlap the next compute; the
        # side stream first waits for the work that produced the tensors.
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for i, leaf, slot in items:
                snap.views[i].copy_(_source(leaf.tensor, slot), non_blocking=snap.arena.pinned)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return event
