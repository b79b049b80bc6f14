"""A save of a cached layout checks every tensor's layout over all tensors at once (their
addresses, then one guard of their types, dtypes, devices, shapes, strides and lazy bits) and
replays dicts of tensors whole: any change a per-tensor check saw is still seen, with or
without the guard, and a tensor whose storage was freed in place is refused, never read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.format import tree
from coci_core.engine.format.tree import FlattenCache, flatten_state
from coci_core.errors import UnsupportedValueError
from tests.harness.processes import run, script


@pytest.fixture(params=["guard", "no-guard"])
def guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with torch's guard and without it (a torch that has none)."""
    if request.param == "no-guard":
        monkeypatch.setattr(tree, "_TensorGuards", None)
    return str(request.param)


def _flat_json(flat: Any) -> str:
    return json.dumps([flat.tree, [(leaf.key, leaf.kind) for leaf in flat.leaves]])


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


def _state() -> dict[str, Any]:
    c = torch.randn(3, dtype=torch.complex64)
    return {
        "m": {"w": torch.randn(3, 4), "p": torch.nn.Parameter(torch.randn(6)), "c": c},
        "n": [torch.randn(2, 5), c.imag],
        "lr": 0.1,
    }


def _transpose(s: dict[str, Any]) -> None:
    s["m"]["w"].t_()  # the same object, other shape and strides


def _retype(s: dict[str, Any]) -> None:
    p = s["m"]["p"].requires_grad_(False)
    p.data = p.data.view(torch.int32)  # the same object and address, another dtype


def _resize(s: dict[str, Any]) -> None:
    s["n"][0].resize_(5)  # the same object and address, another shape


def _conj(s: dict[str, Any]) -> None:
    s["m"]["c"] = s["m"]["c"].conj()  # the same bytes, read conjugated


def _neg(s: dict[str, Any]) -> None:
    s["n"][1] = s["m"]["c"].conj().imag  # the same bytes, read negated


def _numpy(s: dict[str, Any]) -> None:
    s["m"]["w"] = s["m"]["w"].numpy()  # a numpy array where a tensor was


def _value(s: dict[str, Any]) -> None:
    s["m"]["w"] = 1.5  # a plain value where a tensor was


def _renamed(s: dict[str, Any]) -> None:
    s["m"]["v"] = s["m"].pop("w")


def _moved(s: dict[str, Any]) -> None:
    s["m"]["w"] = s["m"]["w"].clone()  # the same layout elsewhere: a leaf made anew


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "transpose": _transpose,
    "dtype": _retype,
    "shape": _resize,
    "conj": _conj,
    "neg": _neg,
    "numpy": _numpy,
    "value": _value,
    "renamed": _renamed,
    "moved": _moved,
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_of_layout_is_seen(change: str, guard: str) -> None:
    """Every change of a tensor's layout, in place or by another object, in a dict of tensors
    replayed whole or in a list, gives what a full flatten gives."""
    state = _state()
    cache = FlattenCache()
    flatten_state(state, cache=cache)
    flatten_state(state, cache=cache)
    CHANGES[change](state)
    again = flatten_state(state, cache=cache)
    full = flatten_state(state)
    assert _flat_json(again) == _flat_json(full)
    assert [_layout(leaf.tensor) for leaf in again.leaves] == [
        _layout(leaf.tensor) for leaf in full.leaves
    ]


def test_requires_grad_turned_off_keeps_the_layout(guard: str) -> None:
    """A parameter frozen between saves (the guard no longer holds; its layout is the same):
    the cached flatten, its layout token kept, and later saves hit again."""
    state = _state()
    cache = FlattenCache()
    first = flatten_state(state, cache=cache)
    state["m"]["p"].requires_grad_(False)
    for _ in range(2):
        again = flatten_state(state, cache=cache)
        assert again.layout is first.layout
        assert _flat_json(again) == _flat_json(flatten_state(state))


def test_a_dict_of_tensors_with_a_str_subclass_key_is_refused_as_before() -> None:
    """A key of a str subclass equal to the cached key is not replayed: refused, as a full
    flatten refuses it."""

    class Name(str):
        pass

    cache = FlattenCache()
    a, b = torch.randn(2), torch.randn(3)
    flatten_state({"m": {"a": a, "b": b}}, cache=cache)
    with pytest.raises(UnsupportedValueError, match="dict key"):
        flatten_state({"m": {Name("a"): a, "b": b}}, cache=cache)


def test_random_states_in_a_dict_of_tensors_move(guard: str) -> None:
    """A new tensor at each save in a dict of tensors (a random state) hits the cache, with a
    leaf of the current tensor."""
    w = torch.randn(3)
    cache = FlattenCache()
    for _ in range(3):
        state = {"s": {"w": w, "rng": torch.get_rng_state(), "n": np.zeros(2)}}
        torch.rand(1)
        flat = flatten_state(state, cache=cache)
        assert _flat_json(flat) == _flat_json(flatten_state(state))
        assert torch.equal(flat.leaves[1].tensor, state["s"]["rng"])


