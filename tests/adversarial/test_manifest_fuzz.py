"""A seeded fuzzer of committed checkpoints: damaged and crafted manifests and data.

Two real runs are saved with a real CheckpointManager: a rich state written raw (nested dicts,
an int-keyed and a tuple-keyed dict, an OrderedDict, a tied tensor, ten dtypes, an empty and a
0-d tensor, an ndarray, numpy and Python scalars, strings, bytes, tuples, a torch.Size, a dtype,
an infinite float, per-rank state with a long list of ints, ``random.getstate()``'s, stored as
an ``ints`` node) and a lossless run whose step 2 is a delta against step 1
(XOR and chunk-incremental pieces with a base). Then, in a fresh copy of a run per case:

- ``crafted``: a structured mutation of one field of the newest manifest (every kind of field:
  wrong JSON types, negative, huge, 2**40, 2**62, 2**63-1, 2**63, 2**64, NaN, 100,000-deep
  nesting, NUL and ``../`` names, other dtype names, swapped ids, removed fields, extra fields),
  with the checksum recomputed: validation alone must refuse it (or it must be harmless);
- ``damaged``: the same mutations and semantic ones (a scalar changed, a dtype of the same size,
  a list made a tuple, ...) with the checksum left as it was: the checksum must refuse them;
- ``manifest-bytes`` / ``data-bytes``: random byte edits of the manifest / of a data file;
- ``file-kind``: a data file or the manifest replaced by a FIFO, a symlink to /dev/zero, a
  directory, truncated or extended; the lossless run's base step damaged too.

A crafted manifest that is *consistent* describes another checkpoint, which no reader can tell
from a real one (a scalar changed, a dtype of the same size, a different alias, a list made a
tuple...): such mutations are only made in the ``damaged`` mode, where the checksum must refuse
them; ``crafted`` mutations change fields whose every other value is refused or harmless.

For every case: ``CheckpointManager(dir).restore()`` returns exactly the state saved at the step
it reports (the newest step when the case did not touch it or its base, else the newest intact
older step), or CorruptCheckpointError when every step was touched; ``restore(step=newest)``
(``load_checkpoint``) returns exactly the saved state or raises CorruptCheckpointError;
``verify_checkpoint`` agrees with it; nothing else is raised, nothing hangs (pytest-timeout),
and no buffer beyond the checkpoint's limits is allocated. After a change of a step or a commit
sequence, a save of the next step is committed and restored exactly by a resume, or fails loudly
(after a record at the highest sequence): a forged record never poisons later saves. Counts are
printed (``-s``) and written as JSON to ``$COCI_FUZZ_REPORT`` when set.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import random
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import BackgroundSaveError, CheckpointManager, CorruptCheckpointError
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.restore import read as restore
from coci_core.engine.restore.restore import load_checkpoint, verify_checkpoint
from coci_core.storage import LocalStorage
from tests.adversarial.craft import encode_doc, manifest_path, read_doc, same, write_doc

SEED = 20240614
NAN, DEEP = "\u0000raw-nan\u0000", "\u0000raw-deep\u0000"
RAW = {NAN: "NaN", DEEP: "[" * 100_000 + "]" * 100_000}
ZSTD_MAX_RATIO = 32768


# --- the runs ------------------------------------------------------------------------------


def rich_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(4, 8, generator=g)
    return {
        "model": OrderedDict(
            [("linear.weight", w), ("linear.bias", torch.randn(8, generator=g)), ("tied", w)]
        ),
        "half": torch.randn(5, generator=g).to(torch.float16),
        "bf16": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "ints": torch.arange(10, dtype=torch.int64) * step,
        "i16": torch.arange(4, dtype=torch.int16) - step,
        "mask": torch.tensor([True, False, step % 2 == 0]),
        "cplx": torch.randn(2, dtype=torch.complex64, generator=g),
        "u8": torch.arange(7, dtype=torch.uint8),
        "f64": torch.randn(2, 2, dtype=torch.float64, generator=g),
        "scalar": torch.tensor(float(step)),
        "empty": torch.empty(0, 3),
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3) + step,
        "np_scalar": np.float32(0.5 * step),
        "optim": {
            "state": {0: {"step": step, "exp_avg": torch.randn(4, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "by_pair": {(1, "a"): step, (2, ("b", None)): -step},
        "epoch": step,
        "loss": 0.25 * step,
        "inf": float("inf"),
        "name": f"run-{step}",
        "blob": bytes([step, 0, 255]),
        "pair": (step, "x", None),
        "size": torch.Size([2, step]),
        "dtype": torch.float16,
        "flag": True,
    }


def rank_state(step: int) -> dict[str, Any]:
    return {
        "rng": torch.arange(4, dtype=torch.uint8) + step,
        "seed": step,
        "python": random.Random(step).getstate(),  # an "ints" node (format 5)
    }


def delta_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g)
    return {
        "w": w + 1e-3 * step,
        "ids": torch.arange(2048) * step,
        "emb": torch.randn(64, 64, generator=torch.Generator().manual_seed(step)),
        "small": torch.ones(3),
        "epoch": step,
    }


def boxes_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + step)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.arange(4.0) * step, "epoch": step}


# a 2x2 grid of uneven boxes of "w" (6x5), as a DTensor split over both dims of a mesh stores it
BOXES = [((0, 0), (3, 3)), ((0, 3), (3, 2)), ((3, 0), (3, 3)), ((3, 3), (3, 2))]


def as_boxes(w: torch.Tensor) -> torch.Tensor:
    """The bytes of ``w`` as its BOXES store them: each box's own row-major bytes in turn."""
    return torch.cat([w[a : a + m, b : b + n].reshape(-1) for (a, b), (m, n) in BOXES])


