"""Codecs turn a leaf's raw bytes into stored bytes and back; each names itself in the manifest.

Restore rebuilds the codec from the descriptor stored with each tensor (``"coci.raw/1"``), so a
reader never needs to be told how a checkpoint was written.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from coci_core.errors import ConfigError, CorruptCheckpointError

__all__ = ["Codec", "RawCodec", "from_descriptor", "register"]


@runtime_checkable
class Codec(Protocol):
    """Called as: (writer thread) ``encode``; (reader) ``decode``; both on any rank."""

    def descriptor(self) -> str:
        """The versioned name stored in the manifest, e.g. ``"coci.raw/1"``."""
        ...

    def encode(self, data: memoryview) -> memoryview:
        """The stored bytes of ``data`` (may be ``data`` itself)."""
        ...

    def decode(self, stored: memoryview, out: memoryview) -> None:
        """Write the original bytes of ``stored`` into ``out``."""
        ...


class RawCodec:
    """Bytes as they are in memory: no transformation."""

    def descriptor(self) -> str:
        return "coci.raw/1"

    def encode(self, data: memoryview) -> memoryview:
        return data

    def decode(self, stored: memoryview, out: memoryview) -> None:
        if stored.nbytes != out.nbytes:
            raise CorruptCheckpointError(
                f"raw data has {stored.nbytes} bytes, expected {out.nbytes}"
            )
        out.cast("B")[:] = stored.cast("B")


_REGISTRY: dict[str, type[Codec]] = {"coci.raw/1": RawCodec}


def register(descriptor: str, codec: type[Codec], *, clobber: bool = False) -> None:
    """Make ``codec`` available to restore under ``descriptor``."""
    if descriptor in _REGISTRY and not clobber:
        raise ConfigError(f"codec {descriptor!r} is already registered; pass clobber=True")
    _REGISTRY[descriptor] = codec


def from_descriptor(descriptor: str) -> Codec:
    """The codec that wrote ``descriptor``."""
    try:
        return _REGISTRY[descriptor]()
    except KeyError:
        raise CorruptCheckpointError(
            f"unknown codec {descriptor!r}; known: {sorted(_REGISTRY)}"
        ) from None
