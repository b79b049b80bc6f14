"""Fixtures for the planner tests: the ResNet-like job of background.md §1."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from planner_helpers import RESNET, power_loss


@pytest.fixture
def resnet() -> dict[str, Any]:
    """A fresh copy of the ResNet-like job's costs."""
    return dict(RESNET)


@pytest.fixture
def noisy_observations() -> tuple[np.ndarray, np.ndarray]:
    """20k observed steps of the power-law curve with 10% multiplicative noise."""
    rng = np.random.default_rng(123)
    steps = np.arange(20_000, dtype=np.float64)
    return steps, power_loss(steps) * (1 + 0.1 * rng.standard_normal(steps.size))
