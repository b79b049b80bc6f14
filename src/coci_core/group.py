"""Moved to :mod:`coci_core.engine.group`; the names documented here keep working."""

from coci_core.engine.group import JOIN_TIMEOUT_S, RankGroup

__all__ = ["JOIN_TIMEOUT_S", "RankGroup"]
