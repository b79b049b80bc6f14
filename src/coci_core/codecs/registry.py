"""The codec registry: every array codec, by the name stored with each piece it wrote.

A :class:`Codec` holds a name's decoder (restore finds it by the name in the manifest: a reader
is never told how a checkpoint was written) and its encoder (the writer finds it by the name
:func:`~coci_core.codecs.select.choose_codec` returns). The engine knows no codec by name: it
builds one :class:`EncodeArgs` per piece and asks the chosen codec's encoder, and restore asks
:func:`decode`. ``coci.raw/1`` (:data:`RAW`, the bytes as they are in memory) lives here; every
other built-in codec registers itself at the end of its module.

How to add a codec:

1. ``codecs/<new>.py``: ``encode_<new>(data, dtype, ...) -> Encoded`` (its ``params`` name the
   codec in ``"codec"`` and describe the piece completely: restore gets nothing else) and
   ``decode_<new>(stored, params, out, ...)`` (checks every parameter with ``codecs/_params.py``:
   a manifest is data from disk); at the end, ``register_codec(Codec(NAME, decode=...,
   encode=...))``, with ``needs`` (what of the previous save its encoder uses) and ``deltas``
   (its params carry ``"base"``) as they apply.
2. ``codecs/__init__.py``: import the module (that registers it) and export its functions.
3. ``codecs/select.py``: the rule in :func:`~coci_core.codecs.select.choose_codec` that picks it
   (or, outside coci, a ``select`` predicate on the :class:`Codec`).
4. ``tests/codecs/``: a round trip through :func:`decode`, damaged bytes and parameters raise
   :class:`~coci_core.errors.CorruptCheckpointError`, and one through ``CheckpointManager``
   (``tests/codecs/test_registry.py`` shows one).

A codec from another package is a :class:`Codec` object (with a ``select`` predicate if coci
should write it) named in that package's metadata, ``[project.entry-points."coci.codecs"]
<any name> = "module:CODEC"``: the registry loads the group (:data:`ENTRY_POINTS`) the first
time a writer chooses a codec or a reader meets a codec name it does not know, in any process
(the ``coci`` command included), so that its checkpoints restore and verify wherever the package
is installed.

A codec's name and parameters are the on-disk format: a new layout is a new name (``.../2``),
and the old name keeps its decoder so that old checkpoints restore.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Literal, TypeAlias

from coci_core.codecs._common import Buffer, Encoded, Params, QuantState, u8, writable_u8
from coci_core.codecs._params import p_bool, p_str
from coci_core.errors import ConfigError, CorruptCheckpointError

__all__ = [
    "ENTRY_POINTS",
    "RAW",
    "BaseAvailable",
    "Codec",
    "Decoder",
    "EncodeArgs",
    "Encoder",
    "LossyArgs",
    "Mode",
    "decode",
    "get_codec",
    "needs_base",
    "register_codec",
    "selected_codec",
    "stores_compressed",
    "unregister_codec",
]

RAW = "coci.raw/1"
#: The entry-point group of codecs other packages install: ``<name> = "module:CODEC"``.
ENTRY_POINTS = "coci.codecs"
logger = logging.getLogger(__name__)
Mode: TypeAlias = Literal["none", "lossless", "lossy", "auto"]
# What the writer has of a piece in the previous checkpoint (see ``choose_codec``).
BaseAvailable: TypeAlias = Literal["none", "hashes", "bytes", "reference"]


@dataclass(frozen=True)
class LossyArgs:
    """How a lossy codec quantizes this piece (see ``encode_quantized``)."""

    bits: int | Literal["auto"] = 8
    promote: int = 4
    target: float = 1e-3
    nonnegative: bool = False
    domain: Literal["linear", "log"] = "linear"


@dataclass(frozen=True)
class EncodeArgs:
    """What the writer knows of one piece when it encodes it; each encoder takes what it needs.

    ``base_step`` is the step of the last base when the writer holds anything of this piece
    there (``base``: its bytes, ``base_hashes``: its chunk hashes, ``reference``: the lossy
    chain's state), else None. ``compress``: whether bytes may be compressed (``"auto"`` when
    compressing does not pay: no).
    """

    dtype: str
    step: int
    level: int = 1
    base_step: int | None = None
    base: Buffer | None = None
    base_hashes: bytes | None = None
    reference: QuantState | None = None
    compress: bool = True
    lossy: LossyArgs = LossyArgs()


# (stored, params, out, base, threads): writes the piece into out
Decoder: TypeAlias = Callable[[Buffer, Params, Buffer, "Buffer | None", int], None]
# (data, args): the stored form (None: store the bytes as they are)
Encoder: TypeAlias = Callable[[memoryview, EncodeArgs], "Encoded | None"]
# (dtype, nbytes, mode, base): whether choose_codec picks this codec for the piece
Selector: TypeAlias = Callable[[str, int, Mode, BaseAvailable], bool]


def _always(params: Params) -> bool:
    return True


@dataclass(frozen=True)
class Codec:
    """One codec name, its decoder and (where coci still writes it) its encoder.

    Args:
        name: stored in each piece's ``params["codec"]``.
        decode: writes a stored piece into the preallocated output (raises
            CorruptCheckpointError on any malformed input).
        encode: the stored form of a piece; None: decoded only (an older layout, or one
            another codec's encoder writes).
        needs: what of the previous save the encoder uses (the writer then has it, or passes
            None and the encoder stores the piece whole); ``"reference"``: the encoder
            advances the lossy chain's state, which the writer commits once the save is durable.
        deltas: whether its parameters carry ``"base"`` (true: the piece is decoded against
            the same piece in step ``base_step``).
        compressed: whether a piece's bytes went through a compressor (given its params).
        select: for codecs registered from outside coci: whether ``choose_codec`` picks it for
            a piece (asked in registration order, before the built-in rules).
    """

    name: str
    decode: Decoder
    encode: Encoder | None = None
    needs: BaseAvailable = "none"
    deltas: bool = False
    compressed: Callable[[Params], bool] = _always
    select: Selector | None = None


_CODECS: dict[str, Codec] = {}
# whether the installed codecs (ENTRY_POINTS) were loaded in this process
_installed_loaded = False
_LOCK = threading.RLock()


def _load_installed() -> None:
    """Register the codecs installed packages declare (once per process)."""
    global _installed_loaded
    if _installed_loaded:
        return
    with _LOCK:
        if _installed_loaded:
            return
        _installed_loaded = True
        for entry in entry_points(group=ENTRY_POINTS):
            try:
                codec = entry.load()
                if not isinstance(codec, Codec):
                    raise ConfigError(f"{entry.value} is not a Codec: {codec!r}")
                if _CODECS.get(codec.name) is not codec:  # its module may register it too
                    register_codec(codec)
            except Exception as e:  # one broken package must not stop the other codecs
                logger.warning(
                    "the codec %r of entry point group %r (%s) cannot be loaded: %s: %s",
                    entry.name,
                    ENTRY_POINTS,
                    entry.value,
                    type(e).__name__,
                    e,
                )


def register_codec(codec: Codec) -> Codec:
    """Make ``codec`` known to writers and readers under its name (returned, for chaining).

    Raises:
        ConfigError: the name is taken, or not a name a manifest can hold.
    """
    name = codec.name
    # a manifest entry holds a codec name of at most 64 characters, or "mixed" for several
    if not isinstance(name, str) or not 0 < len(name) <= 64 or name == "mixed":
        raise ConfigError(f"a codec name is a string of 1 to 64 characters, not 'mixed': {name!r}")
    if name in _CODECS:
        raise ConfigError(f"codec {name!r} is already registered")
    _CODECS[name] = codec
    return codec


def unregister_codec(name: str) -> None:
    """Forget the codec ``name`` (pieces stored with it no longer restore)."""
    if _CODECS.pop(name, None) is None:
        raise ConfigError(f"no codec {name!r} is registered")


def get_codec(name: str) -> Codec:
    """The codec registered under ``name``.

    Raises:
        CorruptCheckpointError: no such codec (the name comes from a manifest or a choice).
    """
    codec = _CODECS.get(name)
    if codec is None:
        _load_installed()
        codec = _CODECS.get(name)
    if codec is None:
        raise CorruptCheckpointError(f"unknown array codec {name!r}")
    return codec


def selected_codec(dtype: str, nbytes: int, mode: Mode, base: BaseAvailable) -> str | None:
    """The first registered codec whose ``select`` picks this piece (None: none does)."""
    _load_installed()
    for codec in list(_CODECS.values()):
        if codec.select is not None and codec.select(dtype, nbytes, mode, base):
            return codec.name
    return None


def needs_base(params: Params) -> bool:
    """Whether decoding this piece needs the base checkpoint's decoded bytes of the same piece.

    Raises:
        CorruptCheckpointError: an unknown codec, or a malformed ``"base"``.
    """
    return get_codec(p_str(params, "codec")).deltas and p_bool(params, "base")


def stores_compressed(params: Params) -> bool:
    """Whether a piece's bytes went through a compressor (not only chunk selection)."""
    codec = _CODECS.get(str(params.get("codec")))
    if codec is None:
        _load_installed()
        codec = _CODECS.get(str(params.get("codec")))
    if codec is None:
        return params.get("codec") is not None
    return codec.compressed(params)


def decode(
    stored: Buffer,
    params: Params,
    out: Buffer,
    base: Buffer | None = None,
    *,
    threads: int = 1,
) -> None:
    """Write the piece described by ``params`` into the preallocated ``out``.

    ``base``: the same piece decoded from the base checkpoint, when :func:`needs_base` says so.
    Raises CorruptCheckpointError on any malformed input; never executes code from data.
    """
    codec = get_codec(p_str(params, "codec"))
    if not needs_base(params):
        base = None  # validates the "base" field, and a stray base is never consulted
    codec.decode(stored, params, out, base, threads)


def _decode_raw(
    stored: Buffer, params: Params, out: Buffer, base: Buffer | None, threads: int
) -> None:
    """Bytes as they are in memory: no transformation."""
    src, dst = u8(stored), writable_u8(out)
    if src.nbytes != dst.nbytes:
        raise CorruptCheckpointError(f"raw data has {src.nbytes} bytes, expected {dst.nbytes}")
    dst[:] = src


def _encode_raw(data: memoryview, args: EncodeArgs) -> None:
    return None


register_codec(Codec(RAW, _decode_raw, _encode_raw, compressed=lambda params: False))
