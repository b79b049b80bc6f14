"""A blocking save's copy started before its flatten has checked the state.

Flattening a state of many tensors costs about as much per tensor as copying a small one: its
walk reads every tensor's address, dtype, shape and strides to check that the state still has
the layout of the last save. When it had that layout last time, the copy does not need to wait
for the check: the tensors are found by a quick walk of the state's dicts, lists and tuples
and copied into the arena's views of the last save, in one ``torch._foreach_copy_`` that
releases the GIL, while a helper thread flattens the state. The copy counts only when the
flatten then met the very same tensor objects, in the same order, with the cached layout (so
with the shapes, dtypes and strides of the views); otherwise the save copies again as usual.
The training thread's wait is then the longer of the copy and the flatten, not their sum.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from coci_core.engine.format.tree import FlatState, FlattenCache, collect_tensors, flatten_state
from coci_core.engine.save.save_inputs import flatten_per_rank
from coci_core.engine.save.snapshot import Snapshotter

__all__ = ["Flattened", "FlattenAhead"]


@dataclass(frozen=True)
class Flattened:
    """A save's flattened ``state`` and ``per_rank``, and the views already holding the
    first ``precopied`` leaves (None: nothing was copied ahead)."""

    flat: FlatState
    own: FlatState | None
    views: list[torch.Tensor] | None = None
    precopied: int = 0


def _join(thread: threading.Thread) -> None:
    """Wait for ``thread`` to end, also when an exception (Ctrl-C) interrupts the wait: the
    flatten it runs uses the caches, which the next save uses."""
    interrupted: BaseException | None = None
    while True:
        try:
            thread.join()
            break
        except BaseException as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted


def _same(a: list[torch.Tensor], b: list[torch.Tensor] | None) -> bool:
    return b is not None and len(a) == len(b) and all(map(operator.is_, a, b))


class FlattenAhead:
    """Flattens a manager's saves, copying ahead where the last saves say it pays.

    It copies ahead only for a blocking save of one rank whose arena holds whole host leaves
    of the cached layout, and only while the quick walk found what the flatten met at the
    last save that reused its cache (a miss turns it off until such a save finds it again).
    One flatten at a time (the manager's save lock).
    """

    def __init__(self, snapshotter: Snapshotter, *, allow_torch_save: bool) -> None:
        self._snapshotter = snapshotter
        self._allow_torch_save = allow_torch_save
        self.flat_cache = FlattenCache()
        self.rank_cache = FlattenCache()
        self._walk_finds = False  # the quick walk found the flatten's tensors last time
        self.copied_ahead = 0  # saves whose copy ahead counted
        self.copied_twice = 0  # saves whose copy ahead did not count (copied again)

    def _flatten(self, state: Mapping[str, Any], per_rank: Mapping[str, Any] | None) -> Flattened:
        flat = flatten_state(state, allow_torch_save=self._allow_torch_save, cache=self.flat_cache)
        own = flatten_per_rank(
            state, per_rank, allow_torch_save=self._allow_torch_save, cache=self.rank_cache
        )
        return Flattened(flat, own)

    def flatten(
        self, state: Mapping[str, Any], per_rank: Mapping[str, Any] | None, *, ahead: bool
    ) -> Flattened:
        """Flatten ``state`` and ``per_rank``; ``ahead``: the save copies before it returns
        and is this rank's alone, so its copy may start now (see the module's docstring)."""
        cached = self.flat_cache.layout
        views = None
        if ahead and cached is not None:
            own_layout = self.rank_cache.layout if per_rank is not None else None
            views = self._snapshotter.whole_views((cached, own_layout))
        tensors = collect_tensors(state) if views is not None and self._walk_finds else None
        if tensors is None or views is None or len(tensors) != len(self.flat_cache.keys):
            done = self._flatten(state, per_rank)
            # Whether the next save may copy ahead: the quick walk finds what this flatten met,
            # and this flatten reused the cache (a state that misses it at every save would
            # copy twice), or was the first.
            if ahead and (views is not None or cached is None):
                reused = done.flat.layout is cached or cached is None
                found = collect_tensors(state) if reused else None
                self._walk_finds = found is not None and _same(found, done.flat.tensors)
            return done
        firsts = self.flat_cache.firsts
        sources = [tensors[i] for i in firsts]
        result: list[Flattened | BaseException] = []

        def run() -> None:
            try:
                result.append(self._flatten(state, per_rank))
            except BaseException as e:  # re-raised on the saving thread
                result.append(e)

        helper = threading.Thread(target=run, name="coci-flatten")
        helper.start()
        try:
            with torch.no_grad():
                torch._foreach_copy_(views[: len(sources)], sources)
            copied = True
        except Exception:  # e.g. a tensor of another shape now: the flatten says what changed
            copied = False
        finally:
            _join(helper)
        outcome = result[0]
        if isinstance(outcome, BaseException):
            raise outcome
        done = outcome
        counts = copied and done.flat.layout is cached and _same(tensors, done.flat.tensors)
        self._walk_finds = counts
        if not counts:
            self.copied_twice += 1
            return done
        self.copied_ahead += 1
        return Flattened(done.flat, done.own, views, len(sources))
