"""Real checkpoint states for the codec benchmarks and tests: a small CNN on digits, Adam.

Nothing is downloaded: scikit-learn bundles the digits. ``states(steps)`` trains once and
returns, for each requested step, every tensor of the model and the optimizer (weights,
``exp_avg``, ``exp_avg_sq``) as float32 numpy arrays keyed by name.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits


class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions and two linear layers on 8x8 images (about 0.56 M parameters)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = torch.nn.Linear(2 * width * 64, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as (N, 1, 8, 8) float32 in [0, 1] and their labels."""
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(d.target, dtype=torch.int64)


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
    x, y = digits_tensors()
    model = DigitsCNN(width)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    wanted = set(steps)
    result: dict[int, dict[str, np.ndarray]] = {}
    if 0 in wanted:
        result[0] = _capture(model, opt)
    for step in range(1, max(steps) + 1):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in wanted:
            result[step] = _capture(model, opt)
    return result
