"""Argument checks shared by the planner and the HPO integrations (ConfigError on failure)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from coci_core.errors import ConfigError

__all__ = ["check_int", "check_optional_positive", "check_positive", "check_nonnegative"]


def _shown(value: Any) -> str:
    """``repr(value)`` for a message, short (an integer of thousands of digits has no repr)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    return f"{value!r:.100}"


def _as_float(name: str, value: Any) -> float:
    # Numbers only: a string such as "0.05" would pass a float() check here and then be kept
    # as the string by the caller, failing in every later re-plan.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name!r} must be a number: {_shown(value)}")
    try:
        result = float(value)
    except (OverflowError, ValueError):
        raise ConfigError(f"{name!r} must be finite: {_shown(value)}") from None
    if not math.isfinite(result):
        raise ConfigError(f"{name!r} must be finite: {_shown(value)}")
    return result


def check_positive(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ConfigError unless it is finite and > 0."""
    result = _as_float(name, value)
    if result <= 0:
        raise ConfigError(f"{name!r} must be > 0: {_shown(value)}")
    return result


def check_nonnegative(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ConfigError unless it is finite and >= 0."""
    result = _as_float(name, value)
    if result < 0:
        raise ConfigError(f"{name!r} must be >= 0: {_shown(value)}")
    return result


def check_optional_positive(name: str, value: Any) -> float | None:
    """Like :func:`check_positive`, but let None through."""
    return None if value is None else check_positive(name, value)


def check_int(name: str, value: Any, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` as an int, or raise ConfigError unless it is an integer >= minimum
    (and <= ``maximum`` when given)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name!r} must be an integer: {_shown(value)}")
    try:
        as_int = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name!r} must be an integer: {_shown(value)}") from None
    if as_int != value:
        raise ConfigError(f"{name!r} must be an integer: {_shown(value)}")
    if as_int < minimum:
        raise ConfigError(f"{name!r} must be >= {minimum}: {_shown(value)}")
    if maximum is not None and as_int > maximum:
        raise ConfigError(f"{name!r} must be in [{minimum}, {maximum}]: {_shown(value)}")
    return as_int
