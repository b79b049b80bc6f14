"""``allow_torch_save=True``: a value is kept only if it can be restored, and a stored value that
cannot be loaded without running code makes its checkpoint damaged, never a crash.

Values kept with ``torch.save`` are loaded with ``torch.load(weights_only=True)``; save refuses
what that load would refuse (``UnsupportedValueError`` naming the key). A leaf whose bytes were
replaced by a pickle that would run code (with its checksum fixed, so only the load can tell) is
a ``CorruptCheckpointError`` on restore, and ``restore()`` falls back to the older step.
"""

from __future__ import annotations

import datetime
import fractions
import io
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

from coci_core import (
    CheckpointManager,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from coci_core.engine.format.manifest import MANIFEST_NAME, seal, step_dir_name
from tests.harness.processes import run, script


@dataclass
class Point:
    x: int
    y: int


class _Call:
    """Pickles as ``fn(*args)``: what an attacker's ``__reduce__`` makes the unpickler call."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __call__(self, *args: Any) -> Any:
        raise AssertionError("never called here")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.fn, self.args)


def _torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _rewrite_manifest(directory: Path, step: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a committed manifest in place (the only place these tests touch manifests)."""
    path = directory / step_dir_name(step) / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    doc.pop("checksum", None)
    edit(doc)
    # A crafted manifest: its checksum is recomputed, so only the checks behind it can refuse it.
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))


def _replace_leaf_bytes(directory: Path, step: int, key: str, data: bytes) -> None:
    """Store ``data`` as the bytes of leaf ``key``: appended to its data file, the manifest's
    piece pointing to it with a correct crc32c, so that every checksum still passes."""
    holder: dict[str, Any] = {}

    def edit(doc: dict[str, Any]) -> None:
        entry = next(t for t in doc["tensors"] if t["key"] == key)
        (piece,) = entry["pieces"]
        path = directory / step_dir_name(step) / piece["file"]
        offset = path.stat().st_size
        with path.open("ab") as f:
            f.write(data)
        piece.update(offset=offset, nbytes=len(data), length=len(data), crc32c=crc32c.crc32c(data))
        entry["shape"] = [len(data)]
        for f_entry in doc["files"]:
            if f_entry["name"] == piece["file"]:
                f_entry["nbytes"] = path.stat().st_size
        holder["done"] = True

    _rewrite_manifest(directory, step, edit)
    assert holder.get("done")


# (pathlib paths and argparse.Namespace are stored without torch.save, by the name of their
# type: see test_hyperparameters.py)
REFUSED: dict[str, Any] = {
    "datetime": datetime.datetime(2024, 5, 1, 12, 30),
    "dataclass": Point(1, 2),
    "slice": slice(1, 10, 2),
    "fractions.Fraction": fractions.Fraction(1, 3),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_values_weights_only_refuses_are_refused_at_save(tmp_path: Path, name: str) -> None:
    """Each would be saved and then never restored: refused at save, naming key and type."""
    value = REFUSED[name]
    with CheckpointManager(tmp_path / "ckpt", allow_torch_save=True) as mgr:
        with pytest.raises(UnsupportedValueError) as info:
            mgr.save(1, {"w": torch.ones(2), "cfg": {"value": value}})
        message = str(info.value)
        assert "'/cfg/value'" in message
        assert type(value).__qualname__ in message
        assert "could never be restored" in message
        assert "add_safe_globals" in message
        assert "str or a number" in message
        assert mgr.steps() == []
        mgr.save(1, {"w": torch.ones(2), "cfg": {"value": str(value)}}).wait()  # the advice
        assert mgr.restore()["cfg"]["value"] == str(value)


def test_a_registered_type_is_accepted_and_restored(tmp_path: Path) -> None:
    """A type the user registered with add_safe_globals passes the check (and loads back while
    registered); restoring without it is a damaged checkpoint, not a crash."""
    with (
        torch.serialization.safe_globals([Point]),
        CheckpointManager(tmp_path / "ckpt", allow_torch_save=True) as mgr,
    ):
        mgr.save(1, {"p": Point(3, 4)}).wait()
        assert mgr.restore()["p"] == Point(3, 4)
    with (
        CheckpointManager(tmp_path / "ckpt") as mgr,
        pytest.raises(UnsafeCheckpointError, match=r"'/p'.*Point"),
    ):
        mgr.restore(1)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_values_weights_only_allows_round_trip(tmp_path: Path) -> None:
    """What goes through torch.save and that weights_only loads is kept and restored."""
    sparse = torch.eye(3).to_sparse()
    quantized = torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, torch.qint8)
    state = {
        "set": {1, 2, 3},
        "complex": 1.5 + 2j,
        "device": torch.device("cpu"),
        "bytearray": bytearray(b"\x00ab"),
        "sparse": sparse,
        "nested": {"q": quantized},  # rebuilt on meta fails: the check loads it on the CPU
        "w": torch.arange(3.0),
    }
    with CheckpointManager(tmp_path / "ckpt", allow_torch_save=True) as mgr:
        mgr.save(1, state).wait()
        kinds = {t.key: t.kind for t in mgr.manifest(1).tensors}
        restored = mgr.restore()
    assert kinds["/set"] == kinds["/sparse"] == kinds["/nested/q"] == "torch_save"
    assert kinds["/w"] == "tensor"
    for key in ("set", "complex", "device", "bytearray"):
        assert restored[key] == state[key]
        assert type(restored[key]) is type(state[key])
    assert torch.equal(restored["sparse"].to_dense(), sparse.to_dense())
    assert torch.equal(restored["nested"]["q"].dequantize(), quantized.dequantize())
    assert torch.equal(restored["w"], state["w"])


