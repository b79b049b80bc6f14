"""``coci import`` never runs code from what it imports.

A torch.distributed.checkpoint (DCP) directory keeps its ``.metadata`` as a pickle and its
non-tensor values as ``torch.save`` pickles; DCP itself loads them with ``pickle.load`` and
``torch.load(weights_only=False)``. Every test here plants code in real files (a ``__reduce__``
that would create a marker file) and checks that the import refuses it with a ``CociError`` and
that the marker never appears; the old import (``dcp_to_torch_save``) ran each of them. Real
DCP directories, saved by torch (one process, and two processes with gloo and DTensor shards),
must import exactly as ``dcp_to_torch_save`` read them.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import pickle
import subprocess
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from coci_core import (
    CheckpointManager,
    CociError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from coci_core.commands.cli import main
from coci_core.commands.cli import read_foreign as cli_read_foreign
from coci_core.interop.foreign import read_dcp, read_foreign

# -- payloads ----------------------------------------------------------------------------------


class _Call:
    """Pickles as ``fn(*args)``: what an attacker's ``__reduce__`` makes the unpickler call."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __call__(self, *args: Any) -> Any:  # pickle wants a callable in a reduce
        raise AssertionError("never called here")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.fn, self.args)


def _touch(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def _torch_saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _short_str(text: str) -> bytes:
    data = text.encode()
    assert len(data) < 256
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _dotted_global(marker: Path) -> bytes:
    """Protocol 4 resolves dotted names: a module DCP uses, then ``os.system`` through it."""
    return (
        b"\x80\x04"
        + _short_str("torch.distributed.checkpoint.metadata")
        + _short_str("os.system")
        + b"\x93"  # STACK_GLOBAL
        + _short_str(f"touch {marker}")
        + b"\x85R."  # TUPLE1 REDUCE STOP
    )


def _pickled(obj: Any) -> Callable[[Path], bytes]:
    return lambda marker: pickle.dumps(obj(marker))


PAYLOADS: dict[str, Callable[[Path], bytes]] = {
    "os.system": _pickled(lambda m: _Call(os.system, f"touch {m}")),
    "subprocess.call": _pickled(lambda m: _Call(subprocess.call, ["touch", str(m)])),
    "builtins.exec": _pickled(lambda m: _Call(exec, _touch(m))),
    "builtins.eval": _pickled(lambda m: _Call(eval, _touch(m))),
    "getattr(import_module('os'), 'system')": _pickled(
        lambda m: _Call(
            _Call(getattr, _Call(importlib.import_module, "os"), "system"), f"touch {m}"
        )
    ),
    "torch.load(weights_only=False) nested": _pickled(
        lambda m: _Call(
            functools.partial(torch.load, weights_only=False),
            _Call(io.BytesIO, _torch_saved(_Call(os.system, f"touch {m}"))),
        )
    ),
    "pickle.loads nested": _pickled(
        lambda m: _Call(pickle.loads, pickle.dumps(_Call(os.system, f"touch {m}")))
    ),
    "dotted name through an allowed module": _dotted_global,
}

# -- real DCP directories ----------------------------------------------------------------------


def _dcp_save(state: dict[str, Any], path: Path, **writer: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, storage_writer=FileSystemWriter(str(path), **writer), no_dist=True)
    return path


def _old_import(src: Path) -> dict[str, Any]:
    """What ``coci import`` did before (runs code from the files: trusted data only)."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(src), f"{tmp}/state.pt")
        state: dict[str, Any] = torch.load(f"{tmp}/state.pt", weights_only=True)
    return state


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: {list(got)} != {list(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _trained_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for opt in (adam, sgd):
        model(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()
    return {
        "model": model.state_dict(),
        "adam": adam.state_dict(),
        "sgd": sgd.state_dict(),
        "step": 1234,
        "lr": 0.05,
        "name": "run-7",
        "blob": b"\x00\xffraw bytes",
        "none": None,
        "flags": [True, False],
        "pair": (1, 2.5),
    }


def _dtype_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 5, generator=g)
    return {
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "f64": base.double(),
        "c64": torch.complex(base, base.flip(0)),
        "i8": (base * 10).to(torch.int8),
        "u8": (base * 10).abs().to(torch.uint8),
        "i64": torch.arange(-3, 9),
        "bool": base > 0,
        "f8": base.to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "view": base.t(),  # not contiguous
        "nested": {"deeper": {"x": torch.ones(3, dtype=torch.int16), "n": 4}},
        "mixed": [torch.zeros(2), {"y": 1.5}, torch.ones(1)],
        "odict": OrderedDict(a=torch.ones(2), b=3),
    }


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "MARKER-code-ran"


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    state = {"w": torch.arange(6.0).reshape(2, 3), "note": "hello", "n": 3}
    return _dcp_save(state, tmp_path / "dcp")


def _load_meta(directory: Path) -> Metadata:
    with (directory / ".metadata").open("rb") as f:
        meta: Metadata = pickle.load(f)  # our own trusted files in these tests
    return meta


def _dump_meta(directory: Path, meta: Metadata) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(meta))


def _replace_stored(directory: Path, index: MetadataIndex, data: bytes) -> None:
    """Store ``data`` for ``index`` instead (appended to its file; the metadata points to it)."""
    meta = _load_meta(directory)
    info = meta.storage_data[index]
    path = directory / info.relative_path
    offset = path.stat().st_size
    with path.open("ab") as f:
        f.write(data)
    meta.storage_data[index] = _StorageInfo(info.relative_path, offset, len(data))
    _dump_meta(directory, meta)


def _import_cli(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    dst = tmp_path / "coci-dst"
    code = main(["import", str(src), str(dst), "--step", "1"])
    err = capsys.readouterr().err
    assert not dst.exists(), "nothing may be saved from a refused import"
    return code, err


# -- code in .metadata -------------------------------------------------------------------------


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_code_in_metadata_is_refused_by_read_foreign(
    tmp_path: Path, marker: Path, payload: str
) -> None:
    """A ``.metadata`` whose pickle calls something is refused before anything is called."""
    src = tmp_path / "evil"
    src.mkdir()
    (src / ".metadata").write_bytes(PAYLOADS[payload](marker))
    with pytest.raises(UnsafeCheckpointError, match="coci never runs code") as info:
        read_foreign(src)
    assert not marker.exists()
    assert "refusing to import" in str(info.value)
    assert ".metadata references" in str(info.value)


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_code_in_metadata_is_refused_by_the_cli(
    tmp_path: Path, marker: Path, payload: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``coci import`` exits 2 with one line naming the refused global; nothing runs."""
    src = tmp_path / "evil"
    src.mkdir()
    (src / ".metadata").write_bytes(PAYLOADS[payload](marker))
    code, err = _import_cli(src, tmp_path, capsys)
    assert code == 2
    assert not marker.exists()
    assert err.startswith("coci: refusing to import")
    assert "never runs code" in err


def test_the_refused_global_is_named(tmp_path: Path, marker: Path) -> None:
    src = tmp_path / "evil"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(_Call(subprocess.call, ["touch", str(marker)])))
    with pytest.raises(UnsafeCheckpointError, match=r"references subprocess\.call"):
        read_foreign(src)
    (src / ".metadata").write_bytes(_dotted_global(marker))
    with pytest.raises(UnsafeCheckpointError, match=r"checkpoint\.metadata\.os\.system"):
        read_foreign(src)
    assert not marker.exists()


