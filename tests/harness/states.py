"""Small states and comparisons shared by the tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def tiny_model_state(seed: int = 0) -> dict[str, Any]:
    """A model + Adam state after one step, with an int-keyed optimizer state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 3}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal structure, types and bits (NaN equals NaN) throughout."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        )
        assert torch.equal(_bytes(a), _bytes(b)), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype} != {b.dtype}"
        assert a.tobytes() == b.tobytes(), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: NaN lost"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def full_digest(state: Any) -> str:
    """A digest of a nested state's keys, values and full tensors (a DTensor gathered with
    ``full_tensor()``, a collective: every rank calls it alike)."""
    import hashlib

    h = hashlib.sha256()

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k], f"{key}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}/{i}")
        elif isinstance(value, torch.Tensor):
            full = value.full_tensor() if type(value).__name__ == "DTensor" else value
            h.update(key.encode())
            h.update(full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{key}={value!r}".encode())

    walk(state, "")
    return h.hexdigest()
