"""Real checkpoint states for the codec benchmarks: the digits CNN of tests/harness/digits.py
trained with Adam.

Nothing is downloaded: scikit-learn bundles the digits. ``states(steps)`` trains once and
returns, for each requested step, every tensor of the model and the optimizer (weights,
``exp_avg``, ``exp_avg_sq``) as float32 numpy arrays keyed by name.
"""

from __future__ import annotations

import numpy as np
import torch
from tests.harness.digits import DigitsCNN, digits_images, train_steps


def _capture(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = p.detach().numpy().copy()
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out[f"optim.{name}.{k}"] = st[k].numpy().copy()
    return out


def states(
    steps: list[int], *, width: int = 32, batch: int = 64, lr: float = 1e-3, seed: int = 0
) -> dict[int, dict[str, np.ndarray]]:
    """Train until max(steps) and return the state after each step in ``steps``."""
    torch.manual_seed(seed)
    x, y = digits_images()
    model = DigitsCNN(width)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    wanted = set(steps)
    result: dict[int, dict[str, np.ndarray]] = {}
    if 0 in wanted:
        result[0] = _capture(model, opt)
    for step in train_steps(model, opt, x, y, g, max(steps), batch):
        if step in wanted:
            result[step] = _capture(model, opt)
    return result
