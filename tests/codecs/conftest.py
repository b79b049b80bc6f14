from __future__ import annotations

import numpy as np
import pytest

from tests.codecs.helpers import digits_states


@pytest.fixture(scope="session")
def digits() -> dict[int, dict[str, np.ndarray]]:
    """The digits CNN's float32 state (weights, exp_avg, exp_avg_sq) after steps 10..40."""
    return digits_states([10, 11, 20, 30, 40])