def test_names_from_the_file_are_quoted_in_messages(tmp_path: Path) -> None:
    """A global name with terminal escapes is shown escaped, not sent to the terminal."""
    src = tmp_path / "evil"
    src.mkdir()
    raw = b"\x80\x04" + _short_str("os\x1b[2J") + _short_str("system") + b"\x93"
    (src / ".metadata").write_bytes(raw + _short_str("x") + b"\x85R.")
    with pytest.raises(UnsafeCheckpointError) as info:
        read_foreign(src)
    assert "\x1b" not in str(info.value)
    assert "os\\x1b[2J.system" in str(info.value)


def test_code_hidden_inside_real_metadata_is_refused(
    dcp_dir: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real DCP ``.metadata`` with a payload deep inside (in planner_data) is refused."""
    meta = _load_meta(dcp_dir)
    assert isinstance(meta.planner_data, dict)
    meta.planner_data["w"] = _Call(os.system, f"touch {marker}")
    _dump_meta(dcp_dir, meta)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        read_foreign(dcp_dir)
    code, err = _import_cli(dcp_dir, tmp_path, capsys)
    assert code == 2
    assert "refusing to import" in err
    assert not marker.exists()


def test_torch_names_other_than_dtypes_and_layouts_are_refused(dcp_dir: Path, marker: Path) -> None:
    """``torch.<name>`` resolves only to dtypes, layouts and memory formats (not torch.load)."""
    inner = _torch_saved(_Call(os.system, f"touch {marker}"))
    meta = _load_meta(dcp_dir)
    assert isinstance(meta.planner_data, dict)
    meta.planner_data["w"] = _Call(torch.load, _Call(io.BytesIO, inner))
    _dump_meta(dcp_dir, meta)
    with pytest.raises(UnsafeCheckpointError, match=r"references torch\.serialization\.load"):
        read_foreign(dcp_dir)
    raw = (
        b"\x80\x04"
        + _short_str("torch")
        + _short_str("load")
        + b"\x93"
        + _short_str("x")
        + b"\x85R."
    )
    (dcp_dir / ".metadata").write_bytes(raw)
    with pytest.raises(UnsafeCheckpointError, match=r"references torch\.load"):
        read_foreign(dcp_dir)
    assert not marker.exists()


# -- code in stored values ---------------------------------------------------------------------


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "pickle.loads nested"])
def test_code_in_a_stored_value_is_refused(
    dcp_dir: Path,
    marker: Path,
    payload: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A BYTE_IO value (DCP loads it with weights_only=False) whose pickle would run code is
    refused, naming its key: it cannot be loaded without running code."""
    make = {
        "os.system": lambda: _Call(os.system, f"touch {marker}"),
        "builtins.exec": lambda: _Call(exec, _touch(marker)),
        "pickle.loads nested": lambda: _Call(
            pickle.loads, pickle.dumps(_Call(os.system, f"touch {marker}"))
        ),
    }[payload]
    _replace_stored(dcp_dir, MetadataIndex("note"), _torch_saved(make()))
    with pytest.raises(UnsafeCheckpointError, match="'note' cannot be loaded without running"):
        read_foreign(dcp_dir)
    code, err = _import_cli(dcp_dir, tmp_path, capsys)
    assert code == 2
    assert "'note'" in err
    assert "without running code" in err
    assert not marker.exists()


def test_code_in_a_tensor_chunk_is_refused(dcp_dir: Path, marker: Path) -> None:
    """A tensor chunk whose bytes are a pickle calling something is refused too."""
    index = MetadataIndex("w", (0, 0))
    _replace_stored(dcp_dir, index, _torch_saved(_Call(os.system, f"touch {marker}")))
    with pytest.raises(UnsafeCheckpointError, match="chunk of the tensor 'w'"):
        read_foreign(dcp_dir)
    assert not marker.exists()


def test_a_value_that_is_not_plain_data_is_refused_even_if_harmless(
    dcp_dir: Path, tmp_path: Path
) -> None:
    """weights_only decides: a pathlib path in a value cannot be loaded without its class."""
    _replace_stored(dcp_dir, MetadataIndex("note"), _torch_saved(Path("/tmp/x")))
    with pytest.raises(UnsafeCheckpointError, match=r"'note'.*pathlib\.PosixPath"):
        read_foreign(dcp_dir)


# -- real DCP directories: the same state as before --------------------------------------------


@pytest.mark.parametrize(
    ("make_state", "writer"),
    [
        (_trained_state, {}),
        (_dtype_state, {}),
        (_trained_state, {"thread_count": 2}),
        (_dtype_state, {"single_file_per_rank": False}),
    ],
    ids=["optimizers", "dtypes", "two-files", "file-per-item"],
)
def test_real_dcp_directories_import_as_before(
    tmp_path: Path, make_state: Callable[[], dict[str, Any]], writer: dict[str, Any]
) -> None:
    """Nested dicts, optimizer states (ints, floats, lists, tuples, None), bytes, strings and
    tensors of many dtypes, shapes and layouts import exactly as dcp_to_torch_save read them."""
    src = _dcp_save(make_state(), tmp_path / "dcp", **writer)
    if writer:
        assert len(list(src.glob("*.distcp"))) > 1
    got = read_foreign(src)
    _assert_same(got, _old_import(src))
    assert cli_read_foreign is read_foreign


def test_values_are_what_was_saved(tmp_path: Path) -> None:
    state = _trained_state()
    got = read_dcp(_dcp_save(state, tmp_path / "dcp"))
    _assert_same(got["model"], dict(state["model"]))  # DCP keeps no OrderedDict
    assert got["adam"]["param_groups"] == state["adam"]["param_groups"]
    assert got["adam"]["state"]["0"]["step"] == state["adam"]["state"][0]["step"]
    assert got["blob"] == b"\x00\xffraw bytes"
    assert got["pair"] == (1, 2.5)
    assert got["none"] is None


def test_shards_of_two_ranks_are_assembled(tmp_path: Path) -> None:
    """Two gloo processes save Shard(0) (uneven), Shard(1) and Replicate() DTensors into one
    DCP directory (two data files, chunks at offsets): the import assembles the full tensors,
    as dcp_to_torch_save does."""
    from tests.adversarial._dcp_child import full_state
    from tests.sharding._dist_child import launch

    src = tmp_path / "dcp"
    results = launch(2, {"dir": str(src)}, module="tests.adversarial._dcp_child")
    assert [code for code, _ in results] == [0, 0], results
    meta = _load_meta(src)
    rows = meta.state_dict_metadata["model.rows"]
    assert isinstance(rows, TensorStorageMetadata)
    assert len(rows.chunks) == 2
    got = read_foreign(src)
    _assert_same(got, _old_import(src))
    full = full_state()
    for key in ("rows", "cols", "rep"):
        assert torch.equal(got["model"][key], full[key])
    assert got["step"] == 11
    assert got["note"] == "two ranks"


def test_cli_imports_a_real_dcp_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _trained_state()
    src = _dcp_save(state, tmp_path / "dcp")
    dst = tmp_path / "coci"
    assert main(["import", str(src), str(dst), "--step", "5"]) == 0
    with CheckpointManager(dst) as mgr:
        restored = mgr.restore()
    _assert_same(restored["model"], dict(state["model"]))
    assert restored["blob"] == state["blob"]


# -- damaged or crafted DCP directories: a CociError, never anything else ----------------------


def _small_dcp(tmp_path: Path) -> Path:
    return _dcp_save(
        {"a": {"w": torch.arange(4.0)}, "s": "x", "l": [torch.ones(1), 2]}, tmp_path / "small"
    )


def _outcome(src: Path) -> str:
    try:
        read_foreign(src)
    except CociError as e:
        return type(e).__name__
    return "ok"


def test_truncated_metadata_is_a_coci_error(tmp_path: Path) -> None:
    src = _small_dcp(tmp_path)
    data = (src / ".metadata").read_bytes()
    for cut in [0, 1, 2, *range(5, len(data) - 1, 23), len(data) - 1]:
        (src / ".metadata").write_bytes(data[:cut])
        assert _outcome(src) != "ok", cut


def test_garbled_metadata_is_a_coci_error_or_a_state(tmp_path: Path) -> None:
    """Flipped bytes (DCP has no checksum): a CociError, or (a flip in a name) a state; never
    a raw exception from the unpickler or the checks."""
    src = _small_dcp(tmp_path)
    data = (src / ".metadata").read_bytes()
    seen = set()
    for i in range(0, len(data), 5):
        for flip in (0x01, 0x80, 0xFF):
            garbled = bytearray(data)
            garbled[i] ^= flip
            (src / ".metadata").write_bytes(bytes(garbled))
            seen.add(_outcome(src))
    assert seen - {"ok"}, seen
    (src / ".metadata").write_bytes(os.urandom(len(data)))
    assert _outcome(src) != "ok"


def test_truncated_or_garbled_data_files_are_a_coci_error(tmp_path: Path) -> None:
    src = _small_dcp(tmp_path)
    (distcp,) = src.glob("*.distcp")
    data = distcp.read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        distcp.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError):
            read_foreign(src)
    distcp.write_bytes(os.urandom(len(data)))
    with pytest.raises(CorruptCheckpointError):
        read_foreign(src)
    outcomes = set()
    for i in range(0, len(data), 31):
        garbled = bytearray(data)
        garbled[i] ^= 0xFF
        distcp.write_bytes(bytes(garbled))
        outcomes.add(_outcome(src))
    assert outcomes - {"ok"}, outcomes


