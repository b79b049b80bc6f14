"""``coci export`` and the way back: a restored state written as a ``torch.save`` file, a
``.safetensors`` file or a ``torch.distributed.checkpoint`` directory, with a note that lets
``coci import`` rebuild the state exactly (same structure, same types, same bits).

What each format holds for other tools:

- ``.pt`` (``torch.save``): the state as it was, except that numpy arrays are stored as tensors
  (of the same bytes and shape) and numpy scalars as Python numbers, so that plain
  ``torch.load(path)`` (``weights_only=True``) loads it; a state holding values coci stores by
  the name of their type (OmegaConf configs, ``argparse.Namespace``, paths: hyper-parameters)
  has them as those objects, as Lightning's own ``.ckpt`` files do, and loads with
  ``weights_only=False`` (or ``LightningModule.load_from_checkpoint(..., weights_only=False)``).
  The note (JSON: the state's coci tree and where each array is) is one more record of the zip
  archive, ``<archive>/coci_export.json``, which ``torch.load`` ignores.
- ``.safetensors``: one tensor per array, named by its path (``model.0.weight``); the note is
  the ``coci_export`` entry of the metadata header (strings and numbers live there).
- DCP: the state as it was (numpy as tensors, numpy scalars as numbers); the note is the file
  ``coci_export.json`` in the directory, which DCP ignores.

``coci import`` of a file with a note rebuilds the original state from the note's tree: int
keys, tuples, ``OrderedDict`` (with ``_metadata``), numpy arrays and scalars, non-finite
floats, bytes, dtypes, sizes and long lists of ints (``ints`` nodes of the note's tree, as in a
manifest of format 5) come back as they were. A file without a note (from another
tool) is imported as that tool wrote it. The note is read as untrusted input: JSON only,
checked before anything is built from it.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coci_core.engine.format.manifest import MAX_STEP
from coci_core.engine.format.torch_saved import load_torch_saved
from coci_core.engine.format.tree import flatten_state
from coci_core.engine.format.tree_nodes import LEAF_TAGS, WRAPPER_TAGS, encode_dtype, ndarray_dtype
from coci_core.engine.restore.tree_read import build_wrapped, check_tree, unflatten_state
from coci_core.errors import CociError, CorruptCheckpointError
from coci_core.interop.swap import directory_beside, file_beside
from coci_core.knobs import MAX_NOTE_CHARS

__all__ = [
    "NOTE_FILE",
    "NOTE_FORMAT",
    "SAFETENSORS_NOTE",
    "export_state",
    "from_note",
    "note_step",
    "pt_locator",
    "read_pt_note",
]

NOTE_FILE = "coci_export.json"  # the note: a record of a .pt archive, a file of a DCP directory
SAFETENSORS_NOTE = "coci_export"  # the metadata entry of the note in a .safetensors file


def require_safetensors(what: str) -> None:
    """Check that the optional ``safetensors`` package can be imported.

    Raises:
        CociError: it cannot; one line that names ``what`` needed it and the install.
    """
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CociError(
            f"{what} needs the safetensors package, which is not installed: pip install safetensors"
        ) from None


NOTE_FORMAT = "coci-export/1"


@dataclass
class _Leaf:
    kind: str
    numpy_dtype: str | None
    value: Any  # what the exported state holds for it
    raw: torch.Tensor  # its bytes as coci stores them (for safetensors)
    pos: list[int] = field(default_factory=list)  # positional path in the exported state
    keys: list[tuple[str, Any]] = field(default_factory=list)  # ("k", dict key) / ("i", index)
    placed: bool = False


@dataclass
class _Natural:
    state: dict[str, Any]
    tree: Any
    leaves: list[_Leaf]


def _naturalize(state: Mapping[str, Any]) -> _Natural:
    """The state as a ``torch.load(weights_only=True)``-loadable object, with where each of
    its arrays is."""
    flat = flatten_state(state, allow_torch_save=True)
    leaves = []
    for leaf in flat.leaves:
        raw = leaf.tensor.detach()
        if leaf.kind == "torch_save":
            value: Any = load_torch_saved(raw.numpy().tobytes(), leaf.key)
        else:
            value = raw
        leaves.append(_Leaf(leaf.kind, leaf.numpy_dtype, value, raw))

    def build(node: Any, pos: list[int], keys: list[tuple[str, Any]]) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        tag = node["t"]
        if tag in LEAF_TAGS:
            leaf = leaves[node["id"]]
            if not leaf.placed:
                leaf.pos, leaf.keys, leaf.placed = pos, keys, True
            return leaf.value
        if tag == "np":  # a numpy scalar: its Python number
            return build(node["v"], pos, keys)
        if tag in ("list", "tuple"):
            items = [build(v, [*pos, i], [*keys, ("i", i)]) for i, v in enumerate(node["v"])]
            return items if tag == "list" else tuple(items)
        if tag in ("dict", "odict"):
            out: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
            entries = (
                list(node["v"].items())
                if "v" in node
                else [(unflatten_state(k, []), v) for k, v in node["items"]]
            )
            for i, (k, v) in enumerate(entries):
                out[k] = build(v, [*pos, i], [*keys, ("k", k)])
            if "metadata" in node:
                out._metadata = unflatten_state(node["metadata"], [])  # type: ignore[attr-defined]
            return out
        if tag in WRAPPER_TAGS:  # a DictConfig or Namespace: its items at its positions
            return build_wrapped(node, build(node["v"], pos, keys))
        return unflatten_state(node, [])  # float, dtype, size, bytes, path, class

    natural = build(flat.tree, [], [])
    assert isinstance(natural, dict)
    return _Natural(natural, flat.tree, leaves)


def _note(natural: _Natural, step: int, where: list[Any]) -> str:
    return json.dumps(
        {
            "format": NOTE_FORMAT,
            "step": step,
            "tree": natural.tree,
            "leaves": [
                {"kind": leaf.kind, "numpy_dtype": leaf.numpy_dtype, "at": at}
                for leaf, at in zip(natural.leaves, where, strict=True)
            ],
        },
        separators=(",", ":"),
        allow_nan=False,
    )


def export_state(state: Mapping[str, Any], out: Path, fmt: str, step: int) -> str:
    """Write ``state`` (restored from step ``step``) to ``out`` in ``fmt`` (``torch``,
    ``safetensors`` or ``dcp``) with a note for ``coci import``; a one-line summary.

    Raises:
        CociError: the state cannot be written in that format.
    """
    natural = _naturalize(state)
    if fmt == "safetensors":
        return _export_safetensors(natural, out, step)
    if fmt == "dcp":
        return _export_dcp(natural, out, step)
    note = _note(natural, step, [leaf.pos for leaf in natural.leaves])
    with file_beside(out) as tmp:
        try:
            torch.save(natural.state, tmp)
        except RuntimeError as e:  # torch's writer: a full disk, a file it cannot create
            raise CociError(f"cannot write {out}: {_one_line(e)}") from e
        with zipfile.ZipFile(tmp, "a") as archive:  # a record torch.load does not read
            prefix = archive.namelist()[0].split("/")[0]
            archive.writestr(f"{prefix}/{NOTE_FILE}", note)
        os.replace(tmp, out)
    return f"exported step {step} to {out} (torch.save)"


def _one_line(e: BaseException) -> str:
    """An error's message on one line (torch's writer puts its C++ location on another)."""
    return " ".join(str(e).split()) or type(e).__name__


def _export_safetensors(natural: _Natural, out: Path, step: int) -> str:
    require_safetensors(f"writing {out}")
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    names = []
    for i, leaf in enumerate(natural.leaves):
        name = ".".join(str(k) for _, k in leaf.keys) or f"array{i}"
        while name in tensors:
            name = f"{name}#{i}"
        t = leaf.raw.contiguous()
        if t.untyped_storage().data_ptr() in storages and t.numel():
            t = t.clone()  # safetensors refuses tensors that share memory
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
        names.append(name)
    note = _note(natural, step, names)
    from safetensors import SafetensorError

    with file_beside(out) as tmp:
        try:
            save_file(tensors, str(tmp), metadata={"coci_step": str(step), SAFETENSORS_NOTE: note})
        except (ValueError, TypeError, RuntimeError, SafetensorError) as e:
            # a dtype it does not have; a full disk, a file it cannot create
            raise CociError(f"cannot write {out} as safetensors: {_one_line(e)}") from e
        os.replace(tmp, out)
    return f"exported step {step}: {len(tensors)} tensors to {out} (safetensors)"


def _export_dcp(natural: _Natural, out: Path, step: int) -> str:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    try:
        _, mapping = flatten_state_dict(natural.state)
    except ValueError as e:  # "duplicated flatten key": two paths DCP names alike
        raise CociError(f"cannot write the state as DCP: {e}") from e
    # DCP names a value by its path, dict keys as str(key), list indices as ints
    by_path = {
        tuple(("k", p) if type(p) is str else ("i", p) for p in path): fqn
        for fqn, path in mapping.items()
    }
    where = []
    for leaf in natural.leaves:
        dcp_keys = [("k", str(k)) if kind == "k" else ("i", k) for kind, k in leaf.keys]
        for n in range(len(dcp_keys), 0, -1):
            fqn = by_path.get(tuple(dcp_keys[:n]))
            if fqn is not None:
                where.append([fqn, leaf.pos[n:]])
                break
        else:  # pragma: no cover - DCP visits every path that holds an array
            raise CociError(f"cannot find where DCP stores {leaf.keys!r}")
    note = _note(natural, step, where)
    # Written beside OUT, then swapped in whole: an export killed midway, or two at once of
    # different steps, never leave OUT holding one step's data under another's note (before:
    # DCP wrote into OUT in place, over the earlier export's files).
    try:
        with directory_beside(out, "dcp") as tmp:
            with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_save(natural.state, checkpoint_id=str(tmp), no_dist=True)
            (tmp / NOTE_FILE).write_text(note)
    except (OSError, RuntimeError, CheckpointException) as e:  # a full disk, no permission
        causes = [f[0] for f in e.failures.values()] if isinstance(e, CheckpointException) else []
        raise CociError(
            f"cannot write {out} as DCP: {_one_line(causes[0] if causes else e)}"
        ) from e
    return f"exported step {step} to {out} (torch.distributed.checkpoint)"


# -- import ---------------------------------------------------------------------------------


def pt_locator(state: Any, what: str) -> Callable[[Any], Any]:
    """A function giving the value at a positional path (the i-th item of each container) in
    ``state``; each container's items are listed once, however many paths go through it."""
    items_of: dict[int, list[Any]] = {}

    def locate(pos: Any) -> Any:
        if type(pos) is not list or not all(type(i) is int and i >= 0 for i in pos):
            raise CorruptCheckpointError(f"{what}: the note has a bad array position")
        node = state
        for i in pos:
            items = items_of.get(id(node))
            if items is None:
                if isinstance(node, argparse.Namespace):
                    items = list(vars(node).values())
                elif isinstance(node, Mapping):
                    items = list(node.values())
                elif type(node) in (list, tuple):
                    items = list(node)
                else:
                    raise CorruptCheckpointError(
                        f"{what}: an array position of the note leads nowhere"
                    )
                items_of[id(node)] = items
            if i >= len(items):
                raise CorruptCheckpointError(f"{what}: an array position of the note leads nowhere")
            node = items[i]
        return node

    return locate


