"""Helpers shared by the planner tests (a uniquely named module, not conftest)."""

from __future__ import annotations

from typing import Any

import numpy as np

RESNET: dict[str, Any] = {
    "total_steps": 50_000,
    "step_time_s": 0.3,
    "stall_s": 0.5,
    "persist_s": 2.0,
    "restart_s": 60.0,
    "mtbf_s": 8 * 3600.0,
}


def power_loss(k: Any) -> Any:
    """The ResNet-like power-law loss curve."""
    return 1.5 + 5.4 * (1 + np.asarray(k, dtype=np.float64) / 3000) ** -0.5


def noisy_run(total: int, seed: int, noise: float = 0.1) -> np.ndarray:
    """Losses of one noisy run of the power-law curve (index = step)."""
    rng = np.random.default_rng(seed)
    return power_loss(np.arange(total)) * (1 + noise * rng.standard_normal(total))
