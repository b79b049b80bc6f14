"""Saves of a state whose tensors keep their layout reuse the last flatten and the arena's
views: the saved state is still exactly the state of each save() call."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.format.manifest import (
    FORMAT_VERSION,
    DataFile,
    Manifest,
    Piece,
    RankState,
    TensorEntry,
    seal,
)
from coci_core.engine.format.regions import Region
from coci_core.engine.format.tree import FlattenCache, flatten_state
from tests.harness.processes import free_port, run, script
from tests.harness.states import assert_same


def _saved(tmp_path: Path, states: list[dict[str, Any]], **options: Any) -> list[Any]:
    """Save each state in turn with one manager, then restore every step."""
    with CheckpointManager(tmp_path, keep_last=None, **options) as mgr:
        for step, state in enumerate(states):
            mgr.save(step, state).wait()
        return [mgr.restore(step=step) for step in range(len(states))]


def _flat_json(flat: Any) -> str:
    return json.dumps([flat.tree, [(leaf.key, leaf.kind) for leaf in flat.leaves]])


# -- the flatten cache ----------------------------------------------------------------------


def test_cached_flatten_is_the_full_flatten() -> None:
    """A flatten from the cache gives the tree and leaves a full flatten gives, for the
    state's current tensors and values; the layout token stays while the layout does."""
    w = torch.randn(4, 3)
    state = {"model": {"w": w, "b": torch.zeros(3)}, "opt": {"lr": 0.1, "step": 3}, "n": [w]}
    cache = FlattenCache()
    first = flatten_state(state, cache=cache)
    assert first.layout is not None
    state["opt"]["lr"], state["opt"]["step"] = 0.05, 4
    again = flatten_state(state, cache=cache)
    assert again.layout is first.layout
    assert _flat_json(again) == _flat_json(flatten_state(state))
    assert again.tree["v"]["opt"]["v"] == {"lr": 0.05, "step": 4}
    assert [leaf.tensor.data_ptr() for leaf in again.leaves] == [
        w.data_ptr(),
        *[leaf.tensor.data_ptr() for leaf in again.leaves[1:]],
    ]
    assert len(again.leaves) == 2  # ``n[0]`` is ``w``: one leaf


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(w=s["w"].view(torch.int32)),  # same address, another dtype
        lambda s: s.update(w=s["w"].view(2, 6)),  # same address, another shape
        lambda s: s.update(w=s["w"].t()),  # same address, other strides
        lambda s: s.update(w=torch.randn(3, 4)),  # another tensor
        lambda s: s.update(x=torch.ones(2)),  # one more tensor
        lambda s: s.pop("b"),  # one fewer
        lambda s: s.update(b=s.pop("b") + 0),  # the keys in another order
        lambda s: s.update(w=s["w"].numpy()),  # a numpy array where a tensor was
        lambda s: s.update(b=s["w"]),  # an alias where there was none
    ],
)
def test_layout_change_misses(change: Any) -> None:
    """Any change of a tensor's address, dtype, shape, strides, type or key, or of the set of
    tensors, takes the full flatten (a new layout token)."""
    state: dict[str, Any] = {"w": torch.randn(3, 4), "b": torch.randn(5), "lr": 0.1}
    cache = FlattenCache()
    first = flatten_state(state, cache=cache)
    change(state)
    again = flatten_state(state, cache=cache)
    assert again.layout is not first.layout
    assert _flat_json(again) == _flat_json(flatten_state(state))


def test_renamed_keys_miss() -> None:
    """The same tensors under other keys: stored under the new keys."""
    a, b = torch.randn(2), torch.randn(3)
    cache = FlattenCache()
    flatten_state({"a": a, "b": b}, cache=cache)
    flat = flatten_state({"x": a, "y": b}, cache=cache)
    assert [leaf.key for leaf in flat.leaves] == ["/x", "/y"]


def test_states_with_torch_saved_values_are_not_cached() -> None:
    """torch.save'd values: a full flatten every time (no layout token)."""
    cache = FlattenCache()
    state = {"w": torch.randn(2), "s": torch.randn(2).to_sparse()}
    assert flatten_state(state, allow_torch_save=True, cache=cache).layout is None
    assert flatten_state(state, allow_torch_save=True, cache=cache).layout is None


