"""Restore of many small arrays: read by regions of their data files, each checked on its own,
and each manifest parsed once per restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, CorruptCheckpointError
from coci_core.engine.directory import steps
from coci_core.engine.directory.steps import read_manifest
from coci_core.engine.format.manifest import Manifest, step_dir_name
from coci_core.engine.restore.load import load_checkpoint
from coci_core.storage import LocalStorage


def _state(n: int = 300) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "small": {f"t{i}": torch.randn(1 + i % 50, generator=gen) for i in range(n)},
        "half": torch.randn(3, 5, generator=gen).half(),
        "large": torch.randn(100_000, generator=gen),  # past REGION_PIECE_BYTES
        "step": 7,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def test_many_small_arrays_come_back_each_with_its_own_storage(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
    got = load_checkpoint(LocalStorage(tmp_path), 1).state
    assert _equal(got, state)
    small = list(got["small"].values())
    assert len({t.untyped_storage().data_ptr() for t in small}) == len(small)


def test_a_damaged_small_array_is_named(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state()).wait()
    storage = LocalStorage(tmp_path)
    entry = next(t for t in read_manifest(storage, 1).tensors if t.key == "/small/t123")
    piece = entry.pieces[0]
    path = tmp_path / step_dir_name(1) / piece.file
    data = bytearray(path.read_bytes())
    data[piece.offset + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        load_checkpoint(storage, 1)
    assert info.value.bad == ["/small/t123"]


def test_a_resume_parses_each_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(50)
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        for step in range(4):
            mgr.save(step, state).wait()
    calls: list[str] = []
    for name in ("from_json", "from_head"):
        real = getattr(Manifest, name).__func__

        def counted(cls: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _real(cls, *args, **kw)

        monkeypatch.setattr(Manifest, name, classmethod(counted))
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        assert _equal(mgr.restore(), state)
    assert calls == ["from_json"]  # the heads were known from the saves: the load parsed one
    calls.clear()
    monkeypatch.setattr(steps, "_infos", {})  # as in a new process
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        assert _equal(mgr.restore(), state)
    assert calls == ["from_head"]  # the listing read heads; the load checked the newest's