def _edit_storage(src: Path, key: str, **changes: Any) -> None:
    meta = _load_meta(src)
    index = next(i for i in meta.storage_data if i.fqn == key)
    info = meta.storage_data[index]
    fields = {
        "relative_path": info.relative_path,
        "offset": info.offset,
        "length": info.length,
        "transform_descriptors": info.transform_descriptors,
    }
    fields.update(changes)
    meta.storage_data[index] = _StorageInfo(**fields)
    _dump_meta(src, meta)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"relative_path": "../outside.distcp"}, "not a file of the directory"),
        ({"relative_path": "/etc/passwd"}, "not a file of the directory"),
        ({"relative_path": ".metadata"}, "not a file of the directory"),
        ({"relative_path": "missing.distcp"}, "cannot open"),
        ({"offset": 10**9}, "truncated"),
        ({"length": 10**9}, "truncated"),
        ({"offset": -1}, "offset"),
        ({"length": "12"}, "length"),
        ({"transform_descriptors": ["zstd/1"]}, "stream transforms"),
    ],
)
def test_storage_entries_are_checked(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    src = _small_dcp(tmp_path)
    (tmp_path / "outside.distcp").write_bytes(next(src.glob("*.distcp")).read_bytes())
    _edit_storage(src, "a.w", **changes)
    with pytest.raises(CorruptCheckpointError, match=message):
        read_foreign(src)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    src = _small_dcp(tmp_path)
    (distcp,) = src.glob("*.distcp")
    moved = tmp_path / "elsewhere.distcp"
    distcp.rename(moved)
    distcp.symlink_to(moved)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        read_foreign(src)
    distcp.unlink()
    os.mkfifo(distcp)  # opening it must not block
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        read_foreign(src)


def _edit_tensor(src: Path, key: str, size: tuple[int, ...], chunks: list[Any]) -> None:
    meta = _load_meta(src)
    entry = meta.state_dict_metadata[key]
    assert isinstance(entry, TensorStorageMetadata)
    meta.state_dict_metadata[key] = TensorStorageMetadata(
        entry.properties, torch.Size(size), chunks
    )
    _dump_meta(src, meta)


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


@pytest.mark.parametrize(
    ("size", "chunks", "message"),
    [
        ((2**40,), [_chunk((0,), (2**40,))], "needs 4398046511104 bytes"),  # 4 TB
        ((8,), [_chunk((0,), (4,))], "do not cover"),
        ((4,), [_chunk((0,), (5,))], "leaves"),
        ((4,), [_chunk((0, 0), (4, 1))], "another rank"),
        ((4,), [_chunk((1,), (4,))], "leaves"),
    ],
)
def test_tensor_sizes_are_checked_before_allocating(
    tmp_path: Path, size: tuple[int, ...], chunks: list[Any], message: str
) -> None:
    src = _small_dcp(tmp_path)
    _edit_tensor(src, "a.w", size, chunks)
    with pytest.raises(CorruptCheckpointError, match=message):
        read_foreign(src)


def test_overlapping_chunks_are_refused(tmp_path: Path) -> None:
    src = _small_dcp(tmp_path)
    meta = _load_meta(src)
    info = meta.storage_data[MetadataIndex("a.w", (0,))]
    meta.storage_data[MetadataIndex("a.w", (1,))] = info
    entry = meta.state_dict_metadata["a.w"]
    assert isinstance(entry, TensorStorageMetadata)
    meta.state_dict_metadata["a.w"] = TensorStorageMetadata(
        entry.properties, torch.Size((5,)), [_chunk((0,), (4,)), _chunk((1,), (1,))]
    )
    _dump_meta(src, meta)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        read_foreign(src)


def test_a_chunk_must_hold_what_the_metadata_says(tmp_path: Path) -> None:
    src = _small_dcp(tmp_path)
    _replace_stored(src, MetadataIndex("a.w", (0,)), _torch_saved(torch.arange(4)))  # int64
    with pytest.raises(CorruptCheckpointError, match=r"holds a torch\.int64 tensor"):
        read_foreign(src)
    _replace_stored(src, MetadataIndex("a.w", (0,)), _torch_saved({"not": "a tensor"}))
    with pytest.raises(CorruptCheckpointError, match="holds a dict"):
        read_foreign(src)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (("a", 10**9), "pads a list with 1000000001 more slots"),
        (("a", -1), "has the part"),
        ((), "nesting path"),
        ((3, "w"), "nesting path"),
        (("s", "inside"), "is also a container"),  # "a.w" first: then "s" cannot be a str
        (("l", "w"), "goes through a dict"),  # "a.w" made "l" a dict: "l.0" cannot index it
        (("l",), "goes through a value"),  # then "l.0" cannot go through the tensor
        (("s",), "same place"),
    ],
)
def test_nesting_paths_are_checked(tmp_path: Path, path: tuple[Any, ...], message: str) -> None:
    src = _small_dcp(tmp_path)
    meta = _load_meta(src)
    assert isinstance(meta.planner_data, dict)
    meta.planner_data["a.w"] = path
    _dump_meta(src, meta)
    with pytest.raises(CorruptCheckpointError, match=message):
        read_foreign(src)


