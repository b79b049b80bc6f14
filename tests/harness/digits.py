"""scikit-learn's digits (bundled: nothing is downloaded) and the small models trained on them,
shared by the tests and the benchmarks (``benchmarks`` imports them from here).

The bit-exactness tests and the published benchmark numbers depend on these exact models,
data and orders: change none of them."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def digits_images() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as (N, 1, 8, 8) float32 in [0, 1] and their int64 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(d.target, dtype=torch.int64)


def digits_flat(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` (default all 1797) digits as (n, 64) float32 in [0, 1] and their labels."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:n] / 16.0, dtype=torch.float32), torch.tensor(y[:n])


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`digits_flat` split into 1400 training and 397 test digits: x, y, test x, test y."""
    x, y = digits_flat()
    return x[:1400], y[:1400], x[1400:], y[1400:]


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


def small_cnn() -> torch.nn.Module:
    """The lossy-restore test's CNN on flat (N, 64) digits: two unpadded 3x3 convolutions and a
    linear layer (about 10 k parameters)."""
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)),
        torch.nn.Conv2d(1, 16, 3),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 10),
    )


def train_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    g: torch.Generator,
    steps: int,
    batch: int = 64,
) -> Iterator[int]:
    """Train on random batches of (x, y) drawn with ``g``, cross-entropy; yields each step
    (1..steps) after its optimizer step, for the caller to capture the state."""
    for step in range(1, steps + 1):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        yield step