def read_pt_note(src: Path) -> str | None:
    """The note of a ``.pt`` file written by ``coci export`` (None for other files)."""
    try:
        if not zipfile.is_zipfile(src):
            return None  # the legacy torch.save format: not from coci export
        with zipfile.ZipFile(src) as archive:
            names = archive.namelist()
            prefix = names[0].split("/")[0] if names else ""
            try:
                info = archive.getinfo(f"{prefix}/{NOTE_FILE}")
            except KeyError:
                return None
            if info.file_size > MAX_NOTE_CHARS:
                raise CorruptCheckpointError(f"{src}: the coci export note is too large")
            return archive.read(info).decode("utf-8")
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError, ValueError, NotImplementedError) as e:
        raise CorruptCheckpointError(f"{src}: cannot read the coci export note: {e}") from e


def note_step(text: str) -> int | None:
    """The step a note records (None if it records none a step can be: read as untrusted)."""
    try:
        step = json.loads(text).get("step")
    except (ValueError, RecursionError, AttributeError):
        return None
    return step if type(step) is int and 0 <= step <= MAX_STEP else None


def from_note(text: Any, locate: Callable[[Any], Any], what: str) -> dict[str, Any]:
    """The state a note describes, its arrays found by ``locate(at)``.

    Raises:
        CorruptCheckpointError: the note is malformed or does not match the file.
    """
    if type(text) is not str or len(text) > MAX_NOTE_CHARS:
        raise CorruptCheckpointError(f"{what}: the coci export note is not a string")
    try:
        note = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{what}: the coci export note is not JSON ({e})") from e
    if type(note) is not dict or note.get("format") != NOTE_FORMAT:
        raise CorruptCheckpointError(
            f"{what}: the coci export note is not of format {NOTE_FORMAT!r}"
        )
    specs = note.get("leaves")
    if type(specs) is not list or not all(
        type(s) is dict and s.get("kind") in LEAF_TAGS and "at" in s for s in specs
    ):
        raise CorruptCheckpointError(f"{what}: the coci export note has a bad list of arrays")
    tree = note.get("tree")
    check_tree(tree, n_leaves=len(specs), kinds=[s["kind"] for s in specs], what=what)
    values: list[Any] = []
    for i, spec in enumerate(specs):
        value = locate(spec["at"])
        kind = spec["kind"]
        if kind == "torch_save":
            if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
                value = load_torch_saved(value.contiguous().numpy().tobytes(), f"array {i}")
            values.append(value)
            continue
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            raise CorruptCheckpointError(f"{what}: array {i} of the note is not a tensor")
        value = value.detach()
        if kind == "ndarray":
            dtype = ndarray_dtype(spec.get("numpy_dtype"), encode_dtype(value.dtype))
            value = value.contiguous().numpy().view(dtype)
        values.append(value)
    state = unflatten_state(tree, values)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{what}: the coci export note holds no mapping")
    return state
