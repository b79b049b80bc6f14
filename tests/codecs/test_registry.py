"""The codec registry: a codec registered from outside coci is chosen, written and restored
through CheckpointManager; a piece whose codec no reader knows is refused clearly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager, ConfigError, CorruptCheckpointError
from coci_core.codecs import (
    RAW,
    Codec,
    EncodeArgs,
    Encoded,
    Params,
    choose_codec,
    decode,
    get_codec,
    needs_base,
    register_codec,
    unregister_codec,
)
from coci_core.codecs._common import Buffer, u8, writable_u8
from coci_core.codecs._params import check_codec, check_out
from coci_core.engine.format.manifest import step_dir_name
from tests.codecs.test_manager_compression import manifest_entry

FLIP = "test.flip/1"


def _encode_flip(data: memoryview, args: EncodeArgs) -> Encoded:
    """Every byte inverted: a trivial reversible transform."""
    arr = u8(data)
    return Encoded(np.bitwise_not(arr).tobytes(), {"codec": FLIP, "nbytes": arr.nbytes})


def _decode_flip(
    stored: Buffer, params: Params, out: Buffer, base: Buffer | None, threads: int
) -> None:
    check_codec(params, FLIP)
    dst = writable_u8(out)
    if u8(stored).nbytes != check_out(params, dst):
        raise CorruptCheckpointError("flipped piece has the wrong size")
    np.bitwise_not(u8(stored), out=dst)


@pytest.fixture
def flip() -> Iterator[Codec]:
    """The flip codec, picked for int64 pieces under "lossless", registered for one test."""
    codec = register_codec(
        Codec(
            FLIP,
            _decode_flip,
            _encode_flip,
            select=lambda dtype, nbytes, mode, base: dtype == "int64" and mode == "lossless",
        )
    )
    yield codec
    with contextlib.suppress(ConfigError):  # a test may have unregistered it
        unregister_codec(FLIP)


def _state() -> dict[str, torch.Tensor]:
    return {"ids": torch.arange(10_000) * 7, "w": torch.randn(4096), "small": torch.arange(8)}


def test_a_registered_codec_round_trips_through_the_manager(tmp_path: Path, flip: Codec) -> None:
    state = _state()
    with CheckpointManager(tmp_path, keep_last=None, compression="lossless") as mgr:
        mgr.save(1, state).wait()
        manifest = mgr.manifest(1)
        restored = mgr.restore(step=1)
    assert manifest_entry(manifest, "/ids").codec == FLIP
    assert manifest_entry(manifest, "/w").codec == "coci.zstd/1"  # the built-in rules still hold
    assert manifest_entry(manifest, "/small").codec == RAW  # under MIN_BYTES: raw in every mode
    for key, value in state.items():
        assert torch.equal(restored[key], value)
    stored = (tmp_path / step_dir_name(1) / "data-r0.bin").read_bytes()
    assert state["ids"].numpy().tobytes() not in stored  # it was really flipped


def test_an_unknown_codec_in_a_manifest_is_refused_clearly(tmp_path: Path, flip: Codec) -> None:
    """A reader without the codec reports the step as damaged, naming the codec, and falls
    back to the newest step it can read."""
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        mgr.save(1, _state()).wait()
    with CheckpointManager(tmp_path, keep_last=None, compression="lossless") as mgr:
        mgr.save(2, _state()).wait()
    unregister_codec(FLIP)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        with pytest.raises(
            CorruptCheckpointError, match=r"'/ids'.*unknown array codec 'test.flip/1'"
        ) as info:
            mgr.restore(step=2)
        assert info.value.bad == ["/ids"]
        mgr.restore()
        assert mgr.last_restore is not None
        assert mgr.last_restore.step == 1 and mgr.last_restore.skipped_steps == (2,)


def test_registration_is_checked(flip: Codec) -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_codec(flip)
    with pytest.raises(ConfigError, match="already registered"):
        register_codec(Codec(RAW, _decode_flip))
    with pytest.raises(ConfigError, match="not 'mixed'"):
        register_codec(Codec("mixed", _decode_flip))
    with pytest.raises(ConfigError, match="no codec"):
        unregister_codec("test.never/1")


def test_the_registry_dispatches_decode_and_choice(flip: Codec) -> None:
    data = np.arange(4096, dtype=np.int64).view(np.uint8)
    enc = _encode_flip(memoryview(data), EncodeArgs("int64", 1))
    assert not needs_base(enc.params)  # a codec without deltas has no "base" field
    out = np.empty_like(data)
    decode(enc.data, enc.params, out)
    assert np.array_equal(out, data)
    assert choose_codec("int64", data.nbytes, "lossless") == FLIP
    assert choose_codec("int64", data.nbytes, "none") == RAW
    assert choose_codec("int64", 100, "lossless") == RAW
    assert choose_codec("int32", data.nbytes, "lossless") == "coci.zstd/1"
    assert get_codec(FLIP) is flip
