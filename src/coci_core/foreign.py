"""Moved to :mod:`coci_core.interop.foreign`; the names documented here keep working."""

from coci_core.interop.foreign import read_dcp, read_foreign

__all__ = ["read_dcp", "read_foreign"]
