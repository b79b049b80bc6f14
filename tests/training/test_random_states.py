"""``check_random_states``, the one check of saved random states that the three adapters call
inside the restore: the process's own states pass, and each field forged at and beyond its
bounds is refused naming the generator, without touching the process's generators."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from coci_core.training import UnfitRandomState, check_random_states


def _states() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "cuda": [],
    }


def _set(name: str, i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of the ``i``-th item of the ``name`` state's tuple."""

    def edit(states: dict[str, Any]) -> None:
        items = list(states[name])
        items[i] = value
        states[name] = tuple(items)

    return edit


def _numpy(i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    return _set("numpy", i, value)


def _python(i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    return _set("python", i, value)


FORGED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "python-list": (lambda s: s.update(python=list(s["python"])), "Python"),
    "python-version": (_python(0, 2), "Python"),
    "python-short-internal": (_python(1, (1, 2, 3)), "Python"),
    "python-float-internal": (_python(1, (1.5,) * 625), "Python"),
    "python-gauss-str": (_python(2, "x"), "Python"),
    "numpy-name": (_numpy(0, "PCG64"), "NumPy"),
    "numpy-int64-keys": (_numpy(1, np.zeros(624, dtype=np.int64)), "NumPy"),
    "numpy-short-keys": (_numpy(1, np.zeros(623, dtype=np.uint32)), "NumPy"),
    "numpy-negative-pos": (_numpy(2, -1), "NumPy"),
    "numpy-huge-pos": (_numpy(2, 2**63), "NumPy"),
    "numpy-gauss-str": (_numpy(4, "0"), "NumPy"),
    "numpy-missing": (lambda s: s.update(numpy=None), "NumPy"),
    "torch-float": (lambda s: s.update(torch_cpu=torch.zeros(5056)), "torch"),
    "torch-short": (lambda s: s.update(torch_cpu=torch.zeros(7, dtype=torch.uint8)), "torch"),
    "torch-2d": (lambda s: s.update(torch_cpu=s["torch_cpu"].reshape(1, -1)), "torch"),
    "cuda-str": (lambda s: s.update(cuda="x"), "CUDA"),
    "cuda-floats": (lambda s: s.update(cuda=[torch.zeros(3)]), "CUDA"),
}


def test_the_process_own_states_pass_and_none_is_changed() -> None:
    before = _states()
    check_random_states(**before)
    check_random_states(**{**before, "numpy": None}, numpy_required=False)
    check_random_states(**{**before, "cuda": None})
    assert random.getstate() == before["python"]
    assert torch.equal(torch.get_rng_state(), before["torch_cpu"])


@pytest.mark.parametrize("forged", FORGED.values(), ids=FORGED.keys())
def test_each_forged_field_is_refused_naming_its_generator(
    forged: tuple[Callable[[dict[str, Any]], None], str],
) -> None:
    edit, named = forged
    states = _states()
    edit(states)
    with pytest.raises(UnfitRandomState, match=f"^{named} random state"):
        check_random_states(**states)
