"""``coci import`` of crafted files: refused quickly, in little memory, with a clear error.

A crafted DCP ``.metadata`` made only of allowed classes could make the import pad lists to
millions of entries (nested list indices in planner_data: 2.4 GB from 2.3 KB), check chunks
pairwise (a [1, K] tensor in K column chunks: minutes), hash a shared tuple once per reference
while unpickling, or crash CPython hashing a deeply nested tuple; a ``torch.save`` value that
shares one list at every level describes billions of values in a kilobyte. Each crafted source
here is imported by the real CLI in a process limited to ``MEMORY_MB`` above its baseline
(``RLIMIT_AS``) and killed after ``DEADLINE_S`` (a guard, not a measurement): it must exit 2
with one line naming what is wrong and save nothing. Real DCP checkpoints, many chunks
included, import under the same limits exactly as DCP itself reads them.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from coci_core import CheckpointManager, CorruptCheckpointError
from coci_core.interop.foreign import read_foreign
from tests.adversarial.test_import import (
    _assert_same,
    _dcp_save,
    _dump_meta,
    _load_meta,
    _old_import,
    _replace_stored,
    _trained_state,
)
from tests.harness.processes import child_env, module, run

MEMORY_MB = 512
DEADLINE_S = 20

# -- crafting ----------------------------------------------------------------------------------


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def _one_tensor(src: Path) -> tuple[Metadata, TensorStorageMetadata, _StorageInfo]:
    """A real DCP directory of one 1-element tensor ``w``: its metadata, entry and storage."""
    _dcp_save({"w": torch.ones(1)}, src)
    meta = _load_meta(src)
    entry = meta.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata)
    return meta, entry, meta.storage_data[MetadataIndex("w", (0,))]


def _as_chunks(
    src: Path, size: tuple[int, ...], chunks: list[ChunkStorageMetadata], length: int = 0
) -> Path:
    """``w`` described as ``chunks`` of a tensor of ``size``, each stored where ``w`` is (its
    length recorded as ``length`` if given)."""
    meta, entry, info = _one_tensor(src)
    if length:
        info = _StorageInfo(info.relative_path, info.offset, length)
    meta.state_dict_metadata["w"] = TensorStorageMetadata(
        entry.properties, torch.Size(size), chunks
    )
    meta.storage_data = {MetadataIndex("w", c.offsets): info for c in chunks}
    _dump_meta(src, meta)
    return src


def list_indices_in_many_keys(src: Path) -> Path:
    """The issue's case: 300 values, each nested at a list index of 2**20 of its own list."""
    _dcp_save({f"k{i}": i for i in range(300)}, src)
    meta = _load_meta(src)
    meta.planner_data = {f"k{i}": ("l", i, 1 << 20) for i in range(300)}
    _dump_meta(src, meta)
    return src


def list_indices_six_levels(src: Path) -> Path:
    """The issue's second case: one value six lists deep, each list padded to 2**20."""
    _dcp_save({"a": 1}, src)
    meta = _load_meta(src)
    meta.planner_data = {"a": ("a", *[1 << 20] * 6)}
    _dump_meta(src, meta)
    return src


def huge_list_index(src: Path) -> Path:
    _dcp_save({"a": 1}, src)
    meta = _load_meta(src)
    meta.planner_data = {"a": ("a", 10**12)}
    _dump_meta(src, meta)
    return src


def column_chunks(src: Path) -> Path:
    """The issue's case: a [1, K] tensor in K column chunks (no two overlap)."""
    k = 12_000
    return _as_chunks(src, (1, k), [_chunk((0, j), (1, 1)) for j in range(k)])


def overlap_after_many_chunks(src: Path) -> Path:
    """K column chunks whose sizes add up to the tensor's; the last two overlap."""
    k = 12_000
    chunks = [_chunk((0, j), (1, 1)) for j in range(k - 3)]
    chunks += [_chunk((0, k - 3), (1, 2)), _chunk((0, k - 2), (1, 1))]
    return _as_chunks(src, (1, k), chunks)


def chunk_beyond_the_tensor(src: Path) -> Path:
    return _as_chunks(src, (4,), [_chunk((3,), (2,))])


def chunk_at_a_huge_offset(src: Path) -> Path:
    """An offset beyond int64 (a tuple: torch.Size cannot hold it)."""
    meta, entry, _ = _one_tensor(src)
    chunk = ChunkStorageMetadata(torch.Size((4,)), torch.Size((4,)))
    object.__setattr__(chunk, "offsets", (10**30,))
    meta.state_dict_metadata["w"] = TensorStorageMetadata(
        entry.properties, torch.Size((4,)), [chunk]
    )
    _dump_meta(src, meta)
    return src


