"""Codec selection and the "auto" decision (pure functions)."""

from __future__ import annotations

import pytest
import torch

from coci_core.codecs import choose_codec, compression_pays, time_to_durable
from coci_core.errors import ConfigError

MB = 1_000_000


def test_time_to_durable_sequential_and_pipelined() -> None:
    assert time_to_durable(100 * MB, write_mbps=100) == pytest.approx(1.0)
    # 100 MB at 200 MB/s encode (0.5 s), ratio 2 -> 50 MB at 100 MB/s (0.5 s)
    seq = time_to_durable(100 * MB, write_mbps=100, encode_mbps=200, ratio=2.0)
    pipe = time_to_durable(100 * MB, write_mbps=100, encode_mbps=200, ratio=2.0, pipelined=True)
    assert seq == pytest.approx(1.0)
    assert pipe == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        time_to_durable(MB, write_mbps=0)
    with pytest.raises(ConfigError):
        time_to_durable(MB, write_mbps=1, encode_mbps=1, ratio=0)


def test_compression_pays_on_slow_storage_only() -> None:
    # measured here: shuffle+zstd ~250 MB/s at ratio 1.23 on fp32 weights + Adam
    enc, ratio = 250.0, 1.23
    assert not compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=2000)  # local NVMe
    # sequential, a 1.23 ratio saves 19% of the write: it pays only below ~250 * 0.19 MB/s
    assert not compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=50)
    assert compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=20)  # slow object store
    # 200 MB/s storage: sequential loses (1/250 + 1/246 > 1/200), pipelined wins
    assert not compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=200)
    assert compression_pays(encode_mbps=enc, ratio=ratio, write_mbps=200, pipelined=True)
    # the margin: a 3% win is not enough at the default 5%
    assert not compression_pays(encode_mbps=1e9, ratio=1.03, write_mbps=100)
    assert compression_pays(encode_mbps=1e9, ratio=1.03, write_mbps=100, margin=0.0)


def test_choose_codec_modes() -> None:
    big = 1 << 20
    assert choose_codec("float32", big, "none", base="bytes") == "coci.raw/1"
    assert choose_codec("float32", 100, "lossless") == "coci.raw/1"
    assert choose_codec(torch.float32, big, "lossless") == "coci.zstd/1"
    assert choose_codec("bfloat16", big, "lossless", base="bytes") == "coci.xor-zstd/1"
    assert choose_codec("float16", big, "lossless", base="hashes") == "coci.chunks/1"
    assert choose_codec("int64", big, "lossless", base="bytes") == "coci.zstd/1"
    assert choose_codec("int64", big, "lossless", base="hashes") == "coci.chunks/1"
    assert choose_codec("float32", big, "lossy", base="reference") == "coci.qdelta/1"
    assert choose_codec("float32", big, "lossy", base="none") == "coci.zstd/1"
    assert choose_codec("int32", big, "lossy", base="reference") == "coci.zstd/1"
    assert choose_codec("float32", big, "auto", compress_pays=True) == "coci.zstd/1"
    assert choose_codec("float32", big, "auto", compress_pays=False) == "coci.raw/1"
    assert choose_codec("float32", big, "auto", base="hashes", compress_pays=False) == (
        "coci.chunks/1"
    )
    with pytest.raises(ConfigError):
        choose_codec("float32", big, "fast")  # type: ignore[arg-type]