@dataclass
class Run:
    name: str
    root: Path
    states: dict[int, dict[str, Any]]  # the full state restore returns, per step
    bases: dict[int, tuple[int, ...]]  # steps each step needs


def save_runs(root: Path) -> list[Run]:
    runs = []
    raw = Run("raw", root / "raw", {}, {1: (), 2: ()})
    with CheckpointManager(raw.root, keep_last=None, compression="none") as mgr:
        for step in (1, 2):
            mgr.save(step, rich_state(step), per_rank=rank_state(step)).wait()
            raw.states[step] = rich_state(step) | rank_state(step)
    runs.append(raw)
    lossless = Run("lossless", root / "lossless", {}, {1: (), 2: (1,)})
    with CheckpointManager(lossless.root, keep_last=None, compression="lossless") as mgr:
        for step in (1, 2):
            mgr.save(step, delta_state(step)).wait()
            lossless.states[step] = delta_state(step)
    codecs = {
        (p["params"] or {}).get("codec")
        for t in read_doc(lossless.root, 2)["tensors"]
        for p in t["pieces"]
    }
    assert {"coci.xor-zstd/1", "coci.chunks/1"} <= codecs
    assert read_doc(lossless.root, 2)["bases"] == [1]
    runs.append(lossless)
    # an array stored as boxes (format 4): saved as its boxes' bytes, the manifest then made to
    # say so (what four ranks of a 2x2 mesh write, in one process)
    boxes = Run("boxes", root / "boxes", {}, {1: (), 2: ()})
    with CheckpointManager(boxes.root, keep_last=None, compression="none") as mgr:
        for step in (1, 2):
            state = boxes_state(step)
            mgr.save(step, {**state, "w": as_boxes(state["w"])}).wait()
            boxes.states[step] = state
    for step in (1, 2):
        doc = read_doc(boxes.root, step)
        (entry,) = (t for t in doc["tensors"] if t["key"] == "/w")
        entry["shape"] = [6, 5]
        entry["boxes"] = [[list(o), list(n)] for o, n in BOXES]
        doc["format_version"] = 4
        doc["world_size"] = 4
        write_doc(boxes.root, step, doc)
    runs.append(boxes)
    return runs


# --- mutations of a manifest's JSON -----------------------------------------------------------

Path_ = tuple[Any, ...]


@dataclass(frozen=True)
class Mutation:
    """One change to a manifest document: set ``path`` to ``value``, delete it, add a field,
    or an arbitrary edit (``apply``)."""

    kind: str  # what sort of field: for stratified sampling and the report
    label: str
    path: Path_ = ()
    value: Any = None
    op: str = "set"  # "set", "delete", "add", "apply"
    apply: Callable[[dict[str, Any]], None] | None = field(default=None, compare=False)

    def __call__(self, doc: dict[str, Any]) -> None:
        if self.op == "apply":
            assert self.apply is not None
            self.apply(doc)
            return
        if self.op == "add":
            get(doc, self.path)["zzz_extra"] = 1
            return
        parent = get(doc, self.path[:-1])
        last = self.path[-1]
        if self.op == "delete":
            del parent[last]
        else:
            parent[last] = copy.deepcopy(self.value)


def get(doc: Any, path: Path_) -> Any:
    for k in path:
        doc = doc[k]
    return doc


