"""Lossless codec comparison on real fp32 weights + Adam state (digits CNN, see digits_states).

    python -m benchmarks.codecs_bench [--reps 7]

Prints a markdown table: ratio (raw / stored), encode and decode MB/s (best of ``reps``, MB =
1e6 bytes of raw data), for coci's codecs and for blosc2 / numcodecs when they are installed.
Each state is encoded tensor by tensor, as the writer will (one call per tensor).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from benchmarks._lib.timing import best_of
from benchmarks.digits_states import states
from coci_core.codecs.lossless import decode_lossless, decode_xor, encode_lossless, encode_xor
from coci_core.codecs.quantized import QuantState, decode_quantized, encode_quantized

Arrays = list[np.ndarray]


def _row(
    name: str,
    enc: Callable[[np.ndarray, np.ndarray | None], Any],
    dec: Callable[[Any, np.ndarray, np.ndarray | None], None],
    size: Callable[[Any], int],
    data: Arrays,
    bases: list[np.ndarray | None],
    reps: int,
) -> str:
    n = sum(a.nbytes for a in data)
    te, stored = best_of(lambda: [enc(a, b) for a, b in zip(data, bases, strict=True)], reps)
    outs = [np.empty_like(a) for a in data]

    def decode_all() -> None:
        for s, o, b in zip(stored, outs, bases, strict=True):
            dec(s, o, b)

    td, _ = best_of(decode_all, reps)
    for a, o in zip(data, outs, strict=True):
        assert np.array_equal(a, o), name
    ratio = n / sum(size(s) for s in stored)
    return f"| {name} | {ratio:.3f} | {n / te / 1e6:.0f} | {n / td / 1e6:.0f} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    reps = args.reps
    steps = states([100, 101, 110, 200, 300])

    def arrays(step: int) -> Arrays:
        return [a.reshape(-1).view(np.uint8) for a in steps[step].values()]

    full = arrays(300)
    none: list[np.ndarray | None] = [None] * len(full)
    mb = sum(a.nbytes for a in full) / 1e6
    print(f"state: {len(full)} tensors, {mb:.2f} MB (step 300); load {os.getloadavg()}\n")
    print("| codec | ratio | encode MB/s | decode MB/s |\n|---|---|---|---|")

    for level, low in ((1, None), (1, 1), (3, None)):
        for threads in (1, 2):
            low_txt = f"{min(level, -1)} (default)" if low is None else str(low)
            print(
                _row(
                    f"coci.zstd/1 top plane L{level}, mantissa planes L{low_txt}, "
                    f"threads={threads}",
                    lambda a, b, lv=level, lo=low, th=threads: encode_lossless(
                        a, "float32", level=lv, low_level=lo, threads=th
                    ),
                    lambda s, o, b, th=threads: decode_lossless(s.data, s.params, o, threads=th),
                    lambda s: s.nbytes,
                    full,
                    none,
                    reps,
                )
            )
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    print(
        _row(
            "plain zstd L3, no shuffle (DCP-like)",
            lambda a, b: zc.compress(a),
            lambda s, o, b: o.__setitem__(slice(None), np.frombuffer(zd.decompress(s), np.uint8)),
            len,
            full,
            none,
            reps,
        )
    )
    try:
        import blosc2

        for filt in (blosc2.Filter.SHUFFLE, blosc2.Filter.BITSHUFFLE):
            for level in (1, 3):
                for th in (1, 2):

                    def enc(
                        a: np.ndarray, b: Any, f: Any = filt, lv: int = level, t: int = th
                    ) -> bytes:
                        return blosc2.compress2(
                            a,
                            typesize=4,
                            clevel=lv,
                            filters=[f],
                            codec=blosc2.Codec.ZSTD,
                            nthreads=t,
                        )

                    def dec(s: bytes, o: np.ndarray, b: Any, t: int = th) -> None:
                        blosc2.decompress2(s, dst=o, nthreads=t)

                    print(
                        _row(
                            f"blosc2 {blosc2.__version__} {filt.name} zstd L{level} nthreads={th}",
                            enc,
                            dec,
                            len,
                            full,
                            none,
                            reps,
                        )
                    )
    except ImportError:
        print("| blosc2 not installed | | | |")
    try:
        import numcodecs
        from numcodecs import Blosc, Shuffle, Zstd

        numcodecs.blosc.set_nthreads(2)
        for level in (1, 3):
            bc = Blosc(cname="zstd", clevel=level, shuffle=Blosc.SHUFFLE)
            print(
                _row(
                    f"numcodecs {numcodecs.__version__} Blosc(zstd, SHUFFLE) L{level} 2 thr",
                    lambda a, b, c=bc: c.encode(a),
                    lambda s, o, b, c=bc: c.decode(s, out=o),
                    len,
                    full,
                    none,
                    reps,
                )
            )
        sh, zs = Shuffle(elementsize=4), Zstd(level=1)
        print(
            _row(
                "numcodecs Shuffle + Zstd L1",
                lambda a, b: zs.encode(sh.encode(a)),
                lambda s, o, b: o.__setitem__(
                    slice(None), np.frombuffer(sh.decode(zs.decode(s)), np.uint8)
                ),
                len,
                full,
                none,
                reps,
            )
        )
    except ImportError:
        print("| numcodecs not installed | | | |")

    print("\nXOR delta against an earlier checkpoint (coci.xor-zstd/1, L1, threads=1):\n")
    print("| saved every | ratio | encode MB/s | decode MB/s |\n|---|---|---|---|")
    for every, (a, b) in {
        "1 step": (100, 101),
        "10 steps": (100, 110),
        "100 steps": (100, 200),
    }.items():
        base: list[np.ndarray | None] = list(arrays(a))
        print(
            _row(
                every,
                lambda x, y: encode_xor(x, y, "float32"),
                lambda s, o, y: decode_xor(s.data, s.params, o, y),
                lambda s: s.nbytes,
                arrays(b),
                base,
                reps,
            )
        )

    print("\nQuantized delta (coci.qdelta/1, block 256, 4 promoted per block), whole state:\n")
    print("| saved every | bits | ratio | rel. L2 error | encode MB/s | decode MB/s |")
    print("|---|---|---|---|---|---|")
    for every, (a, b) in {"1 step": (100, 101), "100 steps": (100, 200)}.items():
        for bits in (8, 4, 2):
            x, ref = np.concatenate(arrays(b)), np.concatenate(arrays(a))
            state = QuantState()
            state.reset(ref)
            te, enc = best_of(
                lambda x=x, s=state, bt=bits: encode_quantized(x, "float32", s, bits=bt), 3
            )
            out = np.empty_like(x)
            td, _ = best_of(lambda e=enc, o=out, r=ref: decode_quantized(e.data, e.params, o, r), 3)
            print(
                f"| {every} | {bits} | {x.nbytes / enc.nbytes:.1f} | "
                f"{enc.params['rel_error']:.1e} | {x.nbytes / te / 1e6:.0f} | "
                f"{x.nbytes / td / 1e6:.0f} |"
            )

    print("\nChunk hashes (64 KiB chunks) over the whole state, MB/s:\n")
    import crc32c
    import xxhash

    blob = np.concatenate(full)
    chunks = [blob[i : i + 65536] for i in range(0, blob.nbytes, 65536)]
    for name, fn in {
        "xxh3_128 (xxhash)": lambda c: xxhash.xxh3_128_digest(c),
        "xxh3_64 (xxhash)": lambda c: xxhash.xxh3_64_digest(c),
        "crc32c": lambda c: crc32c.crc32c(c),
        "blake2b-128 (hashlib)": lambda c: hashlib.blake2b(c, digest_size=16).digest(),
    }.items():
        t, _ = best_of(lambda f=fn: [f(c) for c in chunks], reps)
        print(f"| {name} | {blob.nbytes / t / 1e6:.0f} |")


if __name__ == "__main__":
    main()
