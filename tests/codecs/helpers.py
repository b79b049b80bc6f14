"""Arrays for the codec tests: special float values, real digits-CNN states."""

from __future__ import annotations

import numpy as np
import torch

from tests.harness.digits import digits_images, train_steps

FLOATS = ["float16", "bfloat16", "float32", "float64"]

# NaN payloads (quiet, signalling, negative) and other special bit patterns, per dtype.
_SPECIAL_BITS: dict[str, list[int]] = {
    "float16": [0x7E00, 0x7E01, 0xFC01, 0x7C01, 0x7DFF, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x03FF],
    "bfloat16": [0x7FC0, 0x7FC1, 0xFF81, 0x7F81, 0x7FFF, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x007F],
    "float32": [
        0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0x7FBFFFFF,
        0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x007FFFFF,
    ],
    "float64": [
        0x7FF8000000000000, 0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001,
        0x7FF0000000000000, 0xFFF0000000000000, 0x8000000000000000, 0x0000000000000001,
        0x000FFFFFFFFFFFFF,
    ],
}  # fmt: skip
_UINT = {2: "<u2", 4: "<u4", 8: "<u8"}


def itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def float_bytes(dtype: str, n: int, seed: int = 0, special: bool = True) -> np.ndarray:
    """``n`` values of ``dtype`` as uint8: normal values, with the special patterns mixed in."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 0.05).to(getattr(torch, dtype))
    raw = t.view(torch.uint8).numpy().copy()
    if special and n:
        bits = np.array(_SPECIAL_BITS[dtype], dtype=_UINT[itemsize(dtype)])
        view = raw.view(_UINT[itemsize(dtype)])
        rng = np.random.default_rng(seed)
        where = rng.choice(n, size=min(n, 3 * bits.size), replace=n < 3 * bits.size)
        view[where] = np.resize(bits, where.size)
    return raw


def as_float64(raw: np.ndarray, dtype: str) -> np.ndarray:
    """The values of ``raw`` (bytes of ``dtype``) as float64, via torch."""
    if raw.size == 0:
        return np.zeros(0)
    t = torch.frombuffer(bytearray(raw.tobytes()), dtype=getattr(torch, dtype))
    return t.to(torch.float64).numpy()


States = dict[int, dict[str, np.ndarray]]


def digits_states(steps: list[int], width: int = 8, seed: int = 0) -> States:
    """A small CNN on scikit-learn's digits trained with Adam; float32 state after each step."""
    torch.manual_seed(seed)
    x, y = digits_images()
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, width, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(width, 2 * width, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(2 * width * 64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    out: dict[int, dict[str, np.ndarray]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: threads only add contention
    try:
        _train(model, opt, x, y, g, steps, out)
    finally:
        torch.set_num_threads(threads)
    return out


def _train(model, opt, x, y, g, steps, out) -> None:  # type: ignore[no-untyped-def]
    for step in train_steps(model, opt, x, y, g, max(steps)):
        if step in steps:
            snap = {}
            for name, p in model.named_parameters():
                snap[f"model.{name}"] = p.detach().numpy().copy()
                for k in ("exp_avg", "exp_avg_sq"):
                    snap[f"optim.{name}.{k}"] = opt.state[p][k].numpy().copy()
            out[step] = snap