INT_BAD: list[Any] = ["7", 1.5, True, None, [], {}, -1, 2**40, 2**63, 2**64, NAN, DEEP]
# integers at and beyond the bounds of steps and commit sequences (a step is at most 2**63-1)
INT_EDGES: list[Any] = [2**63 - 1, -(2**63), 10**30, 1 << 4000]
STR_BAD: list[Any] = [5, None, [], {}, "", "a\x00b", "../x", "x" * 300, NAN, DEEP]
NAME_BAD: list[Any] = [
    *STR_BAD,
    "data-r1.bin",
    "manifest.json",
    "..",
    "/etc/passwd",
    "data\x00r0.bin",
    "dätä.bin",
]
ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def numel(shape: list[Any]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mutations(doc: dict[str, Any], *, crafted: bool) -> list[Mutation]:
    """Every mutation of the manifest ``doc``. ``crafted``: only those whose result is
    invalid or harmless (see the module docstring); otherwise also the semantic ones."""
    out: list[Mutation] = []

    def add(kind: str, path: Path_, values: list[Any]) -> None:
        old = get(doc, path)
        for v in values:
            if type(v) is not type(old) or v != old:
                out.append(Mutation(kind, f"{'.'.join(map(str, path))}={_short(v)}", path, v))

    def structure(kind: str, path: Path_, *, consistent: tuple[str, ...] = ()) -> None:
        """Fields added and removed; removing one of ``consistent`` (an array's boxes: its
        bytes then read as the whole array's) describes another checkpoint, so is made only
        when not ``crafted``."""
        obj = get(doc, path)
        out.append(Mutation(kind + "+extra", f"{_dotted(path)}+zzz", path, op="add"))
        for key in obj:
            if crafted and key in consistent:
                continue
            out.append(
                Mutation(kind + "-field", f"{_dotted(path)}-{key}", (*path, key), op="delete")
            )

    structure("top", ())
    add("version", ("format_version",), [2, 1, 4, "3", None])
    add("step", ("step",), [*INT_BAD, *INT_EDGES, 1, 3])
    add("time", ("created_unix",), [*INT_BAD, 0.0, 1e300, -5.0, 1e9])
    # the commit order: any valid value (at most 2**62) only reorders (harmless), the rest is
    # refused; a save after it must be committed readable, or fail loudly (see save_after)
    add("sequence", ("sequence",), [*INT_BAD, *INT_EDGES, 0, 1, 2**62, 2**62 + 1])
    add("token", ("token",), [*STR_BAD, "other"])
    add("world", ("world_size",), [*INT_BAD, 0, 2, 2**20 + 1])
    add("metadata", ("metadata",), [*STR_BAD, {"a": NAN}, {"a": [DEEP]}, {"a": 1}])
    add("bases", ("bases",), ["x", None, [-1], ["1"], [doc["step"]], [2**63], [0], []])
    for i, _ in enumerate(doc["files"]):
        structure("file", ("files", i))
        add("file-name", ("files", i, "name"), NAME_BAD)
        add("file-size", ("files", i, "nbytes"), [*INT_BAD, 0, 10**30])
    add("files", ("files",), ["x", None, [], {}])
    entries = [("tensors", i) for i in range(len(doc["tensors"]))]
    for r, rank in enumerate(doc.get("per_rank", [])):
        entries += [("per_rank", r, "tensors", i) for i in range(len(rank["tensors"]))]
        structure("rank", ("per_rank", r))
        add("rank-tree", ("per_rank", r, "tree"), ["x", 5, [], {"t": "evil"}, DEEP])
    add("tensors", ("tensors",), ["x", None, {}])
    for path in entries:
        entry = get(doc, path)
        structure("entry", path, consistent=("boxes",))
        add("entry-key", (*path, "key"), [*STR_BAD, "/other"])
        add("entry-kind", (*path, "kind"), ["tensor", "ndarray", "torch_save", "pickle", 5, None])
        size = ITEMSIZE.get(entry["dtype"])
        # a dtype of another size changes the array's size, unless it is empty (no bytes:
        # then its dtype is only in the manifest, and another one is valid)
        other = [d for d, s in ITEMSIZE.items() if s != size and numel(entry["shape"])]
        same_size = [d for d, s in ITEMSIZE.items() if s == size and d != entry["dtype"]]
        add("entry-dtype", (*path, "dtype"), [*STR_BAD, *other[:4], "object", "<U1", "float128"])
        if not crafted:
            add("entry-dtype", (*path, "dtype"), same_size[:2])
        add("entry-codec", (*path, "codec"), ["evil/1", "coci.zstd/1", "mixed", 5, None])
        add(
            "entry-numpy-dtype",
            (*path, "numpy_dtype"),
            ["O", "V8", ">f4", "<f8", "<i4", "[('x', '<f4')]", None, 5],
        )
        shape = entry["shape"]
        add("entry-shape", (*path, "shape"), ["x", None, [-1], [2**40], [2**63], [1] * 65, [[1]]])
        if not crafted and numel(shape) > 1:
            add("entry-shape", (*path, "shape"), [[numel(shape)]])  # a reshape
        for j, d in enumerate(shape):
            for v in [*INT_BAD, d + 1, 0, 2**40, 2**63]:
                new = list(shape)
                new[j] = v
                if crafted and type(v) is int and v >= 0 and numel(new) == numel(shape):
                    continue  # same size: a valid reshape
                add("entry-dim", (*path, "shape", j), [v])
        add("entry-pieces", (*path, "pieces"), ["x", None, [], {}])
        if "boxes" in entry:
            out += box_mutations(entry, (*path, "boxes"), crafted=crafted)
        for k, piece in enumerate(entry["pieces"]):
            pp = (*path, "pieces", k)
            structure("piece", pp)
            add("piece-file", (*pp, "file"), NAME_BAD)
            for name in ("offset", "nbytes", "start", "length", "crc32c"):
                v = piece[name]
                add(f"piece-{name}", (*pp, name), [*INT_BAD, v + 1, max(v - 1, 0), v + 64])
            params = piece["params"]
            if params is None:
                add("piece-params", (*pp, "params"), ["x", 5, [], {"codec": "coci.zstd/1"}])
                continue
            nulls = [None] if piece["nbytes"] != piece["length"] else []
            add("piece-params", (*pp, "params"), ["x", 5, [], {}, *nulls])
            for key, v in params.items():
                bad: list[Any] = [*INT_BAD[:6], "x", -1, 2**63]
                if type(v) is int and not isinstance(v, bool):
                    bad += [v + 1, max(v - 1, 0), 2**40]
                if isinstance(v, bool):
                    bad += [not v]
                if type(v) is str:
                    bad += [v[:-1] + ("0" if v[-1:] != "0" else "1"), "coci.zstd/1", ""]
                add(f"param-{key}", (*pp, "params", key), bad)
                if type(v) is dict:
                    for ikey in v:
                        add(f"param-inner-{ikey}", (*pp, "params", key, ikey), INT_BAD[:6])
            out.append(
                Mutation("param+extra", f"{_dotted(pp)}.params+zzz", (*pp, "params"), op="add")
            )
    trees = [("tree",)] + [("per_rank", r, "tree") for r in range(len(doc.get("per_rank", [])))]
    for root in trees:
        out += tree_mutations(doc, root, crafted=crafted)
    # swapped ids of two first occurrences, and of two entries
    for root in trees:
        leaves = [p for p, node in walk_tree(get(doc, root), root) if _is_leaf(node)]
        for a, b in itertools.pairwise(leaves):
            if get(doc, (*a, "id")) != get(doc, (*b, "id")):
                out.append(_swap("swap-ids", a, b, "id"))
    if len(doc["tensors"]) > 1:
        out.append(
            Mutation(
                "swap-entries",
                "tensors[0]<->tensors[1]",
                op="apply",
                apply=lambda d: d["tensors"].__setitem__(
                    slice(0, 2), [d["tensors"][1], d["tensors"][0]]
                ),
            )
        )
    return out


def box_mutations(entry: dict[str, Any], path: Path_, *, crafted: bool) -> list[Mutation]:
    """Mutations of an entry's boxes: wrong types, a box outside the array, empty, out of
    order, a count or volume that differs, and boxes that overlap with the right volume (left
    for the read to find); with ``crafted`` False also another valid tiling (another
    checkpoint, which only the checksum can tell)."""
    boxes = entry["boxes"]
    values: list[Any] = ["x", None, {}, [], [[[0, 0]]], [[0, 0], [6, 5]], boxes[:-1]]
    values += [
        [boxes[1], boxes[0], *boxes[2:]],  # out of order
        [boxes[0], boxes[0], *boxes[1:]],  # repeated
        [[[0, 0], [3, 3]], [[0, 3], [3, 3]], *boxes[2:]],  # outside the array
        [[[0, 0], [0, 3]], *boxes[1:]],  # empty
        [[[0, 0], [3, 3]], [[0, 2], [3, 3]], [[3, 0], [3, 3]], [[3, 3], [3, 1]]],  # overlap
        [[[0, 0], [6, 5], [0]]],
    ]
    if not crafted:
        values.append([[[0, 0], [6, 5]]])  # the same bytes read as the whole array
    out = [Mutation("boxes", f"{_dotted(path)}={_short(v)}", path, v) for v in values]
    for b, box in enumerate(boxes):
        for part in (0, 1):
            for j, v in enumerate(box[part]):
                for bad in [*INT_BAD, v + 1, max(v - 1, 0)]:
                    if bad != v or type(bad) is not int:
                        label = f"{_dotted(path)}[{b}][{part}][{j}]={_short(bad)}"
                        out.append(Mutation("box-dim", label, (*path, b, part, j), bad))
    return out


def _swap(kind: str, a: Path_, b: Path_, key: str) -> Mutation:
    def apply(d: dict[str, Any]) -> None:
        x, y = get(d, a), get(d, b)
        x[key], y[key] = y[key], x[key]

    return Mutation(kind, f"{_dotted(a)}<->{_dotted(b)}", op="apply", apply=apply)


def _is_leaf(node: Any) -> bool:
    return type(node) is dict and node.get("t") in ("tensor", "ndarray", "torch_save")


def walk_tree(node: Any, path: Path_) -> Iterator[tuple[Path_, Any]]:
    stack = [(path, node)]
    while stack:
        p, n = stack.pop()
        yield p, n
        if type(n) is dict:
            for k, v in n.items():
                if k != "t":
                    stack.append(((*p, k), v))
        elif type(n) is list:
            stack.extend(((*p, i), v) for i, v in enumerate(n))


def tree_mutations(doc: dict[str, Any], root: Path_, *, crafted: bool) -> list[Mutation]:
    out: list[Mutation] = []
    seen: set[int] = set()
    tree = get(doc, root)
    nodes = list(walk_tree(tree, root))
    # first occurrences come first in flattening order, which walk_tree does not keep: find
    # the alias nodes as the later of two nodes with one id (by flattening order = JSON order)
    order = [p for p, n in _json_order(tree, root) if _is_leaf(n)]
    aliases = set()
    for p in order:
        i = get(doc, p)["id"]
        if i in seen:
            aliases.add(p)
        seen.add(i)
    for path, node in nodes:
        if type(node) is dict and "t" in node:
            tag = node["t"]
            kind = f"node-{tag}"
            bad_tags: list[Any] = ["pickle", "", 5, None, "TENSOR"]
            if tag in ("tensor", "ndarray", "torch_save"):
                bad_tags += [t for t in ("tensor", "ndarray", "torch_save") if t != tag]
            elif not crafted:
                bad_tags += {"list": ["tuple"], "tuple": ["list"], "dict": ["odict"]}.get(tag, [])
                bad_tags += {"odict": ["dict"]}.get(tag, [])
            out += [
                Mutation(kind, f"{_dotted(path)}.t={_short(v)}", (*path, "t"), v) for v in bad_tags
            ]
            out.append(Mutation(kind + "+extra", f"{_dotted(path)}+zzz", path, op="add"))
            out += [
                Mutation(kind + "-field", f"{_dotted(path)}-{k}", (*path, k), op="delete")
                for k in node
            ]
            if _is_leaf(node):
                bad_ids: list[Any] = [*INT_BAD, 999]
                if not crafted or path not in aliases:  # an alias of another tensor is valid
                    bad_ids += [node["id"] + 1, *([node["id"] - 1] if node["id"] else [])]
                out += [
                    Mutation("node-id", f"{_dotted(path)}.id={_short(v)}", (*path, "id"), v)
                    for v in bad_ids
                ]
            elif tag == "np":
                dtypes: list[Any] = ["O", "V4", "<U1", ">i4", "bogus", 3, "[('x', '<f4')]"]
                if not crafted:
                    dtypes += ["<f8", "<i4"]
                out += _sets("node-np", path, "dtype", dtypes)
                out += _sets("node-np", path, "v", [[], {}, "x", NAN, *([] if crafted else [7])])
            elif tag == "float":
                out += _sets("node-float", path, "v", ["1e999", 5, None, "NaN", "x"])
                if not crafted:
                    out += _sets("node-float", path, "v", ["-inf"])
            elif tag == "dtype":
                out += _sets("node-dtype", path, "v", ["object", "<U1", 5, None, "torch.float32"])
                if not crafted:
                    out += _sets("node-dtype", path, "v", ["float32"])
            elif tag == "size":
                out += _sets("node-size", path, "v", ["x", [-1], [2**64], ["1"], [1.5], NAN])
                if not crafted:
                    out += _sets("node-size", path, "v", [[2, 3]])
            elif tag == "ints":  # a long list of ints: base64 of n fixed-width ints
                out += _ints_mutations(node, path, crafted=crafted)
            elif tag == "bytes":
                out += _sets("node-bytes", path, "v", [5, "x", "AAA", "!!!!", "a\x00bc", None])
                if not crafted:
                    out += _sets("node-bytes", path, "v", ["AAAA"])
            elif tag in ("list", "tuple", "dict", "odict"):
                for key in ("v", "items"):
                    if key in node:
                        out += _sets(f"node-{tag}", path, key, ["x", 5, None, DEEP])
                if node.get("items"):
                    out += _sets(f"node-{tag}", path, "items", [[[1]], [[1, 2, 3]], [["k"]]])
                    k0 = (*path, "items", 0, 0)
                    out += [
                        Mutation("dict-key", f"{_dotted(k0)}={_short(v)}", k0, v)
                        for v in [{"t": "evil", "v": []}, {"t": "tuple"}, [1], NAN, DEEP]
                    ]
        elif path[-1] not in ("t", "id", "dtype") and not isinstance(node, (dict, list)):
            # a scalar value of the state: only invalid replacements keep it detectable
            values: list[Any] = [{}, [], {"t": "evil"}, {"t": "tensor", "id": 999}, NAN, DEEP]
            if not crafted:
                values += ["changed", 12345, None if node is not None else 0]
            out += [
                Mutation("scalar", f"{_dotted(path)}={_short(v)}", path, v)
                for v in values
                if type(v) is not type(node) or v != node
            ]
    return out


def _ints_mutations(node: dict[str, Any], path: Path_, *, crafted: bool) -> list[Mutation]:
    """An ints node's forged fields: counts, widths and encodings that disagree (huge claims
    among them); in ``damaged`` mode also consistent ones (a list made a tuple, a signed width
    of the same size, a changed value), which only the checksum can refuse."""
    n, v = node["n"], node["v"]
    other = {"list": "tuple", "tuple": "list"}[node["type"]]
    flipped = v[:-3] + chr(ord(v[-3]) ^ 1) + v[-2:]  # nonzero padding bits (uint32: "xx==")
    out = _sets("node-ints", path, "type", ["dict", "", 5, None, *([] if crafted else [other])])
    dtypes = ["bogus", "float32", "<u4", "uint16", "uint64", 5, None]
    out += _sets("node-ints", path, "dtype", dtypes + ([] if crafted else ["int32"]))
    counts = [-1, n - 1, n + 1, 2**62, 2**63, 2**64, "625", 1.5, True]
    out += _sets("node-ints", path, "n", counts)
    codes = ["", v[:-4], v + "AAAA", "!" + v[1:], "\n" + v[1:], v[:4] + "====" + v[8:], flipped]
    changed = ("B" if v[0] == "A" else "A") + v[1:]  # another value, spelled canonically
    out += _sets("node-ints", path, "v", codes + ([] if crafted else [changed]))
    return out


def _json_order(node: Any, path: Path_) -> Iterator[tuple[Path_, Any]]:
    """Nodes in document order (the order the state was flattened)."""
    stack = [(path, node)]
    while stack:
        p, n = stack.pop()
        yield p, n
        children: list[tuple[Path_, Any]] = []
        if type(n) is dict:
            children = [((*p, k), v) for k, v in n.items() if k != "t"]
        elif type(n) is list:
            children = [((*p, i), v) for i, v in enumerate(n)]
        stack.extend(reversed(children))


def _sets(kind: str, path: Path_, key: str, values: list[Any]) -> list[Mutation]:
    return [Mutation(kind, f"{_dotted(path)}.{key}={_short(v)}", (*path, key), v) for v in values]


def _dotted(path: Path_) -> str:
    return ".".join(map(str, path)) or "(doc)"


def _short(v: Any) -> str:
    if v is NAN:
        return "NaN"
    if v is DEEP:
        return "[[[...100000"
    text = repr(v)
    return text if len(text) < 40 else text[:37] + "..."


def stratified(items: list[Mutation], n: int, rng: random.Random) -> list[Mutation]:
    """``n`` mutations, round-robin over their kinds (every kind first), seeded."""
    by_kind: dict[str, list[Mutation]] = {}
    for m in items:
        by_kind.setdefault(m.kind, []).append(m)
    for group in by_kind.values():
        rng.shuffle(group)
    kinds = sorted(by_kind)
    rng.shuffle(kinds)
    out: list[Mutation] = []
    while len(out) < n and any(by_kind.values()):
        for kind in kinds:
            if by_kind[kind] and len(out) < n:
                out.append(by_kind[kind].pop())
    return out


# --- running the cases -----------------------------------------------------------------------


@dataclass
class Case:
    run: Run
    mode: str
    label: str
    touched: tuple[int, ...]  # the steps whose files the case changed
    prepare: Callable[[Path], None]
    save_after: bool = False  # then save a step, which must be readable (see save_after)


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    by_mode: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    max_alloc: int = 0
    seconds: float = 0.0

    def count(self, mode: str, what: str) -> None:
        self.counts[what] += 1
        self.by_mode.setdefault(mode, Counter())[what] += 1


def remove_tree(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def run_case(
    case: Case,
    work: Path,
    tally: Tally,
    allocs: list[int],
    remove: Callable[[Path], object] = remove_tree,
) -> None:
    run = case.run
    newest = max(run.states)
    target = case.touched[0]
    root = work / f"{run.name}-{tally.counts['cases']}"
    shutil.copytree(run.root, root, symlinks=True)
    case.prepare(root)
    tally.count(case.mode, "cases")
    where = f"[{run.name}/{case.mode}] {case.label}"
    affected = {s for s in run.states if set(case.touched) & {s, *run.bases[s]}}
    limit = ZSTD_MAX_RATIO * max(
        (f.stat().st_size for f in root.glob("*/data-r*.bin") if f.is_file()), default=0
    )
    allocs.clear()
    storage = LocalStorage(root)
    # restore(step=the step the case changed): exact, or CorruptCheckpointError
    direct_ok = False
    try:
        state = load_checkpoint(storage, target).state
    except CorruptCheckpointError:
        tally.count(case.mode, "detected")
    except Exception as e:
        tally.count(case.mode, "other-exception")
        tally.failures.append(f"{where}: load raised {type(e).__name__}: {e}")
    else:
        if same(state, run.states[target]):
            direct_ok = True
            tally.count(case.mode, "restored-exact")
        else:
            tally.count(case.mode, "silent-wrong")
            tally.failures.append(f"{where}: load returned a different state")
    # verify agrees
    try:
        verified = not verify_checkpoint(storage, target)
    except CorruptCheckpointError:
        verified = False
    except Exception as e:
        verified = not direct_ok
        tally.failures.append(f"{where}: verify raised {type(e).__name__}: {e}")
    if verified != direct_ok:
        tally.count(case.mode, "verify-disagrees")
        tally.failures.append(f"{where}: verify says {verified}, restore {direct_ok}")
    # the manager: newest intact step, exactly
    try:
        with CheckpointManager(root, keep_last=None) as mgr:
            state = mgr.restore()
            assert mgr.last_restore is not None
            step = mgr.last_restore.step
    except CorruptCheckpointError:
        if affected != set(run.states):
            tally.failures.append(f"{where}: manager found no intact step")
        tally.count(case.mode, "manager-none-intact")
    except Exception as e:
        tally.count(case.mode, "other-exception")
        tally.failures.append(f"{where}: manager raised {type(e).__name__}: {e}")
    else:
        if not same(state, run.states[step]):
            tally.count(case.mode, "silent-wrong")
            tally.failures.append(f"{where}: manager restored a different state of step {step}")
        elif step != newest:
            tally.count(case.mode, "fallback")
            if newest not in affected:
                tally.failures.append(f"{where}: manager skipped the intact step {newest}")
    if case.save_after:
        save_after(root, newest + 1, where, tally, case.mode)
    tally.max_alloc = max(tally.max_alloc, *allocs, 0)
    if any(n > max(limit, 1 << 20) for n in allocs):
        tally.failures.append(f"{where}: allocated {max(allocs)} bytes (limit {limit})")
    remove(root)


AFTER = {"after": torch.arange(3.0)}


def save_after(root: Path, step: int, where: str, tally: Tally, mode: str) -> None:
    """A save after the changed record (its step or commit sequence): committed, and then
    what a resume takes exactly; or failed loudly, for a record at the highest sequence, after
    which nothing can be ordered. Never reported committed and then unreadable."""
    try:
        with CheckpointManager(root, keep_last=None) as mgr:
            mgr.save(step, AFTER).wait()
    except BackgroundSaveError as e:
        tally.count(mode, "save-after-refused")
        if "records commit sequence" not in str(e):
            tally.failures.append(f"{where}: the save after it failed: {e}")
        return
    except Exception as e:
        tally.count(mode, "other-exception")
        tally.failures.append(f"{where}: the save after it raised {type(e).__name__}: {e}")
        return
    try:
        with CheckpointManager(root, keep_last=None) as mgr:
            state = mgr.restore()
            assert mgr.last_restore is not None
            got = mgr.last_restore.step
    except Exception as e:
        tally.count(mode, "save-after-lost")
        tally.failures.append(f"{where}: the save after it is not restorable: {e}")
        return
    if got != step or not same(state, AFTER):
        tally.count(mode, "save-after-lost")
        tally.failures.append(f"{where}: the save after it committed, a resume took step {got}")
    else:
        tally.count(mode, "save-after-restored")


def manifest_case(run: Run, mode: str, m: Mutation, step: int | None = None) -> Case:
    step = max(run.states) if step is None else step

    def prepare(root: Path) -> None:
        doc = read_doc(root, step)
        path = manifest_path(root, step)
        old = json.loads(path.read_bytes())["checksum"]
        m(doc)
        if mode == "crafted":
            path.write_bytes(encode_doc(doc, raw=RAW))
        else:
            body = encode_doc(doc, seal=False, raw=RAW)
            path.write_bytes(body[:-1] + b',"checksum":' + json.dumps(old).encode() + b"}")

    # a crafted step or sequence is what a writer reads (a damaged one, the checksum refuses)
    save_after = mode == "crafted" and m.kind in ("step", "sequence")
    return Case(run, mode, m.label, (step,), prepare, save_after)


def byte_case(run: Run, mode: str, rng: random.Random, step: int) -> Case:
    name = "manifest.json" if mode == "manifest-bytes" else "data-r0.bin"
    seed = rng.randrange(1 << 30)

    def prepare(root: Path) -> None:
        r = random.Random(seed)
        path = root / step_dir_name(step) / name
        data = bytearray(path.read_bytes())
        for _ in range(r.choice((1, 1, 2, 3, 8))):
            i = r.randrange(len(data))
            data[i] = (data[i] + r.randrange(1, 256)) % 256
        path.write_bytes(bytes(data))

    return Case(run, mode, f"step {step} {name} bytes (seed {seed})", (step,), prepare)


def file_cases(run: Run) -> list[Case]:
    newest = max(run.states)

    def replace(name: str, how: str, step: int = newest) -> Callable[[Path], None]:
        def prepare(root: Path) -> None:
            path = root / step_dir_name(step) / name
            if how == "truncated":
                with open(path, "r+b") as f:
                    f.truncate(path.stat().st_size // 2)
                return
            if how == "extended":
                with open(path, "ab") as f:
                    f.write(b"\x00" * 4096)
                return
            path.unlink()
            if how == "fifo":
                os.mkfifo(path)
            elif how == "dev-zero":
                path.symlink_to("/dev/zero")
            elif how == "directory":
                path.mkdir()
            elif how == "empty":
                path.write_bytes(b"")
            elif how == "other-step":
                path.symlink_to(root / step_dir_name(min(run.states)) / name)

        return prepare

    cases = []
    for name in ("data-r0.bin", "manifest.json"):
        for how in ("fifo", "dev-zero", "directory", "empty", "truncated", "extended"):
            cases.append(Case(run, "file-kind", f"{name} {how}", (newest,), replace(name, how)))
    cases.append(
        Case(
            run,
            "file-kind",
            "data-r0.bin other-step",
            (newest,),
            replace("data-r0.bin", "other-step"),
        )
    )
    if run.bases[newest]:  # the base of the newest step damaged too
        base = run.bases[newest][0]
        for how in ("truncated", "fifo"):
            cases.append(
                Case(
                    run,
                    "file-kind",
                    f"base {base} {how}",
                    (base,),
                    replace("data-r0.bin", how, base),
                )
            )
    return cases


def all_cases(runs: list[Run], rng: random.Random) -> list[Case]:
    """Every crafted mutation of the newest manifests; a seeded, stratified sample of the
    rest."""
    cases: list[Case] = []
    budget = {"raw": (250, 100, 100), "lossless": (150, 60, 60), "boxes": (60, 40, 40)}
    for run in runs:
        damaged_n, manifest_n, data_n = budget[run.name]
        newest = max(run.states)
        doc = read_doc(run.root, newest)
        for m in mutations(doc, crafted=True):
            cases.append(manifest_case(run, "crafted", m))
        for m in stratified(mutations(doc, crafted=False), damaged_n, rng):
            cases.append(manifest_case(run, "damaged", m))
        steps = sorted(run.states)
        for _ in range(manifest_n):
            cases.append(byte_case(run, "manifest-bytes", rng, rng.choice(steps)))
        for _ in range(data_n):
            cases.append(byte_case(run, "data-bytes", rng, rng.choice(steps)))
        cases += file_cases(run)
        if run.bases[newest]:  # crafted base manifests
            base = run.bases[newest][0]
            base_doc = read_doc(run.root, base)
            for m in stratified(mutations(base_doc, crafted=True), 150, rng):
                cases.append(manifest_case(run, "crafted", m, step=base))
    return cases


@pytest.mark.timeout(900)
def test_manifest_fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = time.perf_counter()
    rng = random.Random(SEED)
    runs = save_runs(tmp_path / "pristine")
    allocs: list[int] = []
    original = restore._alloc

    def alloc(nbytes: int) -> torch.Tensor:
        allocs.append(nbytes)
        if nbytes > 1 << 30:
            raise AssertionError(f"restore allocates {nbytes} bytes")
        return original(nbytes)

    monkeypatch.setattr(restore, "_alloc", alloc)
    tally = Tally()
    # each case's copy is removed by a thread while the next case runs (removing a directory
    # waits on the file system: a third of the fuzzer's time when done in line)
    with ThreadPoolExecutor(max_workers=1) as remover:
        for case in all_cases(runs, rng):
            run_case(case, tmp_path, tally, allocs, partial(remover.submit, remove_tree))
    tally.seconds = time.perf_counter() - started
    fixed = ("cases", "detected", "restored-exact", "silent-wrong", "other-exception")
    totals = {k: tally.counts[k] for k in fixed}
    report = {
        "seed": SEED,
        "seconds": round(tally.seconds, 1),
        "totals": totals | {k: v for k, v in sorted(tally.counts.items()) if k not in totals},
        "by_mode": {mode: dict(c) for mode, c in sorted(tally.by_mode.items())},
        "max_allocation_bytes": tally.max_alloc,
        "failures": tally.failures,
    }
    text = json.dumps(report, indent=2)
    print(f"\ncoci manifest fuzz: {text}")
    target = os.environ.get("COCI_FUZZ_REPORT")
    if target:
        Path(target).write_text(text + "\n")
    assert tally.counts["silent-wrong"] == 0
    assert tally.counts["other-exception"] == 0
    assert tally.failures == []
    # the checksum finds every change of a manifest
    for mode in ("damaged", "manifest-bytes"):
        got = tally.by_mode[mode]
        assert got["restored-exact"] == 0 and got["detected"] == got["cases"], got
    assert tally.counts["cases"] >= 5000


def test_a_shape_of_2_40_fails_fast_before_any_allocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocation guard, checked directly: a crafted 2**40-element array whose pieces
    claim to cover it (a consistent manifest) is refused before anything is allocated."""
    allocs: list[int] = []
    monkeypatch.setattr(restore, "_alloc", lambda n: allocs.append(n) or torch.empty(0))
    with CheckpointManager(tmp_path, keep_last=None, compression="lossless") as mgr:
        mgr.save(1, {"w": torch.zeros(8192)}).wait()
    doc = read_doc(tmp_path, 1)
    (entry,) = doc["tensors"]
    (piece,) = entry["pieces"]
    entry["shape"] = [2**40]
    piece["length"] = 2**42
    piece["params"]["nbytes"] = 2**42
    manifest_path(tmp_path, 1).write_bytes(encode_doc(doc))
    started = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match="zstd can expand"):
        load_checkpoint(LocalStorage(tmp_path), 1)
    assert time.perf_counter() - started < 2
    assert allocs == []