def _two_steps(directory: Path) -> None:
    with CheckpointManager(directory, allow_torch_save=True, compression="none") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step)), "s": {step, 10}}).wait()


def _payloads(marker: Path) -> dict[str, bytes]:
    good = _torch_saved({1, 2})
    return {
        "os.system": _torch_saved(_Call(os.system, f"touch {marker}")),
        "builtins.exec": _torch_saved(_Call(exec, f"open({str(marker)!r}, 'w').close()")),
        "garbage": os.urandom(len(good)),
        "truncated zip": good[: len(good) // 2],
    }


@pytest.mark.parametrize("damage", ["os.system", "builtins.exec", "garbage", "truncated zip"])
def test_a_leaf_that_cannot_be_loaded_makes_the_step_damaged(tmp_path: Path, damage: str) -> None:
    """Leaf bytes replaced (checksums fixed): restore of that step raises CorruptCheckpointError
    naming the key, restore() falls back to the older intact step, verify names the key, and
    no code ran."""
    directory = tmp_path / "ckpt"
    marker = tmp_path / "MARKER-code-ran"
    _two_steps(directory)
    _replace_leaf_bytes(directory, 2, "/s", _payloads(marker)[damage])
    with CheckpointManager(directory, allow_torch_save=True) as mgr:
        with pytest.raises(CorruptCheckpointError, match="'/s'") as info:
            mgr.restore(2)
        assert info.value.bad == ["/s"]
        if damage in ("os.system", "builtins.exec"):
            assert isinstance(info.value, UnsafeCheckpointError)
            assert "without running code" in str(info.value)
        restored = mgr.restore()
        assert mgr.last_restore is not None
        assert mgr.last_restore.step == 1
        assert mgr.last_restore.skipped_steps == (2,)
        assert restored["s"] == {1, 10}
        assert torch.equal(restored["w"], torch.full((4,), 1.0))
        assert mgr.verify(2) == {2: ["/s"]}
        assert mgr.verify(1) == {1: []}
    assert not marker.exists()


def test_strict_restore_raises_the_corrupt_error(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    marker = tmp_path / "MARKER-code-ran"
    _two_steps(directory)
    _replace_leaf_bytes(directory, 2, "/s", _payloads(marker)["os.system"])
    with (
        CheckpointManager(directory, strict=True) as mgr,
        pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"),
    ):
        mgr.restore()
    assert not marker.exists()


def _torch_saved_with_pickle(record: bytes) -> bytes:
    """A torch.save zip whose ``data.pkl`` is ``record``."""
    reader = torch._C.PyTorchFileReader(io.BytesIO(_torch_saved({"a": 1})))
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    for name in reader.get_all_records():
        data = record if name == "data.pkl" else reader.get_record(name)
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def _shared_at_every_level(levels: int) -> list[Any]:
    node: list[Any] = [1]
    for _ in range(levels):
        node = [node, node]
    return node


def _shared_tuple(levels: int) -> tuple[Any, ...]:
    node: tuple[Any, ...] = (1,)
    for _ in range(levels):
        node = (node, node)
    return node


_RESTORE_CHILD = """
import sys
from coci_core import CheckpointManager
with CheckpointManager(sys.argv[1], allow_torch_save=True) as mgr:
    try:
        mgr.restore(2)
    except Exception as e:
        print("REFUSED", type(e).__name__, e)
    state = mgr.restore()
    print("RESTORED", mgr.last_restore.step, sorted(state["s"]))
"""

_PICKLE_BOMBS = {
    # a dict keyed by a tuple nested 200,000 deep: hashing it in C overflows the stack
    "deeply nested key": b"\x80\x02}K\x01" + b"\x85" * 200_000 + b"K\x01s.",
    # 1.3 KB that describe 2**22 values
    "shared at every level": pickle.dumps(_shared_at_every_level(22), protocol=2),
}


@pytest.mark.parametrize("bomb", sorted(_PICKLE_BOMBS))
def test_a_stored_value_whose_pickle_is_a_bomb_makes_the_step_damaged(
    tmp_path: Path, bomb: str
) -> None:
    """A crafted checkpoint (checksums fixed) whose torch.save'd value crashes the interpreter
    or describes millions of objects: its pickle is measured before torch.load runs it, the
    step is damaged and restore falls back (in a child: before, the child died of SIGSEGV)."""
    directory = tmp_path / "ckpt"
    _two_steps(directory)
    _replace_leaf_bytes(directory, 2, "/s", _torch_saved_with_pickle(_PICKLE_BOMBS[bomb]))
    child = run(script(_RESTORE_CHILD, str(directory)))
    assert child.returncode == 0, child.stderr[-2000:]
    assert "REFUSED CorruptCheckpointError" in child.stdout
    assert "'/s'" in child.stdout
    assert "RESTORED 1 [1, 10]" in child.stdout


def test_a_value_whose_pickle_restore_would_refuse_is_refused_at_save(tmp_path: Path) -> None:
    """What restore refuses is refused at save, naming the key (not stored, then never
    restorable)."""
    with (
        CheckpointManager(tmp_path / "ckpt", allow_torch_save=True) as mgr,
        pytest.raises(UnsupportedValueError, match=r"'/v'.*describes a tree of more than"),
    ):
        mgr.save(1, {"v": {_shared_tuple(20)}})
