"""Reading the checkpoints of other tools (``coci import``) without running code from them.

- A ``torch.save`` file: ``torch.load(weights_only=True)``.
- A ``.safetensors`` file: safetensors (no pickle at all).
- What ``coci export`` wrote (any of the three) carries a note, ``coci_export.json``, from which
  the exact state is rebuilt (:mod:`coci_core.interop.exchange`); the note is JSON, checked like a
  manifest's tree, and every array it names must be a tensor of the file.
- A ``torch.distributed.checkpoint`` (DCP) directory, read here and not by DCP: DCP loads its
  ``.metadata`` with ``pickle.load`` and its non-tensor values with
  ``torch.load(weights_only=False)``, both of which run whatever code the files name. Here
  ``.metadata`` goes through an unpickler that resolves only an allowlist of globals (DCP's
  metadata dataclasses, ``torch.Size``, torch dtypes, layouts and memory formats,
  ``OrderedDict``, paths and sets); each tensor chunk and each non-tensor value is read by the
  offset and length the metadata records, with ``torch.load(weights_only=True)``. Everything
  read is checked before it is used: types, offsets and lengths inside regular files of the
  directory (each stored value its own bytes), chunks inside their tensor and tiling it
  exactly, sizes that the files can hold before anything is allocated.

What an import builds or walks is paid for by the bytes it reads
(:class:`~coci_core.interop.allowance.Allowance`), so a crafted file is refused quickly, with
little memory, and a ``CociError`` naming what is wrong:

- before ``.metadata`` is unpickled, the tree its pickle describes (each shared reference
  counted again, :mod:`coci_core.engine.format.pickle_tree`) must be at most 16 objects and
  characters per byte of it, and at most 64 levels deep; the checks of the chunks spend from
  the same kind of allowance; the pickle of each ``torch.save`` record (a ``.pt`` file, a DCP
  value or chunk; each of the pickles of torch's legacy non-zip format) is measured alike
  before ``torch.load`` runs it (at most 1024 levels deep);
- a tensor is no larger than the bytes of its chunks (which tile it, and each value has bytes
  of its own in its file);
- the None slots that planner_data's list indices pad lists with take 8 bytes each of the bytes
  read, and the state returned, walked as saving it walks it (shared containers once per
  reference), has at most one value or character per byte read.

Every check takes time near-linear in its input (sorts and hashes, never pairs of chunks).

Every failure is a :class:`~coci_core.errors.CociError`: :class:`UnsafeCheckpointError` when a
file names a global outside what is allowed (it is refused, not run), otherwise
:class:`CorruptCheckpointError` (or a plain ``CociError`` for what is not a checkpoint at all).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coci_core.engine.format.torch_saved import check_saved_pickle, load_weights_only
from coci_core.errors import CociError, CorruptCheckpointError
from coci_core.interop.allowance import Allowance, check_state_size, open_regular_file
from coci_core.interop.dcp import nest, read_dcp, read_dcp_values
from coci_core.knobs import MAX_NOTE_CHARS

__all__ = ["read_dcp", "read_foreign", "read_foreign_with_step"]


def read_foreign(src: Path) -> dict[str, Any]:
    """A state from a ``torch.save`` file, a ``.safetensors`` file or a
    ``torch.distributed.checkpoint`` directory, loaded without running code from it.

    Raises:
        UnsafeCheckpointError: a pickle in ``src`` names a function or class that is not
            allowed (loading it would run code from the file).
        CorruptCheckpointError: ``src`` is damaged or not in the format its name says.
        CociError: ``src`` does not exist or does not hold a mapping.
    """
    return read_foreign_with_step(src)[0]


def read_foreign_with_step(src: Path) -> tuple[dict[str, Any], int | None]:
    """:func:`read_foreign`, and the step ``coci export`` recorded in ``src`` (None for a
    file another tool wrote)."""
    from coci_core.interop.exchange import from_note, note_step, pt_locator, read_pt_note

    src = Path(src)
    note: str | None = None
    if src.is_dir():
        state, note, read = _read_dcp_exported(src)
    elif not src.exists():
        raise CociError(f"{src}: no such file or directory")
    elif not src.is_file():
        raise CociError(f"{src} is not a regular file or a directory")
    else:
        read = src.stat().st_size
        if src.suffix == ".safetensors":
            state, note = _read_safetensors(src)
        else:
            _check_torch_saved(src)
            check_saved_pickle(src, what=str(src), legacy=True)
            state = load_weights_only(src, what=str(src), map_location="cpu")
            note = read_pt_note(src)
            if note is not None:  # written by coci export: rebuild the exact state
                state = from_note(note, pt_locator(state, str(src)), str(src))
    if not isinstance(state, dict):
        raise CociError(f"{src} holds a {type(state).__name__}, not a mapping")
    check_state_size(state, Allowance.of_read(read, str(src)))
    return state, None if note is None else note_step(note)


# The first bytes of a torch.save file: a zip archive, or a pickle (the legacy format).
_TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")


def _check_torch_saved(src: Path) -> None:
    """Refuse, by its first bytes, a file that is no ``torch.save`` file at all."""
    with open(src, "rb") as f:
        head = f.read(4)
    if not head.startswith(_TORCH_SAVE_MAGIC):  # damaged, or another kind of file
        what = "is empty" if not head else "is not a torch.save file"
        raise CorruptCheckpointError(
            f"{src} {what}: coci import reads a torch.save file, a .safetensors file or a "
            "torch.distributed.checkpoint directory"
        )


def _read_safetensors(src: Path) -> tuple[Any, str | None]:
    from coci_core.interop.exchange import SAFETENSORS_NOTE, from_note, require_safetensors

    require_safetensors(f"reading {src}")
    from safetensors import safe_open

    try:
        with safe_open(str(src), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCheckpointError(f"cannot read {src} as a .safetensors file: {e}") from e
    if SAFETENSORS_NOTE not in metadata:  # another tool's file: its flat names
        return tensors, None

    def locate(name: Any) -> Any:
        if type(name) is not str or name not in tensors:
            raise CorruptCheckpointError(f"{src}: the note names an array the file lacks")
        return tensors[name]

    note = metadata[SAFETENSORS_NOTE]
    return from_note(note, locate, str(src)), note


def _read_dcp_exported(directory: Path) -> tuple[Any, str | None, int]:
    """A DCP directory: as coci exported it when it holds coci's note, else as DCP nests it;
    and the bytes read."""
    from coci_core.interop.exchange import NOTE_FILE, from_note, pt_locator

    meta, values, paths, read = read_dcp_values(Path(directory))
    note_path = Path(directory) / NOTE_FILE
    if not note_path.exists() and not note_path.is_symlink():
        return nest(meta, values, paths, Allowance.of_read(read, str(directory))), None, read
    with open_regular_file(note_path, str(directory)) as f:
        data = f.read(MAX_NOTE_CHARS)
    try:
        note = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{directory}: {NOTE_FILE} is not text") from e

    inside = pt_locator(values, str(directory))  # values: DCP key -> value, in its order
    position = {key: i for i, key in enumerate(values)}

    def locate(at: Any) -> Any:
        if type(at) is not list or len(at) != 2 or type(at[0]) is not str or at[0] not in values:
            raise CorruptCheckpointError(f"{directory}: the note names an array DCP lacks")
        return inside([position[at[0]], *at[1]] if type(at[1]) is list else at[1])

    return from_note(note, locate, str(directory)), note, read + len(data)
