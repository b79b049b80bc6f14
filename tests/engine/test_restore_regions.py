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


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the Manifest constructors called from now on, in order."""
    calls: list[str] = []
    for name in ("from_json", "from_head"):
        real = getattr(Manifest, name).__func__

        def counted(cls: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _real(cls, *args, **kw)

        monkeypatch.setattr(Manifest, name, classmethod(counted))
    return calls


def test_a_resume_parses_each_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(50)
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        for step in range(4):
            mgr.save(step, state).wait()
    calls = _count_parses(monkeypatch)
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        assert _equal(mgr.restore(), state)
    assert calls == ["from_json"]  # the heads were known from the saves: the load parsed one
    calls.clear()
    monkeypatch.setattr(steps, "_infos", {})  # as in a new process
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        assert _equal(mgr.restore(), state)
    # the listing read each head from the start of its manifest; the load decoded the newest
    assert calls == ["from_json"]


def test_a_listing_decodes_no_manifest_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head of a manifest this coci wrote is at its start: a listing in a new process
    decodes the head's fields of each manifest, not its arrays, and a restore then decodes
    only the manifest it reads."""
    from coci_core.engine.format import manifest as manifest_module

    state = _state(300)
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        for step in range(4):
            mgr.save(step, state).wait()
    sizes: list[int] = []
    real = manifest_module._loads

    def counted(body: bytes, where: str, step: int | None) -> Any:
        sizes.append(len(body))
        return real(body, where, step)

    monkeypatch.setattr(manifest_module, "_loads", counted)
    monkeypatch.setattr(steps, "_infos", {})  # as in a new process
    assert [i.step for i in steps.step_infos(LocalStorage(tmp_path))] == [3, 2, 1]
    assert len(sizes) == 3 and max(sizes) < 200, sizes  # three heads, not three manifests
    sizes.clear()
    monkeypatch.setattr(steps, "_infos", {})
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        assert _equal(mgr.restore(), state)
    assert len([n for n in sizes if n > 10_000]) == 1, sizes  # the newest, whole, once


def test_a_manifest_with_its_head_elsewhere_is_listed_and_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest whose fields are in another order (an earlier coci wrote the head's fields
    among the others) is decoded whole for its head, and restored from that one decoding."""
    import json

    from coci_core.engine.format.manifest import seal

    state = _state(50)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(3):
            mgr.save(step, state).wait()
    old_order = ("step", "created_unix", "tree", "tensors", "files", "format_version")
    for step in (1, 2):
        path = tmp_path / step_dir_name(step) / "manifest.json"
        doc = json.loads(path.read_bytes())
        doc.pop("checksum")
        doc = {k: doc[k] for k in (*old_order, *(k for k in doc if k not in old_order))}
        path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
    monkeypatch.setattr(steps, "_infos", {})
    infos = steps.step_infos(LocalStorage(tmp_path))
    assert [(i.step, i.sequence, i.intact) for i in infos] == [
        (2, 3, True),
        (1, 2, True),
        (0, 1, True),
    ]
    calls = _count_parses(monkeypatch)
    monkeypatch.setattr(steps, "_infos", {})
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert _equal(mgr.restore(), state) and mgr.last_restore is not None
        assert mgr.last_restore.step == 2
    assert calls == ["from_head"]  # the listing's decoding of step 2, checked and used