def huge_shape_tiny_file(src: Path) -> Path:
    return _as_chunks(src, (1 << 40,), [_chunk((0,), (1 << 40,))])


def shape_beyond_int64(src: Path) -> Path:
    return _as_chunks(src, (1 << 62, 1 << 62), [_chunk((0, 0), (1 << 62, 1 << 62))])


def chunks_split_in_forty_dimensions(src: Path) -> Path:
    """41 chunks that tile [2]*40 exactly (a corner and the staircase around it), each
    recorded as 2**50 bytes long: checking them corner by corner would take 41 * 2**40
    steps."""
    k = 40
    chunks = [_chunk((1,) * k, (1,) * k)]
    for i in range(k):  # x_0..x_{i-1} = 1, x_i = 0, the rest anything
        chunks.append(_chunk((1,) * i + (0,) * (k - i), (1,) * (i + 1) + (2,) * (k - i - 1)))
    return _as_chunks(src, (2,) * k, chunks, length=1 << 50)


def many_keys_one_value(src: Path) -> Path:
    """20,000 keys, every one stored in the same bytes."""
    meta, _, info = _one_tensor(src)
    keys = [f"key{i}" for i in range(20_000)]
    meta.state_dict_metadata = dict.fromkeys(keys, BytesStorageMetadata())
    meta.storage_data = {MetadataIndex(key): info for key in keys}
    meta.planner_data = {key: (key,) for key in keys}
    _dump_meta(src, meta)
    return src


class _Entries:
    """Pickles as an OrderedDict filled with ``pairs``, without being one here (making it
    would hash every key, as unpickling it does)."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs

    def __reduce__(self) -> tuple[Any, ...]:
        return (OrderedDict, (), None, None, iter(self.pairs))


def keys_sharing_a_tuple_of_tuples(src: Path) -> Path:
    """10,000 planner_data keys ``(i, T)``, T a tuple of 1,000 references to one tuple of 1,000
    ints (90 KB): unpickling hashes each key, 10**10 steps."""
    meta, _, _ = _one_tensor(src)
    inner = tuple(range(1000))
    outer = (inner,) * 1000
    meta.planner_data = _Entries([((i, outer), ("w",)) for i in range(10_000)])
    _dump_meta(src, meta)
    return src


def keys_sharing_a_long_path(src: Path) -> Path:
    """20,000 keys nested by one shared 20,000-part path."""
    meta, _, info = _one_tensor(src)
    path = ["p", *range(20_000)]
    keys = [f"key{i}" for i in range(20_000)]
    meta.state_dict_metadata = dict.fromkeys(keys, BytesStorageMetadata())
    meta.storage_data = {MetadataIndex(key): info for key in keys}
    meta.planner_data = dict.fromkeys(keys, path)
    _dump_meta(src, meta)
    return src


def deeply_nested_key(src: Path) -> Path:
    """A dict whose key is a tuple nested 250,000 deep (250 KB): hashing it in C overflows
    the stack (with the usual 8 MB of it)."""
    src.mkdir()
    deep = b"\x85" * 250_000  # TUPLE1, 250,000 times
    (src / ".metadata").write_bytes(b"\x80\x04}N" + deep + b"Ns.")
    return src


def metadata_that_contains_itself(src: Path) -> Path:
    _dcp_save({"a": 1}, src)
    meta = _load_meta(src)
    loop: list[Any] = ["a"]
    loop.append(loop)
    meta.planner_data = {"a": loop}
    _dump_meta(src, meta)
    return src


def _shared_at_every_level(levels: int) -> list[Any]:
    node: list[Any] = [1]
    for _ in range(levels):
        node = [node, node]
    return node


def shared_list_in_a_pt_file(src: Path) -> Path:
    """1.3 KB of torch.save that describe 2**22 values."""
    torch.save({"dag": _shared_at_every_level(22)}, src)
    return src


def shared_list_in_a_dcp_value(src: Path) -> Path:
    """The same list in torch.save's legacy format: its pickles are measured alike."""
    _dcp_save({"w": torch.ones(1), "v": 0}, src)
    buffer = io.BytesIO()
    torch.save(_shared_at_every_level(22), buffer, _use_new_zipfile_serialization=False)
    _replace_stored(src, MetadataIndex("v"), buffer.getvalue())
    return src