def test_not_a_dcp_directory(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CociError, match=r"no \.metadata"):
        read_foreign(empty)
    (empty / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CorruptCheckpointError, match="not DCP Metadata"):
        read_foreign(empty)
    with pytest.raises(CociError, match="no such file"):
        read_foreign(tmp_path / "nothing.pt")


# -- single files: torch.save and safetensors ---------------------------------------------------


def test_torch_save_files_never_run_code(
    tmp_path: Path, marker: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "evil.pt"
    src.write_bytes(_torch_saved({"w": _Call(os.system, f"touch {marker}")}))
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        read_foreign(src)
    code, err = _import_cli(src, tmp_path, capsys)
    assert code == 2
    assert "without running code" in err
    assert not marker.exists()


def test_damaged_single_files_are_a_coci_error(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError):
            read_foreign(bad)
    bad.write_bytes(os.urandom(200))
    with pytest.raises(CorruptCheckpointError):
        read_foreign(bad)
    st = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(3)}, str(st))
    assert torch.equal(read_foreign(st)["w"], torch.ones(3))
    st.write_bytes(st.read_bytes()[:20])
    with pytest.raises(CorruptCheckpointError, match="safetensors"):
        read_foreign(st)
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    with pytest.raises(CociError, match="not a mapping"):
        read_foreign(listed)