def test_random_states_made_anew_at_each_save_hit_the_cache() -> None:
    """A random state's tensor and numpy array are new objects at new addresses, of the same
    layout, at each save (``torch.get_rng_state()``, ``numpy.random.get_state()``): the
    flatten hits the cache with leaves of the current arrays, marked ``moves`` (before: every
    flatten missed, a numpy array was never cached); the layout token changes once, when the
    tensor is first found moving, and stays from then on."""
    w = torch.randn(3)
    cache = FlattenCache()
    tokens, nodes = [], []
    for i in range(4):
        state = {"w": w, "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}}
        torch.rand(1), np.random.rand()  # the generators move on
        flat = flatten_state(state, cache=cache)
        assert _flat_json(flat) == _flat_json(flatten_state(state))
        leaves = {leaf.key: leaf for leaf in flat.leaves}
        assert torch.equal(leaves["/rng/torch"].tensor, state["rng"]["torch"])
        assert np.array_equal(leaves["/rng/numpy/1"].tensor.numpy(), state["rng"]["numpy"][1])
        assert [leaf.moves for leaf in flat.leaves] == [False, i > 0, True]
        tokens.append(flat.layout)
        nodes.append(cache.nodes)
    assert tokens[0] is not None and tokens[1] is not tokens[0]
    assert tokens[3] is tokens[2] is tokens[1]
    assert nodes[3] is nodes[0]  # hits: the first flatten's nodes


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (lambda a, b: {"a": a, "b": a}, lambda a, b: {"a": a, "b": a.clone()}),  # untied
        (lambda a, b: {"a": a, "b": a}, lambda a, b: {"a": a.clone(), "b": a}),  # first moves
        (lambda a, b: {"a": a, "b": b}, lambda a, b: {"a": a.clone(), "b": b}),  # moved: hit
        (lambda a, b: {"a": a, "b": b}, lambda a, b: dict.fromkeys("ab", a.clone())),  # tied
        (lambda a, b: {"a": a, "b": b}, lambda a, b: {"a": b, "b": b}),  # onto b's address
    ],
    ids=["untied", "first-untied", "moved", "both-onto-one", "onto-another"],
)
def test_a_tensor_that_moves_neither_makes_nor_undoes_a_tie(before: Any, after: Any) -> None:
    """A tensor at a new address hits the cache only where it made a leaf of its own and ties
    with no other: the flatten is the full flatten's (its ties and leaves) either way."""
    a, b = torch.randn(4), torch.randn(4)
    cache = FlattenCache()
    flatten_state(before(a, b), cache=cache)
    state = after(a, b)
    flat = flatten_state(state, cache=cache)
    assert _flat_json(flat) == _flat_json(flatten_state(state))
    assert [leaf.tensor.data_ptr() for leaf in flat.leaves] == [
        leaf.tensor.data_ptr() for leaf in flatten_state(state).leaves
    ]


def test_a_parameter_whose_data_was_replaced_is_stored_with_its_new_data() -> None:
    """The same parameter object at a new address (``p.data = ...``): its leaf, a detached
    view of the old memory, is made anew."""
    p = torch.nn.Parameter(torch.zeros(3))
    cache = FlattenCache()
    flatten_state({"p": p}, cache=cache)
    p.data = torch.ones(3)
    (leaf,) = flatten_state({"p": p}, cache=cache).leaves
    assert leaf.tensor.data_ptr() == p.data_ptr() and torch.equal(leaf.tensor, torch.ones(3))


def test_parameters_are_detached_each_time() -> None:
    """A parameter that requires grad is stored as a fresh detached view, every flatten."""
    p = torch.nn.Parameter(torch.randn(3))
    cache = FlattenCache()
    flatten_state({"p": p}, cache=cache)
    flat = flatten_state({"p": p}, cache=cache)
    (leaf,) = flat.leaves
    assert type(leaf.tensor) is torch.Tensor and not leaf.tensor.requires_grad
    assert leaf.tensor.data_ptr() == p.data_ptr()


# -- saves through the cache ----------------------------------------------------------------


