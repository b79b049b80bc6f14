"""Telemetry: save and restore events, sinks (JSON lines, TensorBoard), reports."""

from coci_core.telemetry.events import *  # noqa: F403
from coci_core.telemetry.events import __all__ as __all__