def _torch_saved_deep_key(depth: int) -> bytes:
    """A torch.save zip whose pickle is a dict with a tuple key nested ``depth`` deep."""
    buffer = io.BytesIO()
    torch.save({"a": 1}, buffer)
    reader = torch._C.PyTorchFileReader(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    for name in reader.get_all_records():
        data = reader.get_record(name)
        if name == "data.pkl":
            data = b"\x80\x02}K\x01" + b"\x85" * depth + b"K\x01s."
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def deeply_nested_key_in_a_pt_file(src: Path) -> Path:
    """torch.load(weights_only=True) hashes the key in C: the stack overflows."""
    src.write_bytes(_torch_saved_deep_key(200_000))
    return src


def deeply_nested_key_in_a_dcp_value(src: Path) -> Path:
    _dcp_save({"w": torch.ones(1), "v": 0}, src)
    _replace_stored(src, MetadataIndex("v"), _torch_saved_deep_key(200_000))
    return src


_DEEP_KEY_PICKLE = b"\x80\x02}K\x01" + b"\x85" * 200_000 + b"K\x01s."


def _legacy_with_deep_key() -> bytes:
    """torch.save's legacy (non-zip) format, its object a dict keyed by a 200,000-deep tuple:
    its five pickles, of which torch.load unpickles each."""
    buffer = io.BytesIO()
    torch.save({"a": 1}, buffer, _use_new_zipfile_serialization=False)
    stream = io.BytesIO(buffer.getvalue())
    head = [pickle.load(stream) for _ in range(3)]  # magic number, protocol, system info
    return b"".join(pickle.dumps(v, protocol=2) for v in head) + _DEEP_KEY_PICKLE + b"]."


def deeply_nested_key_in_a_legacy_pt_file(src: Path) -> Path:
    """No zip to measure: before, torch.load's legacy loader hashed the key (SIGSEGV)."""
    src.write_bytes(_legacy_with_deep_key())
    return src


def deeply_nested_key_as_the_first_pickle_of_a_pt_file(src: Path) -> Path:
    """A bare pickle: the legacy loader unpickles it as the magic number."""
    src.write_bytes(_DEEP_KEY_PICKLE)
    return src


def deeply_nested_key_in_a_legacy_dcp_value(src: Path) -> Path:
    _dcp_save({"w": torch.ones(1), "v": 0}, src)
    _replace_stored(src, MetadataIndex("v"), _legacy_with_deep_key())
    return src


# what each crafted source makes the CLI say (a regex of its one line)
CRAFTED: dict[str, tuple[Callable[[Path], Path], str]] = {
    "list indices in many keys": (list_indices_in_many_keys, r"pads a list with 1048577 more"),
    "list indices six levels": (list_indices_six_levels, r"pads a list with 1048577 more"),
    "huge list index": (huge_list_index, r"pads a list with 1000000000001 more slots"),
    "column chunks": (column_chunks, r"storage_data records 'w' at bytes .* inside the bytes"),
    "overlap after many chunks": (overlap_after_many_chunks, r"two chunks of 'w' overlap"),
    "chunk beyond the tensor": (chunk_beyond_the_tensor, r"a chunk of 'w' at \[3\] .* leaves"),
    "chunk at a huge offset": (chunk_at_a_huge_offset, r"chunk offset of 'w' is not a shape"),
    "huge shape, tiny file": (huge_shape_tiny_file, r"needs 4398046511104 bytes"),
    "shape beyond int64": (shape_beyond_int64, r"the size of 'w' has more than 2\*\*63-1"),
    "chunks split in forty dimensions": (
        chunks_split_in_forty_dimensions,
        r"the 41 chunks of 'w' tile it takes \d+ steps \(they split 40 of its dimensions\)",
    ),
    "many keys, one value": (many_keys_one_value, r"storage_data records '.*' at bytes"),
    "keys sharing a tuple of tuples": (
        keys_sharing_a_tuple_of_tuples,
        r"\.metadata describes a tree of more than \d+ objects",
    ),
    "keys sharing a long path": (
        keys_sharing_a_long_path,
        r"\.metadata describes a tree of more than \d+ objects",
    ),
    "deeply nested key": (deeply_nested_key, r"nests objects 250\d\d\d levels deep"),
    "metadata that contains itself": (metadata_that_contains_itself, r"refers to itself"),
    "shared list in a .pt file": (
        shared_list_in_a_pt_file,
        r"its pickle describes a tree of more than \d+ objects",
    ),
    "shared list in a DCP value": (
        shared_list_in_a_dcp_value,
        r"the value at 'v' cannot be read: its pickle describes a tree of more than \d+ objects",
    ),
    "deeply nested key in a .pt file": (
        deeply_nested_key_in_a_pt_file,
        r"cannot be read: its pickle nests objects 200\d\d\d levels deep",
    ),
    "deeply nested key in a DCP value": (
        deeply_nested_key_in_a_dcp_value,
        r"the value at 'v' cannot be read: its pickle nests objects 200\d\d\d levels deep",
    ),
    "deeply nested key in a legacy .pt file": (
        deeply_nested_key_in_a_legacy_pt_file,
        r"cannot be read: its pickle nests objects 200\d\d\d levels deep",
    ),
    "deeply nested key as the first pickle of a .pt file": (
        deeply_nested_key_as_the_first_pickle_of_a_pt_file,
        r"cannot be read: its pickle nests objects 200\d\d\d levels deep",
    ),
    "deeply nested key in a legacy DCP value": (
        deeply_nested_key_in_a_legacy_dcp_value,
        r"the value at 'v' cannot be read: its pickle nests objects 200\d\d\d levels deep",
    ),
}

# -- real DCP checkpoints, imported under the same limits --------------------------------------


def _grid_of_chunks(src: Path, rows: list[int], cols: list[int]) -> torch.Tensor:
    """A tensor saved by DCP as one value per block of a grid (``rows`` x ``cols`` block
    sizes), then described as one tensor of those chunks: DCP wrote every byte, and its own
    reader assembles the tensor from the chunks."""
    full = torch.randn(sum(rows), sum(cols), generator=torch.Generator().manual_seed(5))
    blocks, at = {}, {}
    for i, (r0, r) in enumerate(zip(_starts(rows), rows, strict=True)):
        for j, (c0, c) in enumerate(zip(_starts(cols), cols, strict=True)):
            blocks[f"b{i}_{j}"] = full[r0 : r0 + r, c0 : c0 + c].clone()
            at[f"b{i}_{j}"] = ((r0, c0), (r, c))
    _dcp_save(blocks, src)
    meta = _load_meta(src)
    first = meta.state_dict_metadata["b0_0"]
    assert isinstance(first, TensorStorageMetadata)
    storage = {
        MetadataIndex("w", offsets): meta.storage_data[MetadataIndex(key, (0, 0))]
        for key, (offsets, _) in at.items()
    }
    chunks = [_chunk(offsets, sizes) for offsets, sizes in at.values()]
    meta.state_dict_metadata = {
        "w": TensorStorageMetadata(first.properties, torch.Size(full.shape), chunks)
    }
    meta.storage_data = storage
    meta.planner_data = {"w": ("w",)}
    _dump_meta(src, meta)
    return full


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def real_optimizer_state(src: Path) -> Path:
    return _dcp_save(_trained_state(), src)


def real_lists_with_gaps(src: Path) -> Path:
    """DCP nests list items by index; an empty dict in a list is no key (a None slot)."""
    state = {"l": [torch.ones(2), {}, torch.zeros(3), {"x": [torch.ones(1), 5]}], "n": 7}
    return _dcp_save(state, src)


def two_thousand_column_chunks(src: Path) -> Path:
    _grid_of_chunks(src, [3], [1] * 2000)
    return src


def grid_of_two_thousand_chunks(src: Path) -> Path:
    _grid_of_chunks(src, [2, 1, 3] * 13 + [4], [1, 2] * 25)
    return src


def _lists_with_gaps_as_nested(src: Path) -> dict[str, Any]:
    """What DCP's nesting paths give (DCP's own reader refuses the gap: "Missing key")."""
    nested = {"x": [torch.ones(1), 5]}
    return {"l": [torch.ones(2), None, torch.zeros(3), nested], "n": 7}


# each real checkpoint, and what its import must restore
REAL: dict[str, tuple[Callable[[Path], Path], Callable[[Path], dict[str, Any]]]] = {
    "optimizer state": (real_optimizer_state, _old_import),
    "lists with gaps": (real_lists_with_gaps, _lists_with_gaps_as_nested),
    "2000 column chunks": (two_thousand_column_chunks, _old_import),
    "grid of 2000 chunks": (grid_of_two_thousand_chunks, _old_import),
}

# -- running the imports -----------------------------------------------------------------------


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


@pytest.fixture(scope="module")
def imports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every source crafted and real, imported by ``coci import`` under the limits."""
    root = tmp_path_factory.mktemp("bombs")
    cases = []
    makers = {name: make for name, (make, _) in (CRAFTED | REAL).items()}
    for name, make in makers.items():
        suffix = ".pt" if name.endswith(".pt file") else ""
        src = make(root / f"{_slug(name)}{suffix}")
        cases.append({"name": name, "src": str(src), "dst": str(root / f"{_slug(name)}-coci")})
    cfg = {"cases": cases, "memory_mb": MEMORY_MB, "deadline_s": DEADLINE_S}
    proc = run(
        module("tests.adversarial._import_child", json.dumps(cfg)),
        env=child_env({"OMP_NUM_THREADS": "1"}),
        timeout_s=60 + len(cases) * (DEADLINE_S + 5),
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            result = json.loads(line[len("CASE ") :])
            case = next(c for c in cases if c["name"] == result["name"])
            results[result["name"]] = {**result, **case}
    assert proc.returncode == 0 and len(results) == len(cases), proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_source_is_refused_in_bounded_memory_and_time(
    imports: dict[str, dict[str, Any]], name: str
) -> None:
    """Exit status 2, one line ``coci: <source>: ...`` naming what is wrong, nothing saved:
    not a MemoryError, a crash, a kill by the deadline or a 31 MB manifest of None."""
    result = imports[name]
    lines = result["stderr"].splitlines()
    assert result["status"] == 2, (result["status"], result["stderr"][-2000:])
    assert len(lines) == 1 and lines[0].startswith(f"coci: {result['src']}"), lines
    assert_matches(CRAFTED[name][1], lines[0])
    assert not Path(result["dst"]).exists()


def assert_matches(pattern: str, line: str) -> None:
    assert re.search(pattern, line), f"{pattern!r} not in {line!r}"


@pytest.mark.parametrize("name", list(REAL))
def test_a_real_dcp_checkpoint_imports_as_dcp_reads_it(
    imports: dict[str, dict[str, Any]], name: str
) -> None:
    """Under the same limits, real DCP checkpoints (thousands of chunks, lists with gaps,
    optimizer states) import and restore exactly as DCP's own reader gives them."""
    result = imports[name]
    assert result["status"] == 0, result["stderr"][-2000:]
    assert result["stdout"].startswith(f"imported {result['src']} into")
    with CheckpointManager(result["dst"]) as mgr:
        restored = mgr.restore()
    _assert_same(restored, REAL[name][1](Path(result["src"])))


# -- the tiling check itself: exact, whatever the layout ---------------------------------------


def _brute_force_tiles(
    size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> bool:
    count = torch.zeros(size, dtype=torch.int32)
    for offsets, sizes in boxes:
        count[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))] += 1
    return bool((count == 1).all())


