"""Moved to :mod:`coci_core.engine.restore`; the names documented here keep working."""

from coci_core.engine.restore import load_checkpoint

__all__ = ["load_checkpoint"]
