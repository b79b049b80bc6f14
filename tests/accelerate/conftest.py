"""Accelerate keeps global state: reset it around every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from accelerate.state import AcceleratorState


@pytest.fixture(autouse=True)
def _reset_accelerate_state() -> Iterator[None]:
    """Each test starts with a fresh AcceleratorState, as accelerate's own tests do."""
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)
