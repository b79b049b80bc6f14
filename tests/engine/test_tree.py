"""State trees: every dtype, odd shapes, aliases and non-tensor values survive a round trip."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager, UnsupportedValueError
from coci_core.engine.format.tree import flatten_state, unflatten_state
from coci_core.engine.format.tree_nodes import SUPPORTED_DTYPES as _SUPPORTED_DTYPES
from tests.harness.states import assert_same, tiny_model_state

ALL_DTYPES = sorted(_SUPPORTED_DTYPES.values(), key=str)


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _round_trip(tmp_path: Any, state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    with CheckpointManager(tmp_path / "ckpt", **kwargs) as mgr:
        mgr.save(7, state).wait()
        return mgr.restore()


def test_every_cpu_dtype_round_trips_bit_exact(tmp_path: Any) -> None:
    """Each dtype torch can copy on CPU comes back with the same bits, incl. NaN payloads."""
    state = {str(d): _random_tensor(d, (3, 5)) for d in ALL_DTYPES}
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-45], dtype=torch.float32)
    state["special_f32"] = special
    state["special_bf16"] = special.to(torch.bfloat16)
    state["special_f16"] = special.to(torch.float16)
    restored = _round_trip(tmp_path, state)
    assert_same(state, restored)
    assert torch.signbit(restored["special_f32"][3])


def test_odd_shapes_views_and_aliases(tmp_path: Any) -> None:
    """0-d, empty and non-contiguous tensors round-trip; aliased tensors come back aliased."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = torch.randn(3)
    state = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "empty_i64": torch.empty(2, 0, dtype=torch.int64),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "tied_a": shared,
        "tied_b": shared,
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    restored = _round_trip(tmp_path, state)
    for key in ("scalar", "empty", "empty_i64", "transposed", "strided", "tied_a"):
        assert_same(state[key].contiguous(), restored[key], key)
    assert restored["transposed"].shape == (6, 4)
    assert restored["tied_a"] is restored["tied_b"]
    assert torch.equal(restored["param"], torch.ones(2))
    flat = flatten_state(state)
    assert len(flat.leaves) == len(state) - 1  # the tied pair is stored once


def test_json_values_numpy_and_odd_keys(tmp_path: Any) -> None:
    """Python and numpy values, int and tuple keys, OrderedDict metadata all come back typed."""
    od: OrderedDict[str, Any] = OrderedDict(b=1, a=2)
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    state = {
        "ints": {0: "zero", 1: [1, 2, (3, None)], (2, "x"): True},
        "floats": [1.5, math.inf, -math.inf, -0.0],
        "nan": math.nan,
        "bytes": b"\x00\xffcoci",
        "numpy": np.arange(6, dtype=np.float64).reshape(2, 3),
        "numpy_rng": np.random.default_rng(3).bit_generator.state,
        "legacy_rng": np.random.RandomState(1).get_state(),
        "np_scalar": np.float32(2.5),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "ordered": od,
        "big_int": 2**80,
    }
    restored = _round_trip(tmp_path, state)
    assert_same(state, restored)
    assert restored["ordered"]._metadata == {"": {"version": 2}}
    rs = np.random.RandomState()
    rs.set_state(restored["legacy_rng"])
    assert rs.randint(1000) == np.random.RandomState(1).randint(1000)


def test_model_and_optimizer_load_back(tmp_path: Any) -> None:
    """A model's and Adam's state_dict load into fresh objects and match exactly."""
    state = tiny_model_state()
    restored = _round_trip(tmp_path, state)
    assert_same(state, restored)
    assert list(restored["optim"]["state"]) == [0, 1, 2, 3, 4, 5]
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
    )
    model.load_state_dict(restored["model"])
    assert_same(dict(model.state_dict()), dict(state["model"]))


class _Custom:
    pass


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (_Custom(), "_Custom"),
        (torch.randn(3, 3).to_sparse(), "sparse"),
        (np.array(["a", "b"]), "numpy dtype <U1"),
        ({1.5j: 1}, "dict key"),
        ({"a", "b"}, "set"),
    ],
)
def test_unsupported_values_are_refused_by_name(value: Any, what: str) -> None:
    """Values that would need pickle raise an error naming the key and the type."""
    with pytest.raises(UnsupportedValueError) as info:
        flatten_state({"outer": {"inner": value}})
    assert "/outer/inner" in str(info.value)
    assert what in str(info.value)


def test_torch_save_fallback_is_opt_in_and_loads_weights_only(tmp_path: Any) -> None:
    """With allow_torch_save, a sparse tensor is kept and loaded back with weights_only."""
    sparse = torch.randn(4, 4).to_sparse()
    restored = _round_trip(tmp_path, {"s": sparse, "d": torch.float16}, allow_torch_save=True)
    assert torch.equal(restored["s"].to_dense(), sparse.to_dense())


def test_tree_is_plain_json() -> None:
    """The tree that goes into the manifest is JSON without NaN or custom objects."""
    state = tiny_model_state() | {"nan": math.nan}
    flat = flatten_state(state)
    text = json.dumps(flat.tree, allow_nan=False)
    leaves = [leaf.tensor for leaf in flat.leaves]
    assert_same(unflatten_state(json.loads(text), leaves), state)


def test_lists_of_plain_values_are_stored_as_they_are_and_others_tagged(tmp_path: Any) -> None:
    """Lists of numbers (a planner's samples) are taken whole; a non-finite or non-plain
    element still gets its tag, and everything comes back equal."""
    state: dict[str, Any] = {
        "plain": [1, 2.5, -0.0, None, True, "s"],
        "chunks": [[1.0, 2.0], (3, 4.5)],
        "odd": [1.0, math.inf, np.float32(2.0), 2**70],
    }
    tree = flatten_state(state).tree["v"]
    assert tree["plain"] == {"t": "list", "v": [1, 2.5, -0.0, None, True, "s"]}
    assert tree["chunks"]["v"][1] == {"t": "tuple", "v": [3, 4.5]}
    odd = tree["odd"]["v"]
    assert odd[0] == 1.0 and odd[1] == {"t": "float", "v": "inf"} and odd[2]["t"] == "np"
    back = _round_trip(tmp_path, state)
    assert back["plain"] == state["plain"]
    assert back["chunks"] == state["chunks"]
    assert back["odd"][:2] == [1.0, math.inf] and back["odd"][3] == 2**70