_FREED_CHILD = r"""
import json, sys, tempfile
import torch
from coci_core import CheckpointManager
from coci_core.errors import UnsupportedValueError

out = {}
small, large = torch.randn(100), torch.randn(300_000)
state = {"ts": {f"t{i}": torch.randn(50) for i in range(20)}, "small": small, "large": large}
with CheckpointManager(tempfile.mkdtemp(), keep_last=None) as mgr:
    step = 0
    for name, t in (("small", small), ("large", large)):
        for _ in range(3):  # from the second save on, small tensors are copied by runs
            step += 1
            mgr.save(step, state).wait()
        t.untyped_storage().resize_(0)  # freed in place, as parameter offloading does
        try:
            mgr.save(step + 1, state).wait()
            out[name] = "saved"
        except UnsupportedValueError as e:
            out[name] = str(e)
        t.untyped_storage().resize_(t.numel() * 4)
        t.fill_(7.0)
        step += 2
        mgr.save(step, state).wait()
        out[name + "_back"] = bool(torch.equal(mgr.restore(step=step)[name], t))
    fresh = torch.randn(10)
    fresh.untyped_storage().resize_(0)
    try:
        mgr.save(step + 1, {"fresh": fresh})
        out["first"] = "saved"
    except UnsupportedValueError as e:
        out["first"] = str(e)
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_tensor_whose_storage_was_freed_in_place_is_refused() -> None:
    """A tensor whose storage was freed in place (``untyped_storage().resize_(0)``) between
    saves, small or large, or before a first save: the save is refused naming it (before,
    the copy read the freed memory: the process crashed); once its storage holds its bytes
    again, the next save stores them."""
    result = run(script(_FREED_CHILD), timeout_s=120)
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[len("RESULT ") :])
    assert "'/small'" in out["small"] and "freed" in out["small"]
    assert "'/large'" in out["large"] and "freed" in out["large"]
    assert "'/fresh'" in out["first"]
    assert out["small_back"] and out["large_back"]


def test_the_guard_is_used_where_torch_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch's guard, a replay of an unchanged layout reads no fingerprint per tensor."""
    if tree._TensorGuards is None:
        pytest.skip("this torch has no TensorGuards")
    state = _state()
    cache = FlattenCache()
    flatten_state(state, cache=cache)
    calls: list[Any] = []
    real = tree._fingerprint
    monkeypatch.setattr(tree, "_fingerprint", lambda t: calls.append(t) or real(t))
    monkeypatch.setattr(tree, "_layouts", lambda ts: calls.append(ts) or [])
    flat = flatten_state(state, cache=cache)
    assert flat.layout is cache.layout and calls == []


def test_only_a_save_that_copies_in_the_background_reads_version_counters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``block=True`` copies every tensor before ``save()`` returns: nothing to check later,
    so no version counter is read; ``block=False`` reads them (its check needs them)."""
    from coci_core.engine.save import snapshot

    reads: list[int] = []
    real = snapshot._versions
    monkeypatch.setattr(snapshot, "_versions", lambda leaves: reads.append(1) or real(leaves))
    state = {"w": torch.randn(1000), "b": torch.randn(3)}
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, state, block=True).wait()
        assert reads == []
        mgr.save(2, state, block=False).wait()
        assert reads == [1]
        assert torch.equal(mgr.restore(step=2)["w"], state["w"])


def _optimizer_state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _state_key_added(s: dict[str, Any]) -> None:
    s["optim"]["state"][0]["extra"] = torch.zeros(1)


def _state_key_dropped(s: dict[str, Any]) -> None:
    del s["optim"]["state"][1]["exp_avg"]


def _bool_key(s: dict[str, Any]) -> None:
    states = s["optim"]["state"]
    states[True] = states.pop(1)  # equal to 1, stored as another key


def _float_value(s: dict[str, Any]) -> None:
    s["optim"]["state"][2]["step"] = 1.0


def _param_dropped(s: dict[str, Any]) -> None:
    del s["optim"]["state"][3]


def _inner_moved(s: dict[str, Any]) -> None:
    inner = s["optim"]["state"][0]
    inner["exp_avg"] = inner["exp_avg"].clone()


OPTIMIZER_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "none": lambda s: None,
    "key-added": _state_key_added,
    "key-dropped": _state_key_dropped,
    "bool-key": _bool_key,
    "float-value": _float_value,
    "param-dropped": _param_dropped,
    "moved": _inner_moved,
}


@pytest.mark.parametrize("change", OPTIMIZER_CHANGES)
def test_an_optimizer_state_replayed_whole_sees_every_change(change: str, guard: str) -> None:
    """An optimizer's state (dicts of tensors under int keys) is replayed whole while its keys
    stay; any change of a key, a value or a tensor gives what a full flatten gives."""
    state = _optimizer_state()
    cache = FlattenCache()
    first = flatten_state(state, cache=cache)
    OPTIMIZER_CHANGES[change](state)
    again = flatten_state(state, cache=cache)
    full = flatten_state(state)
    assert _flat_json(again) == _flat_json(full)
    assert [_layout(leaf.tensor) for leaf in again.leaves] == [
        _layout(leaf.tensor) for leaf in full.leaves
    ]
    if change == "none":
        assert again.layout is first.layout
        assert (
            again.tree["v"]["optim"]["v"]["state"]["items"]
            is (first.tree["v"]["optim"]["v"]["state"]["items"])
        )
