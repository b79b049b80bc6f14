"""Reading a codec's parameters: a manifest is data from disk, so every field is checked
(a missing or mistyped one is a CorruptCheckpointError), and the checks every decoder makes of
its output and its base."""

from __future__ import annotations

from typing import Any

from coci_core.codecs._common import JSON, U8, Buffer, Params, u8, xxh128
from coci_core.errors import CorruptCheckpointError

__all__ = [
    "base_fields",
    "check_base",
    "check_codec",
    "check_out",
    "check_result",
    "p_bool",
    "p_dict",
    "p_float",
    "p_get",
    "p_int",
    "p_str",
]


def p_get(params: Params, key: str) -> JSON:
    try:
        return params[key]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"codec parameters lack {key!r}") from None


def p_int(params: Params, key: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    v = p_get(params, key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise CorruptCheckpointError(f"codec parameter {key!r}={v!r} is not an int in [{lo}, {hi}]")
    return v


def _p_typed(params: Params, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Parameter ``key`` if it is a ``kind`` (a bool only where ``kind`` is bool), else
    CorruptCheckpointError: it is not ``what``."""
    v = p_get(params, key)
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise CorruptCheckpointError(f"codec parameter {key!r}={v!r} is not {what}")
    return v


def p_bool(params: Params, key: str) -> bool:
    return bool(_p_typed(params, key, bool, "a bool"))


def p_str(params: Params, key: str) -> str:
    return str(_p_typed(params, key, str, "a string"))


def p_float(params: Params, key: str) -> float:
    return float(_p_typed(params, key, (int, float), "a number"))


def p_dict(params: Params, key: str) -> Params:
    v = p_get(params, key)
    if not isinstance(v, dict):
        raise CorruptCheckpointError(f"codec parameter {key!r} is not an object")
    return v


def check_codec(params: Params, name: str) -> None:
    got = p_str(params, "codec")
    if got != name:
        raise CorruptCheckpointError(f"parameters are for codec {got!r}, not {name!r}")


def check_out(params: Params, out: U8) -> int:
    n = p_int(params, "nbytes")
    if out.nbytes != n:
        raise CorruptCheckpointError(f"output buffer has {out.nbytes} bytes, codec wrote {n}")
    return n


def check_base(params: Params, base: Buffer | None, n: int) -> U8:
    """The base as uint8, after checking its size and its recorded hash."""
    if base is None:
        raise CorruptCheckpointError(
            "this piece is a delta: its base checkpoint's bytes are needed"
        )
    b = u8(base)
    if b.nbytes != n:
        raise CorruptCheckpointError(f"base has {b.nbytes} bytes, the delta expects {n}")
    want = p_str(params, "base_xxh3")
    if xxh128(b) != want:
        raise CorruptCheckpointError("base bytes do not match the hash recorded with the delta")
    return b


def check_result(params: Params, out: U8) -> None:
    """End-to-end check: the decoded bytes hash to what the encoder recorded."""
    if xxh128(out) != p_str(params, "xxh3"):
        raise CorruptCheckpointError("decoded piece does not match its recorded hash")


def base_fields(base_step: int | None) -> Params:
    out: Params = {"base": True}
    if base_step is not None:
        out["base_step"] = int(base_step)
    return out
