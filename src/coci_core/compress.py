"""Moved to :mod:`coci_core.engine.compress`; the names documented here keep working."""

from coci_core.engine.compress import CompressionPolicy

__all__ = ["CompressionPolicy"]