def test_values_changed_between_saves_are_saved(tmp_path: Path) -> None:
    """In-place changes, non-tensor values (lr, step) and new tensor objects of the same
    layout (a state_dict() per save) are saved as they were at each save() call."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = []
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.param_groups[0]["lr"] *= 0.5
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            mgr.save(step, state).wait()
            expected.append(
                {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "lr": opt.param_groups[0]["lr"],
                    "step": step,
                }
            )
        for step, want in enumerate(expected):
            got = mgr.restore(step=step)
            assert_same(dict(got["model"]), want["model"])
            assert got["optim"]["param_groups"][0]["lr"] == want["lr"]
            assert got["step"] == step


def test_same_address_new_layout_saved_right(tmp_path: Path) -> None:
    """A tensor replaced by another view of the same bytes (another dtype, another shape)."""
    base = torch.arange(12, dtype=torch.float32)
    states = [
        {"w": base, "n": 1},
        {"w": base.view(torch.int32), "n": 2},
        {"w": base.view(3, 4), "n": 3},
        {"w": base.view(3, 4).t(), "n": 4},
    ]
    for got, want in zip(_saved(tmp_path, states), states, strict=True):
        assert_same(got, want)


def test_values_written_in_place_between_saves(tmp_path: Path) -> None:
    """The same tensors, changed in place between saves: each save holds its values."""
    ts = {f"t{i}": torch.zeros(i + 1) for i in range(50)}
    expected = []
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(3):
            for t in ts.values():
                t.fill_(float(step))
            mgr.save(step, {"ts": ts}).wait()
            expected.append({"ts": {k: v.clone() for k, v in ts.items()}})
        for step, want in enumerate(expected):
            assert_same(mgr.restore(step=step), want)


def test_aliases_kept_through_the_cache(tmp_path: Path) -> None:
    """Tied weights stay one tensor in every save of a cached layout."""
    w = torch.randn(8)
    states = [{"a": w, "b": w, "c": w[2:], "step": s} for s in range(3)]
    for got in _saved(tmp_path, states):
        assert got["a"].data_ptr() == got["b"].data_ptr()
        assert torch.equal(got["c"], w[2:])


def test_block_false_saves_of_a_cached_layout(tmp_path: Path) -> None:
    """Background copies of a cached layout hold the values of each save() call."""
    big = torch.zeros(1 << 16)
    small = torch.zeros(4)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(3):
            big.fill_(float(step))
            small.fill_(float(step))
            mgr.save(step, {"big": big, "small": small}, block=False)
            mgr.before_update()
        mgr.wait()
        for step in range(3):
            got = mgr.restore(step=step)
            assert torch.equal(got["big"], torch.full((1 << 16,), float(step)))
            assert torch.equal(got["small"], torch.full((4,), float(step)))


# -- the manifest's JSON --------------------------------------------------------------------


def _asdict_json(m: Manifest) -> bytes:
    """What ``to_json`` wrote with ``dataclasses.asdict``, the head's fields first."""
    doc = dataclasses.asdict(m)
    doc["format_version"] = FORMAT_VERSION
    doc = {k: doc[k] for k in (*_HEAD, *(k for k in doc if k not in _HEAD))}
    for entry in [*doc["tensors"], *(t for r in doc["per_rank"] for t in r["tensors"])]:
        assert entry.pop("boxes") is None  # written only when set (format 4)
    return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8"))


# the manifest's head, first (a listing reads it alone), then its other fields in order
_HEAD = ("format_version", "step", "created_unix", "run", "sequence", "bases")


@pytest.mark.parametrize("cls", [Piece, TensorEntry, RankState, DataFile, Manifest])
def test_to_dict_has_every_field_in_order(cls: Any) -> None:
    """A field added to a manifest record must be added to its ``to_dict``."""
    names = [f.name for f in dataclasses.fields(cls)]
    sequences = ("pieces", "tensors", "files", "per_rank")
    values: dict[str, Any] = {n: () if n in sequences else 0 for n in names}
    if cls is TensorEntry:
        values["boxes"] = (Region((0,), (1,)),)  # written only when set
    if cls is Manifest:
        names = [*_HEAD, *(n for n in names if n not in _HEAD)]
    assert list(cls(**values).to_dict()) == names


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"compression": "lossless"},
        {"compression": "lossy"},
    ],
)
def test_to_json_bytes_as_before(tmp_path: Path, options: dict[str, Any]) -> None:
    """The manifests of real saves (codec parameters, per-rank state, metadata) are written
    byte for byte as ``dataclasses.asdict`` wrote them (the head's fields first)."""
    state = {
        "model": torch.nn.Linear(64, 32).state_dict(),
        "ints": torch.arange(100),
        "tied": [torch.ones(3)] * 2,
        "lr": 0.1,
        "nan": float("nan"),
        "shape": torch.Size([2, 3]),
    }
    with CheckpointManager(tmp_path, keep_last=None, **options) as mgr:
        for step in range(3):
            mgr.save(
                step, state, per_rank={"rng": torch.randn(4)}, metadata={"loss": 1.5, "s": [1]}
            ).wait()
        for step in range(3):
            m = mgr.manifest(step)
            assert m.to_json() == _asdict_json(m)
            assert Manifest.from_json(m.to_json()) == m


def test_second_save_checks_no_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save of an unchanged layout encodes no tensor again and allocates no buffers."""
    from coci_core.engine.format import tree

    encoded: list[str] = []
    full = tree._Flattener._encode_tensor

    def counting(self: Any, t: torch.Tensor, key: str) -> Any:
        encoded.append(key)
        return full(self, t, key)

    monkeypatch.setattr(tree._Flattener, "_encode_tensor", counting)
    state = {"model": torch.nn.Linear(4, 4).state_dict(), "step": 0}
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        first = mgr.save(0, state).wait()
        assert len(encoded) == 2
        state["step"] = 1
        second = mgr.save(1, state).wait()
        assert len(encoded) == 2
        assert first.first_save and not second.first_save
        assert mgr.restore(step=1)["step"] == 1


def test_parameter_and_its_plain_view_are_one_leaf() -> None:
    """A parameter and a plain tensor of the same view of its memory: one leaf, as before,
    and a parameter where a plain tensor was (same memory) keeps the cached layout."""
    p = torch.nn.Parameter(torch.randn(3))
    cache = FlattenCache()
    first = flatten_state({"p": p, "v": p.detach()}, cache=cache)
    assert len(first.leaves) == 1
    again = flatten_state({"p": p.detach(), "v": p}, cache=cache)
    assert again.layout is first.layout and len(again.leaves) == 1


_DTENSOR_CHILD = """
import json, sys, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from coci_core import CheckpointManager, RankGroup
from coci_core.engine.format.tree import FlattenCache, flatten_state

dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
mesh = init_device_mesh("cpu", (1, 1))
a = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0), Shard(1)])
b = distribute_tensor(torch.ones(5), mesh, [Replicate(), Replicate()])
cache = FlattenCache()
first = flatten_state({"a": a, "b": b, "n": 1}, cache=cache)
again = flatten_state({"a": a, "b": b, "n": 2}, cache=cache)
out = {
    "hit": again.layout is first.layout
    and all(x is y for x, y in zip(again.leaves, first.leaves, strict=True)),
    "n": again.tree["v"]["n"],
}
moved = a.redistribute(mesh, [Replicate(), Shard(1)])  # other placements: a miss
missed = flatten_state({"a": moved, "b": b, "n": 1}, cache=cache)
out["placements_miss"] = missed.layout is not first.layout
before = flatten_state({"a": a, "b": b, "n": 1}, cache=cache)
other = distribute_tensor(torch.zeros(3, 4), mesh, [Shard(0), Shard(1)])  # other memory: a miss
missed = flatten_state({"a": other, "b": b, "n": 1}, cache=cache)
out["memory_miss"] = missed.layout is not before.layout and before.layout is not None
base = flatten_state({"a": a, "b": b, "n": 1}, cache=cache)
view = DTensor.from_local(a._local_tensor, mesh, [Shard(0), Shard(1)], run_check=False)
same = flatten_state({"a": view, "b": b, "n": 1}, cache=cache)  # same memory, new tensor objects
out["rebuilt"] = (
    same.layout is base.layout
    and same.leaves[0].tensor is not base.leaves[0].tensor
    and same.leaves[0].tensor.data_ptr() == a._local_tensor.data_ptr()
)
# a plain tensor over the replicated DTensor's memory, then replaced alone: b keeps its bytes
flatten_state({"p": b._local_tensor, "q": b}, cache=cache)
replaced = flatten_state({"p": torch.zeros(5), "q": b}, cache=cache)
out["tie_undone"] = [leaf.tensor.tolist() for leaf in replaced.leaves]
with CheckpointManager(tempfile.mkdtemp(), group=RankGroup.from_torch_distributed()) as mgr:
    mgr.save(1, {"a": a}).wait()
    a._local_tensor.add_(1.0)  # written in place between saves
    mgr.save(2, {"a": a}).wait()
    out["values"] = [mgr.restore(step)["a"].tolist() for step in (1, 2)]
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def test_dtensor_states_reuse_the_flatten_and_miss_on_any_change() -> None:
    """DTensors keep the cached flatten while their layout (local memory, placements, mesh)
    stays; any change is a miss; new DTensor objects over the same memory get new leaves; a
    plain tensor a DTensor ties to does not move alone."""
    result = run(script(_DTENSOR_CHILD, str(free_port())), timeout_s=120)
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[len("RESULT ") :])
    assert out["hit"] and out["n"] == 2
    assert out["placements_miss"] and out["memory_miss"] and out["rebuilt"]
    # a plain tensor that a replicated DTensor tied to (its fingerprint another's) moved
    # alone: before, the DTensor's node named the plain tensor's leaf, saved with its new bytes
    assert out["tie_undone"] == [[0.0] * 5, [1.0] * 5]
    first = torch.arange(12.0).reshape(3, 4)
    assert out["values"] == [first.tolist(), (first + 1).tolist()]


def test_a_leaf_made_anew_from_the_cache_keeps_every_other_field() -> None:
    """The replay's new leaf for a new tensor of the same layout is
    ``dataclasses.replace(leaf, tensor=..., moves=...)``, every field included."""
    from coci_core.engine.format import tree

    leaf = tree.ArrayLeaf("/k", torch.ones(2), "ndarray", "<f4", (4,), 8, (Region((0,), (2,)),))
    new = torch.zeros(2)
    made = tree._with_tensor(leaf, new, moves=True)
    expected = dataclasses.replace(leaf, tensor=new, moves=True)
    assert type(made) is tree.ArrayLeaf
    for f in dataclasses.fields(tree.ArrayLeaf):
        assert getattr(made, f.name) is getattr(expected, f.name), f.name
    assert vars(made).keys() == vars(expected).keys()