def _random_tiling(
    g: torch.Generator, size: tuple[int, ...], depth: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A random guillotine tiling of ``size``: split a box along a random dimension, recurse."""
    boxes = [((0,) * len(size), size)]
    for _ in range(depth):
        i = int(torch.randint(len(boxes), (1,), generator=g))
        offsets, sizes = boxes[i]
        d = int(torch.randint(len(size), (1,), generator=g))
        if sizes[d] < 2:
            continue
        cut = int(torch.randint(1, sizes[d], (1,), generator=g))
        left = (*sizes[:d], cut, *sizes[d + 1 :])
        right_off = (*offsets[:d], offsets[d] + cut, *offsets[d + 1 :])
        right = (*sizes[:d], sizes[d] - cut, *sizes[d + 1 :])
        boxes[i : i + 1] = [(offsets, left), (right_off, right)]
    return boxes


def _moved(
    g: torch.Generator, size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """One box moved to another place inside the tensor (sizes still add up)."""
    boxes = list(boxes)
    i = int(torch.randint(len(boxes), (1,), generator=g))
    sizes = boxes[i][1]
    offsets = (
        int(torch.randint(s - n + 1, (1,), generator=g)) for s, n in zip(size, sizes, strict=True)
    )
    boxes[i] = (tuple(offsets), sizes)
    return boxes


def test_the_tiling_check_agrees_with_counting_every_element() -> None:
    """On random tilings (up to four dimensions, up to 60 chunks) and on the same tilings with
    one chunk moved, the corner check accepts exactly what counting each element accepts."""
    # here, not at the top: the rest of this module also runs against a coci without them
    from coci_core.interop.allowance import Allowance
    from coci_core.interop.dcp import check_tiling

    g = torch.Generator().manual_seed(28)
    seen = {True: 0, False: 0}
    for trial in range(400):
        size = tuple(int(n) for n in torch.randint(1, 7, (1 + trial % 4,), generator=g))
        boxes = _random_tiling(g, size, depth=trial % 60)
        if trial % 2:
            boxes = _moved(g, size, boxes)
        want = _brute_force_tiles(size, boxes)
        if want:
            check_tiling("w", size, boxes, Allowance.of_read(0, "src"))
        else:
            with pytest.raises(CorruptCheckpointError, match="overlap"):
                check_tiling("w", size, boxes, Allowance.of_read(0, "src"))
        seen[want] += 1
    assert seen[True] > 100 and seen[False] > 50, seen


def test_read_foreign_refuses_what_the_cli_refuses(tmp_path: Path) -> None:
    """The library entry point (not only the CLI) refuses a crafted source."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = list_indices_six_levels(tmp_path / "six")
    with pytest.raises(CorruptCheckpointError, match="pads a list with 1048577 more slots"):
        read_foreign(src)
    src = shared_list_in_a_pt_file(tmp_path / "dag.pt")
    with pytest.raises(CorruptCheckpointError, match="tree of"):
        read_foreign(src)


# -- the measure of a pickle: the tree it describes, never built -------------------------------


def _tree(value: Any) -> tuple[int, int]:
    """Size (1 per object, strings and bytes 1 + their length) and depth of ``value`` walked
    as a tree: each shared reference walked again."""
    if isinstance(value, (str, bytes)):
        return 1 + len(value), 1
    if isinstance(value, dict):
        parts = [_tree(x) for item in value.items() for x in item]
    elif isinstance(value, (list, tuple)):
        parts = [_tree(x) for x in value]
    else:
        return 1, 1
    return 1 + sum(size for size, _ in parts), 1 + max((depth for _, depth in parts), default=0)


def test_pickle_tree_measures_the_tree_a_pickle_describes() -> None:
    """For plain data written with every pickle protocol, the measure read from the opcodes is
    the size and depth of the value walked as a tree, shared references counted each time;
    a reference cycle is an endless tree."""
    from coci_core.engine.format.pickle_tree import pickle_tree

    shared = ["abc", 2.5, (1, None)]
    deep: list[Any] = [shared, {"k": [shared, shared]}]
    for _ in range(6):
        deep = [deep, deep, {"x": deep}]
    values: list[Any] = [
        {"a": [1, 2, 3], "b": ("x", "yz"), "c": {"d": {}}, "e": [], "f": ()},
        [True, False, None, 10**30, -7, 2**31, "é" * 40],
        {(1, "t"): shared, "same": shared, "again": [shared, shared]},
        deep,
    ]
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        for value in values:
            want = _tree(value)
            got = pickle_tree(pickle.dumps(value, protocol=protocol), cap=10**9)
            assert (got.size, got.depth) == want, (protocol, value)
        assert pickle_tree(pickle.dumps(b"\x00" * 9, protocol=max(protocol, 3)), cap=99).size == 10
        loop: list[Any] = [1]
        loop.append({"back": loop})
        assert pickle_tree(pickle.dumps(loop, protocol=protocol), cap=1000).size == 1001
    big = pickle.dumps(deep)
    assert _tree(deep)[0] > 100 * len(big)  # what the measure is for
    assert pickle_tree(big, cap=len(big)).size == len(big) + 1  # stopped at the cap


@pytest.mark.parametrize("data", [b"c\\\xa4 x\nmod\n.", b"S'\\\xa4'\n."], ids=["global", "string"])
def test_a_garbled_escape_in_a_pickle_string_is_damage_where_warnings_are_errors(
    data: bytes,
) -> None:
    """Random bytes in a legacy pickle (a garbled DCP data file) held a string opcode with an
    invalid escape: Python warns (DeprecationWarning), and where warnings are errors the import
    raised that warning instead of coci's damage error (found by a CI run of the fuzz test)."""
    from coci_core.engine.format.pickle_tree import pickle_tree_from

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="a string in the pickle is garbled"):
            pickle_tree_from(io.BytesIO(data), lambda n: 10**6)
