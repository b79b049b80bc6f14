"""Which codec each piece of a save gets, and the memory of earlier saves that deltas need.

Runs on the writer thread only. Every ``full_every`` saves (and after any failure) a save is a
*base*: every piece stored on its own (zstd, or raw). Between bases, pieces are deltas against
the base: the XOR of their bytes (``"lossless"``), a quantized delta against the previous
reconstruction (``"lossy"``, at most ``max_lossy_generations`` in a row), or, under ``"auto"``
when compressing does not pay, only the chunks whose hash changed. Each piece describes itself
(its ``params`` in the manifest), so restore needs no configuration.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from coci_core.codecs import (
    EncodeArgs,
    Encoded,
    LossyArgs,
    QuantState,
    choose_codec,
    chunk_hashes,
    compression_pays,
    decode_lossless,
    encode_lossless,
    get_codec,
)
from coci_core.codecs.select import MODES
from coci_core.errors import ConfigError
from coci_core.knobs import AUTO_MIN_BYTES, PROBE_BYTES

__all__ = ["MODES", "CompressionPolicy", "PieceEncoder", "check_policy"]

OUTLIERS = 4
MAX_LOSSY_GENERATIONS = 63
_OPTIMIZER_CHOICES = ("log_second_moment", "first_moment", "quantized", "lossless")
_FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class CompressionPolicy:
    """How a manager compresses (see docs/compression.md).

    Args:
        mode: ``"none"``, ``"lossless"``, ``"lossy"`` (opt-in, bounded error) or ``"auto"``
            (compress only where it shortens the time to durable without slowing a
            restore).
        full_every: a base (no delta) every this many saves.
        max_lossy_generations: lossy deltas in a row before a lossless base is forced.
        lossy_bits: 8 (default), 4, 2 or ``"auto"`` (per tensor, the fewest bits whose
            relative error of the delta stays under ``lossy_target``; it quantizes each delta
            once per candidate, so it encodes several times slower).
        lossy_target: the relative error ``"auto"`` bits aim for.
        lossy_optimizer: for Adam's moments: ``"log_second_moment"`` (default: ``exp_avg``
            quantized, ``exp_avg_sq`` quantized in the log domain, ``coci.qdelta-log/1``: a
            bounded relative error, positive values stay positive, zeros stay zero),
            ``"first_moment"`` (``exp_avg`` quantized, ``exp_avg_sq`` lossless),
            ``"quantized"`` (both linear: a positive second moment reconstructed as 0 makes
            Adam's next step ``m / (sqrt(v) + eps)`` explode) or ``"lossless"`` (both).
        lossy_outliers: values per block of 256 of a linear quantized delta stored apart (as
            float16 multiples of the block's scale); None: 4.
        level: the zstd level.
        auto_min_bytes: ``"auto"`` never compresses a run whose saves write fewer bytes than
            this (default 16 MiB): their time is the storage's latency (open, fsync, rename),
            which compression does not shorten.
    """

    mode: str = "auto"
    full_every: int = 8
    max_lossy_generations: int = 8
    lossy_bits: int | str = 8
    lossy_target: float = 1e-3
    lossy_optimizer: str = "log_second_moment"
    lossy_outliers: int | None = None
    level: int = 1
    auto_min_bytes: int = AUTO_MIN_BYTES

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"'compression' must be one of {MODES}: {self.mode!r}")
        if type(self.auto_min_bytes) is not int or self.auto_min_bytes < 0:
            raise ConfigError(f"'auto_min_bytes' must be an integer >= 0: {self.auto_min_bytes!r}")
        for name in ("full_every", "max_lossy_generations"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"'{name}' must be an integer >= 1: {value!r}")
        if self.max_lossy_generations > MAX_LOSSY_GENERATIONS:
            # restore refuses delta chains deeper than 64 steps: save must not write them
            raise ConfigError(
                f"'max_lossy_generations' must be at most {MAX_LOSSY_GENERATIONS}: "
                f"{self.max_lossy_generations!r}"
            )
        bits = self.lossy_bits
        if not (bits == "auto" and type(bits) is str) and not (
            type(bits) is int and bits in (8, 4, 2)
        ):
            raise ConfigError(f"'lossy_bits' must be 8, 4, 2 or 'auto': {self.lossy_bits!r}")
        target = self.lossy_target
        if isinstance(target, bool) or not isinstance(target, numbers.Real) or not 0 < target < 1:
            raise ConfigError(f"'lossy_target' must be in (0, 1): {self.lossy_target!r}")
        if self.lossy_optimizer not in _OPTIMIZER_CHOICES:
            raise ConfigError(
                f"'lossy_optimizer' must be one of {_OPTIMIZER_CHOICES}: {self.lossy_optimizer!r}"
            )
        if self.lossy_outliers is not None and (
            type(self.lossy_outliers) is not int or not 0 <= self.lossy_outliers <= 64
        ):
            raise ConfigError(
                f"'lossy_outliers' must be None or an integer in [0, 64]: {self.lossy_outliers!r}"
            )
        if type(self.level) is not int or not -7 <= self.level <= 22:
            raise ConfigError(f"'level' must be an integer in [-7, 22]: {self.level!r}")


def check_policy(
    compression: str | CompressionPolicy | None, options: Mapping[str, Any] | None = None
) -> CompressionPolicy:
    """A policy from a mode name (plus its knobs, ``options``) or a policy object.

    Raises:
        ConfigError: a bad mode or knob, or knobs given beside a policy object.
    """
    if isinstance(compression, CompressionPolicy):
        if options:
            raise ConfigError(
                "'compression_options' go with a mode name; a CompressionPolicy carries its "
                f"own: give CompressionPolicy({', '.join(f'{k}=...' for k in options)}) instead"
            )
        return compression
    if compression is not None and not isinstance(compression, str):
        raise ConfigError(
            f"'compression' must be one of {MODES} or a CompressionPolicy: {compression!r}"
        )
    if options is not None and not (
        isinstance(options, Mapping) and all(isinstance(k, str) for k in options)
    ):
        raise ConfigError(
            f"'compression_options' must be a dict of CompressionPolicy knobs or None: {options!r}"
        )
    unknown = sorted(set(options or {}) - _KNOBS)
    if unknown:
        raise ConfigError(
            f"'compression_options' has knobs CompressionPolicy does not take: {unknown} "
            f"(it takes {', '.join(sorted(_KNOBS))})"
        )
    return CompressionPolicy(mode=compression or "none", **dict(options or {}))


_KNOBS = frozenset(f.name for f in dataclasses.fields(CompressionPolicy)) - {"mode"}


@dataclass
class _Memory:
    """What the writer keeps of one piece of the last base (and the lossy chain)."""

    base: np.ndarray[Any, Any] | None = None
    hashes: bytes | None = None
    quant: QuantState | None = None


@dataclass
class _Pending:
    full: bool
    step: int
    updates: dict[tuple[Any, ...], _Memory] = field(default_factory=dict)
    quantized: list[QuantState] = field(default_factory=list)


class PieceEncoder:
    """Encodes one save's pieces; :meth:`finish` after the save committed (or failed).

    Deltas need the base in memory: under ``"lossless"``, ``"lossy"`` and a paying ``"auto"``
    the writer keeps one host copy of this rank's share of the last base (or of the last lossy
    reconstruction); otherwise only 16 bytes of hash per 64 KiB chunk.
    """

    def __init__(self, policy: CompressionPolicy) -> None:
        self.policy = policy
        self._memory: dict[tuple[Any, ...], _Memory] = {}
        self._base_step: int | None = None
        self._since_base = 0
        self._lossy_generation = 0
        self._pending: _Pending | None = None
        self._pays: bool | None = None
        self.write_mbps: float | None = None
        self._write_sample_bytes = 0
        self.last_ratio: float | None = None

    @property
    def active(self) -> bool:
        """Whether saves may store anything but raw bytes."""
        return self.policy.mode != "none"

    @property
    def writes_raw(self) -> bool:
        """After :meth:`begin`: whether this save is written raw from the arena (``"auto"``
        where compressing does not pay: as fast as ``"none"``, no deltas)."""
        return self.policy.mode == "none" or (self.policy.mode == "auto" and not self._pays)

    def begin(self, step: int, probe: Callable[[], list[tuple[memoryview, str]]]) -> None:
        """Decide whether this save is a base. ``probe()`` gives (bytes, dtype) samples of the
        save for "auto" to measure; it is called only when "auto" decides (it waits for the
        copy, which a raw save does not)."""
        p = self.policy
        full = (
            self._base_step is None
            # A delta must name an earlier step: a save at or below the base (a rollback, a
            # counter that restarted) is a base itself.
            or step <= self._base_step
            or self._since_base >= p.full_every
            or (p.mode == "lossy" and self._lossy_generation >= p.max_lossy_generations)
        )
        if p.mode == "auto" and (full or self._pays is None):
            self._pays = self._compression_pays(probe)
            full = full or bool(self._pays)  # a delta needs a base that kept its bytes
        self._pending = _Pending(full=full, step=step)

    def _compression_pays(self, probe: Callable[[], list[tuple[memoryview, str]]]) -> bool | None:
        if self.write_mbps is None:
            return None  # nothing measured yet: this save writes raw, measures, and decides next
        if self._write_sample_bytes < self.policy.auto_min_bytes:
            # A small save's time is the storage's latency (open, fsync, rename), which
            # compression does not shorten; its bytes/second say nothing about bandwidth.
            return False
        samples = probe()
        raw = stored = 0
        encoded: list[tuple[Encoded, int]] = []
        started = time.perf_counter()
        for data, dtype in samples:
            data = data[:PROBE_BYTES]
            enc = encode_lossless(data, dtype, level=self.policy.level)
            encoded.append((enc, data.nbytes))
            raw += data.nbytes
            stored += enc.nbytes
            if raw >= PROBE_BYTES:
                break
        seconds = time.perf_counter() - started
        if raw == 0 or seconds <= 0:
            return None
        out = np.empty(max(n for _, n in encoded), dtype=np.uint8)
        started = time.perf_counter()
        for enc, n in encoded:  # what a restore of these pieces would decode
            decode_lossless(enc.data, enc.params, out[:n])
        decode_s = time.perf_counter() - started
        return compression_pays(
            encode_mbps=raw / seconds / 1e6,
            ratio=raw / max(1, stored),
            write_mbps=self.write_mbps,
            pipelined=True,  # the writer encodes the next piece while it writes this one
            decode_mbps=raw / decode_s / 1e6 if decode_s > 0 else None,
            deltas=self.policy.full_every > 1,  # between bases, a restore decodes a delta too
        )

    def encode(
        self, piece: tuple[Any, ...], data: memoryview, dtype: str, key: str
    ) -> Encoded | None:
        """The stored form of one piece (None: store it raw, as it is)."""
        pending = self._pending
        if pending is None:
            raise ConfigError("PieceEncoder.begin() must come first")
        p = self.policy
        memory = None if pending.full else self._memory.get(piece)
        base: Literal["none", "hashes", "bytes", "reference"] = "none"
        if memory is not None:
            if memory.quant is not None and memory.quant.ref is not None:
                base = "reference"
            elif memory.base is not None:
                base = "bytes"
            elif memory.hashes is not None:
                base = "hashes"
        second_moment = "exp_avg_sq" in key  # also AMSGrad's max_exp_avg_sq
        lossy_key = "exp_avg" not in key or (
            p.lossy_optimizer in ("quantized", "log_second_moment")
            or (p.lossy_optimizer == "first_moment" and not second_moment)
        )
        log_domain = second_moment and p.lossy_optimizer == "log_second_moment"
        mode: Any = p.mode if (p.mode != "lossy" or lossy_key) else "lossless"
        name = choose_codec(dtype, data.nbytes, mode, base=base, compress_pays=bool(self._pays))
        codec = get_codec(name)
        if codec.encode is None:
            raise ConfigError(f"codec {name!r} only decodes")
        args = EncodeArgs(
            dtype,
            pending.step,
            level=p.level,
            base_step=self._base_step if memory is not None else None,
            base=memory.base if memory is not None else None,
            base_hashes=memory.hashes if memory is not None else None,
            reference=memory.quant if memory is not None else None,
            compress=bool(self._pays) or p.mode != "auto",
            lossy=LossyArgs(
                bits=p.lossy_bits,  # type: ignore[arg-type]
                promote=0 if log_domain else self.outliers,  # log: beyond its cap is exact
                target=p.lossy_target,
                nonnegative=second_moment,
                domain="log" if log_domain else "linear",
            ),
        )
        enc = codec.encode(data, args)
        if codec.needs == "reference" and args.reference is not None:
            pending.quantized.append(args.reference)  # committed once the save is durable
        update = _Memory()
        if pending.full:
            # What the next deltas need of this base: its bytes (XOR, lossy) or its hashes.
            if p.mode == "lossy" and lossy_key and dtype in _FLOATS:
                update.quant = QuantState()  # holds the one copy the quantized deltas need
                update.quant.reset(data, pending.step)
            elif dtype in _FLOATS and (p.mode in ("lossless", "lossy") or self._pays):
                update.base = np.array(data, dtype=np.uint8, copy=True)
            else:  # integers, booleans: the chunks that changed (an XOR compresses no better)
                update.hashes = enc.hashes if enc is not None and enc.hashes else chunk_hashes(data)
            pending.updates[piece] = update
        return enc

    @property
    def outliers(self) -> int:
        """Values per block of 256 that a quantized delta keeps exactly."""
        p = self.policy
        return OUTLIERS if p.lossy_outliers is None else p.lossy_outliers

    @property
    def base_step(self) -> int | None:
        """The step the next deltas are taken against (None: the next save is a base, or
        saves store no deltas: ``"none"``, or ``"auto"`` writing raw)."""
        return self._base_step if self._memory else None

    def finish(self, *, committed: bool, raw_bytes: int, stored_bytes: int, write_s: float) -> None:
        """Update the memory after the save: a failed save is forgotten and the next one is a
        base (its deltas would point at nothing)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not committed:
            self._base_step = None
            return
        if write_s > 0 and stored_bytes > 0:
            self.write_mbps = stored_bytes / write_s / 1e6
            self._write_sample_bytes = stored_bytes
        self.last_ratio = raw_bytes / stored_bytes if stored_bytes else None
        if pending.full:
            self._memory = pending.updates
            self._base_step = pending.step
            self._since_base = 1
            self._lossy_generation = 0
        else:
            self._since_base += 1
            for state in pending.quantized:
                state.commit()
            if pending.quantized:
                self._lossy_generation += 1
