"""The versioned JSON manifest: the commit record of one checkpoint.

A step directory is a checkpoint exactly when it holds a manifest that parses: the manifest is
written last, after every data file (of every rank) is durable.

Format 3 protects the manifest itself: its last field, ``"checksum"``, is the SHA-256 of the
exact bytes written before it (the document with that field left out), and a reader verifies it
before it uses anything in the manifest. Every field is then checked against hard limits before
anything is allocated or read (see :class:`Manifest.from_json`). Each array is stored as one
or more *pieces* (byte ranges, possibly in different ranks' data files). Format 4 is format 3
plus an array's ``boxes`` (a DTensor cut along a dim other than its first: see
:class:`TensorEntry`); it is written only for such a state. Format 5 is format 4 plus the state
trees' ``ints`` nodes (a long list of ints as base64 of fixed-width ints: see
:mod:`coci_core.engine.format.int_lists`); it is written only for a state that holds one (every
adapter's: Python's random state). This coci reads formats 3, 4 and 5; a manifest of any other
``format_version`` is refused, and an ``ints`` node in a manifest of format 3 or 4 too.

Why one module: the records, their JSON form and the checks of that form are one on-disk
format; the checker builds the records, and a change to a field touches all three.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

from coci_core.engine.format.int_lists import holds_ints
from coci_core.engine.format.regions import Region
from coci_core.engine.format.tree import check_tree, decode_dtype, ndarray_dtype
from coci_core.errors import CorruptCheckpointError

__all__ = [
    "BOXES_FORMAT_VERSION",
    "FORMAT_VERSION",
    "INTS_FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_ARRAY_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_SEQUENCE",
    "MAX_STEP",
    "DataFile",
    "Manifest",
    "ManifestHead",
    "Piece",
    "RankState",
    "TensorEntry",
    "check_readable_head",
    "load_sealed",
    "parse_step_dir",
    "parse_step_version",
    "parse_tensor_entry",
    "read_head",
    "read_head_only",
    "seal",
    "seal_of",
    "step_dir_name",
]

FORMAT_VERSION = 3
#: The format of a manifest with an array stored as boxes (a DTensor split along a dim other
#: than its first): written only then, so that other manifests stay readable by earlier coci.
BOXES_FORMAT_VERSION = 4
#: The format of a manifest whose state trees hold an ``ints`` node (a long list of ints, see
#: :mod:`coci_core.engine.format.int_lists`), with or without boxes: written only then.
INTS_FORMAT_VERSION = 5
READ_FORMAT_VERSIONS = (FORMAT_VERSION, BOXES_FORMAT_VERSION, INTS_FORMAT_VERSION)
MANIFEST_NAME = "manifest.json"

# Hard limits, checked before anything is allocated or read.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024  # ~1M pieces with codec parameters fit many times over
MAX_ARRAY_BYTES = 1 << 48  # one array (256 TiB); also bounds the product of a shape's dims
MAX_INT = (1 << 63) - 1  # every integer field (offsets, sizes, steps, dims)
MAX_STEP = MAX_INT  # a step: save refuses a larger one, a manifest or directory name too
#: A commit sequence (see Manifest.sequence) counts commits: no run reaches 2**62 (a commit
#: each nanosecond for 146 years), so a larger one is damage; the writer numbers a save at most
#: this, and fails it rather than commit a number the reader refuses.
MAX_SEQUENCE = 1 << 62
MAX_NDIM = 64
MAX_WORLD_SIZE = 1 << 20
MAX_TOKEN = 256
MAX_RUN = 64  # a run id: the RankGroup session that first wrote the run (letters and digits)
MAX_CREATED_UNIX = float(1 << 37)  # the year 6325
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}", re.ASCII)
_STEP_DIR = re.compile(r"step-([0-9]{10,19})(?:-v([1-9][0-9]{0,18}))?", re.ASCII)

_SEAL_HEAD = b',"checksum":"sha256:'
_SEAL_TAIL = re.compile(rb',"checksum":"sha256:([0-9a-f]{64})"\}')
_SEAL_LEN = len(_SEAL_HEAD) + 64 + 2


def step_dir_name(step: int, version: int = 0) -> str:
    """The directory name of a committed step (zero-padded, so names sort by step).

    ``version`` > 0 names a checkpoint of a step that another run already held when it was
    saved (``step-0000000004-v1``, as Lightning's ``ModelCheckpoint`` adds ``-v1`` to a name
    that is taken): both runs' checkpoints are kept, each under its own name.
    """
    name = f"step-{step:010d}"
    return name if version == 0 else f"{name}-v{version}"


def parse_step_version(name: str) -> tuple[int, int] | None:
    """(step, version) of a committed step directory's name, or None for any other name.

    Only the canonical name ``step_dir_name(step, version)`` counts (ASCII digits, exactly
    that padding, no ``-v0``, no leading zero in the version): another spelling of the same
    checkpoint would name a directory that restore does not read.
    """
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    version = int(match.group(2) or 0)
    if step > MAX_STEP or version > MAX_INT or step_dir_name(step, version) != name:
        return None
    return step, version


def parse_step_dir(name: str) -> int | None:
    """The step of a committed step directory's name (of any version, see
    :func:`parse_step_version`), or None for any other name."""
    parsed = parse_step_version(name)
    return None if parsed is None else parsed[0]


# --- the checksum ----------------------------------------------------------------------


def seal(body: bytes) -> bytes:
    """A JSON object's bytes with a last field ``"checksum": "sha256:<hex>"`` holding the
    SHA-256 of ``body`` (the bytes without that field)."""
    if not body.startswith(b"{") or not body.endswith(b"}") or body == b"{}":
        raise ValueError("only a non-empty JSON object can be sealed")
    digest = hashlib.sha256(body).hexdigest().encode("ascii")
    return body[:-1] + _SEAL_HEAD + digest + b'"}'


def seal_of(data: bytes) -> str | None:
    """The checksum that sealed ``data`` (the hex SHA-256 of its body, unverified: read it of
    data whose seal was checked), or None when it carries none. Copies of one checkpoint hold
    the same manifest bytes (an upload copies them as they are), so the same seal: what ranks
    restoring copies on their own disks compare, without hashing the manifest again."""
    match = _SEAL_TAIL.fullmatch(data[-_SEAL_LEN:])
    return None if match is None else match.group(1).decode("ascii")


def _unseal(data: bytes, where: str, step: int | None) -> bytes | None:
    """The checked body of sealed ``data``, or None when ``data`` carries no checksum."""
    match = _SEAL_TAIL.fullmatch(data[-_SEAL_LEN:])
    if match is None:
        return None
    body = data[:-_SEAL_LEN] + b"}"
    if hashlib.sha256(body).hexdigest().encode("ascii") != match.group(1):
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch: the manifest was changed or damaged after it was written",
            step=step,
        )
    return body


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range")
    return value


def _loads(body: bytes, where: str, step: int | None) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity, finite floats, bounded nesting (the parser's
    recursion limit: a deeper document raises RecursionError, refused here)."""
    try:
        return json.loads(
            body.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{where} is not valid JSON: {type(e).__name__}: {str(e)[:200]}", step=step
        ) from e


def load_sealed(data: bytes, *, where: str, limit: int = MAX_MANIFEST_BYTES) -> Any:
    """The JSON document in sealed ``data`` (see :func:`seal`), after checking its size and its
    checksum.

    Raises:
        CorruptCheckpointError: too large, no checksum, a checksum mismatch or invalid JSON.
    """
    if len(data) > limit:
        raise CorruptCheckpointError(f"{where} has {len(data)} bytes, more than {limit}")
    body = _unseal(data, where, None)
    if body is None:
        raise CorruptCheckpointError(f"{where} has no checksum")
    return _loads(body, where, None)


# --- the records -----------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A byte range of one array as stored: ``length`` raw bytes from ``start`` of the array,
    stored as ``nbytes`` bytes at ``offset`` of ``file``, with the checksum of the stored bytes."""

    file: str
    offset: int
    nbytes: int
    start: int
    length: int
    crc32c: int
    params: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The piece as JSON values (its fields in order, as ``dataclasses.asdict``)."""
        return {
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "start": self.start,
            "length": self.length,
            "crc32c": self.crc32c,
            "params": self.params,
        }


@dataclass(frozen=True)
class TensorEntry:
    """One array: what it is, how it was encoded, and where its pieces are."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    pieces: tuple[Piece, ...]
    numpy_dtype: str | None = None
    # None: the pieces are byte ranges of the array's row-major bytes. Else the array is
    # stored as these boxes of it (disjoint, tiling it, sorted by offsets), each box's own
    # row-major bytes one after another, and the pieces are byte ranges of that.
    boxes: tuple[Region, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The entry as JSON values (its fields in order, as ``dataclasses.asdict``; ``boxes``
        only when set, as ``[offsets, shape]`` pairs)."""
        doc: dict[str, Any] = {
            "key": self.key,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": self.shape,
            "codec": self.codec,
            "pieces": [p.to_dict() for p in self.pieces],
            "numpy_dtype": self.numpy_dtype,
        }
        if self.boxes is not None:
            doc["boxes"] = [[list(b.offsets), list(b.shape)] for b in self.boxes]
        return doc

    @property
    def nbytes(self) -> int:
        """Stored bytes of every piece."""
        return sum(p.nbytes for p in self.pieces)

    @property
    def raw_nbytes(self) -> int:
        """The array's bytes in memory."""
        return sum(p.length for p in self.pieces)


@dataclass(frozen=True)
class RankState:
    """State that differs per rank (random states, ...): its tree and its arrays."""

    tree: Any
    tensors: tuple[TensorEntry, ...]

    def to_dict(self) -> dict[str, Any]:
        """The rank's state as JSON values (its fields in order, as ``dataclasses.asdict``)."""
        return {"tree": self.tree, "tensors": [t.to_dict() for t in self.tensors]}


@dataclass(frozen=True)
class DataFile:
    """A data file of the checkpoint and its size in bytes."""

    name: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        """The file as JSON values (its fields in order, as ``dataclasses.asdict``)."""
        return {"name": self.name, "nbytes": self.nbytes}


@dataclass(frozen=True)
class Manifest:
    """Everything needed to find, verify and rebuild one checkpoint; no code, only data."""

    step: int
    created_unix: float
    tree: Any
    tensors: tuple[TensorEntry, ...]
    files: tuple[DataFile, ...]
    format_version: int = FORMAT_VERSION
    world_size: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    per_rank: tuple[RankState, ...] = ()
    token: str = ""
    bases: tuple[int, ...] = ()
    run: str = ""
    # The directory's commit order: 1 + the highest one committed in it (and in the other
    # tier) when this was written, under the writer's lease. 0: not recorded (a manifest of an
    # earlier 0.1.0.dev0), ordered before every recorded one. The newest checkpoint is the
    # highest; ``created_unix`` is for display only (a wall clock can be behind or ahead).
    sequence: int = 0

    @property
    def nbytes(self) -> int:
        """Total size of the data files."""
        return sum(f.nbytes for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON values (``dataclasses.asdict``'s document without its deep copy:
        the values are shared with the manifest, not copied), the head's fields first."""
        # the head first, in the order of _HEAD_PREFIX: a listing reads it without the rest
        return {
            "format_version": self.format_version,
            "step": self.step,
            "created_unix": self.created_unix,
            "run": self.run,
            "sequence": self.sequence,
            "bases": self.bases,
            "tree": self.tree,
            "tensors": [t.to_dict() for t in self.tensors],
            "files": [f.to_dict() for f in self.files],
            "world_size": self.world_size,
            "metadata": self.metadata,
            "per_rank": [r.to_dict() for r in self.per_rank],
            "token": self.token,
        }

    @property
    def has_boxes(self) -> bool:
        """Whether an array (shared or a rank's own) is stored as boxes."""
        return any(
            t.boxes is not None
            for t in (*self.tensors, *(t for r in self.per_rank for t in r.tensors))
        )

    @property
    def has_ints(self) -> bool:
        """Whether a state tree (a rank's own, where the adapters keep Python's random state,
        looked at first; or the shared one) holds an ``ints`` node."""
        return self._has_ints(None)

    def _has_ints(self, tree_ints: bool | None) -> bool:
        """:attr:`has_ints`, the shared tree walked only where ``tree_ints`` does not say
        whether it holds one (None)."""
        if any(holds_ints(r.tree) for r in self.per_rank):
            return True
        return tree_ints if tree_ints is not None else holds_ints(self.tree)

    def to_json(
        self, *, tree_ints: bool | None = None, tensors_json: tuple[str, bool] | None = None
    ) -> bytes:
        """The manifest as UTF-8 JSON, with its checksum as the last field (format 3; 4 when
        an array is stored as boxes; 5 when a state tree holds an ``ints`` node).
        ``tree_ints``: whether the shared tree holds one, as the flatten that made it said
        (None: the tree is walked to find out). ``tensors_json``: the JSON array of the
        shared arrays' entries, in place of :attr:`tensors` (which must then be empty), and
        whether one of them is stored as boxes (the writer's template of them: see
        :mod:`coci_core.engine.save.entries`)."""
        doc = self.to_dict()
        boxes = tensors_json is not None and tensors_json[1]
        doc["format_version"] = (
            INTS_FORMAT_VERSION
            if self._has_ints(tree_ints)
            else BOXES_FORMAT_VERSION
            if boxes or self.has_boxes
            else FORMAT_VERSION
        )
        if tensors_json is None:
            text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
        else:
            if self.tensors:
                raise ValueError("tensors_json is given in place of the manifest's tensors")
            # json.dumps(doc)'s text, with the given array in place of "tensors"
            keys = list(doc)
            at = keys.index("tensors")
            head = {k: doc[k] for k in keys[:at]}
            tail = {k: doc[k] for k in keys[at + 1 :]}
            text = (
                json.dumps(head, separators=(",", ":"), allow_nan=False)[:-1]
                + ',"tensors":'
                + tensors_json[0]
                + ","
                + json.dumps(tail, separators=(",", ":"), allow_nan=False)[1:]
            )
        return seal(text.encode("utf-8"))

    @classmethod
    def from_json(
        cls, data: bytes, *, where: str = "manifest", step: int | None = None
    ) -> Manifest:
        """Parse and check a manifest.

        The checksum is verified first, then the format version (3, 4 or 5). Every
        field is then checked: its JSON type; integers within ``[0, 2**63)``; file names plain ASCII
        (``[A-Za-z0-9._-]``, at most 128); dtypes known, numpy dtypes numbers of the matching
        size; each array's shape times its itemsize (at most ``MAX_ARRAY_BYTES``) equal to its
        pieces' lengths, which tile it in order; raw pieces stored as they are; every piece
        within its data file's recorded size; the state tree well formed, at most
        ``MAX_TREE_DEPTH`` deep, every array node naming an array in the order and at the paths
        the arrays' keys say, every array once.

        Raises:
            CorruptCheckpointError: naming the field (and ``step``, when given).
        """
        doc, body = _document(data, where, step)
        manifest = RecordChecker(where, step).manifest(doc, sealed=body is not None)
        if body is not None:
            _check_prefix_agrees(body, doc, where, step)
        return manifest

    @classmethod
    def from_head(cls, doc: Any, *, where: str = "manifest", step: int | None = None) -> Manifest:
        """The manifest of a document that :func:`read_head` returned, checked as
        :meth:`from_json` checks it (its checksum was verified there).

        Raises:
            CorruptCheckpointError: naming the field (and ``step``, when given).
        """
        return RecordChecker(where, step).manifest(doc, sealed=True)


class ManifestHead(NamedTuple):
    """What ordering and retention read of a manifest: its step, creation time, run, the
    steps its deltas need and its commit sequence."""

    step: int
    created_unix: float
    run: str
    bases: tuple[int, ...]
    sequence: int


def _sealed_body(data: bytes, where: str, step: int | None) -> bytes | None:
    """The checked body of a manifest's bytes (size and checksum checked), or None when it
    carries no checksum."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"{where} has {len(data)} bytes, more than {MAX_MANIFEST_BYTES}", step=step
        )
    return _unseal(data, where, step)


def _document(data: bytes, where: str, step: int | None) -> tuple[Any, bytes | None]:
    """The JSON document of a manifest's bytes (size and checksum checked) and its sealed
    body (None when it carries no checksum)."""
    body = _sealed_body(data, where, step)
    return _loads(data if body is None else body, where, step), body


def read_head(
    data: bytes, *, where: str = "manifest", step: int | None = None
) -> tuple[Any, ManifestHead]:
    """A manifest's document and its head: the checks of :meth:`Manifest.from_json` up to
    the fields of :class:`ManifestHead` (the checksum, the format, the top-level fields, the
    head's values); the arrays, files and trees are checked by :meth:`Manifest.from_head`.

    Raises:
        CorruptCheckpointError: naming the field (and ``step``, when given).
    """
    doc, body = _document(data, where, step)
    return doc, RecordChecker(where, step).head(doc, sealed=body is not None)


# The head as this coci writes it, first (see Manifest.to_dict): each value a JSON number, a
# run of letters and digits, or an array of numbers, so that the prefix ends at the comma
# after ``bases``. A manifest written otherwise (an earlier coci's) is decoded whole.
_HEAD_PREFIX = re.compile(
    rb'\{"format_version":[0-9]{1,20},"step":[0-9]{1,20},"created_unix":[-+.eE0-9]{1,40},'
    rb'"run":"[A-Za-z0-9]{0,64}","sequence":[0-9]{1,20},"bases":\[[0-9,]*\],'
)


def _prefix_doc(body: bytes, where: str, step: int | None) -> dict[str, Any] | None:
    match = _HEAD_PREFIX.match(body)
    if match is None:
        return None
    doc: dict[str, Any] = _loads(match.group(0)[:-1] + b"}", where, step)
    return doc


def read_head_only(
    data: bytes, *, where: str = "manifest", step: int | None = None
) -> tuple[Any | None, ManifestHead]:
    """A manifest's head, as :func:`read_head` checks it, read from the head's fields at the
    start of the document when it starts with them (as this coci writes it; the document is
    then not decoded: None in its place), else from the document decoded whole (returned with
    the head). The checksum covers the whole manifest either way; the other fields are checked
    by the restore that reads the manifest, which also refuses a head's field given twice with
    different values.

    Raises:
        CorruptCheckpointError: naming the field (and ``step``, when given).
    """
    body = _sealed_body(data, where, step)
    prefix = None if body is None else _prefix_doc(body, where, step)
    if prefix is None:
        doc = _loads(data if body is None else body, where, step)
        return doc, RecordChecker(where, step).head(doc, sealed=body is not None)
    doc = dict.fromkeys(_REQUIRED_TOP_FIELDS)  # the others are checked when it is read whole
    doc.update(prefix)
    return None, RecordChecker(where, step).head(doc, sealed=True)


def _check_prefix_agrees(body: bytes, doc: Any, where: str, step: int | None) -> None:
    """Refuse a manifest whose head, as :func:`read_head_only` reads it from the start of the
    document, is not the head of the whole document (a field given twice: JSON keeps the
    last), so that a listing and the restore order it alike."""
    prefix = _prefix_doc(body, where, step)
    if prefix is not None and any(doc.get(k) != v for k, v in prefix.items()):
        raise CorruptCheckpointError(
            f"{where} gives a field of its head twice, with different values", step=step
        )


def check_readable_head(manifest: Manifest, *, where: str) -> None:
    """Raise what reading ``manifest`` back would raise for its head (step, commit sequence,
    creation time, run, bases): the writer checks this before it commits, so that it never
    reports committed a checkpoint that a resume refuses.

    Raises:
        CorruptCheckpointError: naming the field.
    """
    doc: dict[str, Any] = dict.fromkeys(_REQUIRED_TOP_FIELDS)  # the others are not read here
    doc.update(
        format_version=FORMAT_VERSION,
        step=manifest.step,
        created_unix=manifest.created_unix,
        run=manifest.run,
        bases=list(manifest.bases),
        sequence=manifest.sequence,
    )
    RecordChecker(where, manifest.step).head(doc, sealed=True)


def parse_tensor_entry(t: Any) -> TensorEntry:
    """A tensor entry from its JSON form, checked as in a manifest (without the data files'
    sizes).

    Raises:
        CorruptCheckpointError: the entry is malformed.
    """
    return RecordChecker("tensor entry", None).entry(t, "entry", files=None)


# --- checking ---------------------------------------------------------------------------

_TOP_FIELDS = (
    "format_version",
    "step",
    "created_unix",
    "tree",
    "tensors",
    "files",
    "world_size",
    "metadata",
    "per_rank",
    "token",
    "bases",
    "run",
    "sequence",
)
# Fields a manifest written by an earlier 0.1.0.dev0 lacks (read as 0: see Manifest.sequence).
_OPTIONAL_TOP_FIELDS = ("sequence",)
_REQUIRED_TOP_FIELDS = tuple(f for f in _TOP_FIELDS if f not in _OPTIONAL_TOP_FIELDS)
_ENTRY_FIELDS = ("key", "kind", "dtype", "shape", "codec", "pieces", "numpy_dtype", "boxes")
_ENTRY_REQUIRED_FIELDS = _ENTRY_FIELDS[:-2]
_PIECE_FIELDS = ("file", "offset", "nbytes", "start", "length", "crc32c", "params")
_KINDS = ("tensor", "ndarray", "torch_save")


def _show(value: Any) -> str:
    """A short description of a JSON value for an error message (never a huge repr)."""
    if type(value) is int:
        return repr(value) if value.bit_length() <= 64 else f"a {value.bit_length()}-bit integer"
    if value is None or type(value) in (bool, float):
        return repr(value)
    if type(value) is str:
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    if type(value) in (list, dict):
        return f"a JSON {'array' if type(value) is list else 'object'} of {len(value)}"
    return type(value).__name__


class RecordChecker:
    """Checks a manifest's JSON document (or a manifest-like record: a rank's commit marker)
    field by field; every error is a CorruptCheckpointError naming ``where`` and the field."""

    def __init__(self, where: str, step: int | None) -> None:
        self.where = where
        self.step = step
        self.version: int | None = None  # the document's, once read
        self.world_size = MAX_WORLD_SIZE  # the document's, once read: bounds an array's boxes

    def fail(self, name: str, why: str) -> NoReturn:
        raise CorruptCheckpointError(f"{self.where}: field {name} {why}", step=self.step)

    def obj(
        self, value: Any, name: str, required: tuple[str, ...], allowed: tuple[str, ...] | None
    ) -> dict[str, Any]:
        if type(value) is not dict:
            self.fail(name, f"must be an object, got {_show(value)}")
        missing = [k for k in required if k not in value]
        if missing:
            self.fail(name, f"lacks {missing}")
        if allowed is not None:
            extra = sorted(str(k)[:40] for k in value if k not in allowed)
            if extra:
                self.fail(name, f"has unknown fields {extra[:5]}")
        return value

    def int_(self, value: Any, name: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if type(value) is not int or not lo <= value <= hi:
            self.fail(name, f"must be an integer in [{lo}, {hi}], got {_show(value)}")
        return value

    def str_(self, value: Any, name: str, max_len: int | None = None) -> str:
        if type(value) is not str or (max_len is not None and len(value) > max_len):
            limit = f" of at most {max_len} characters" if max_len is not None else ""
            self.fail(name, f"must be a string{limit}, got {_show(value)}")
        return value

    def list_(self, value: Any, name: str) -> list[Any]:
        if type(value) is not list:
            self.fail(name, f"must be an array, got {_show(value)}")
        return value

    def file_name(self, value: Any, name: str) -> str:
        # File names come from the manifest: plain ASCII names, never a path or "." / "..".
        if type(value) is not str or not _FILE_NAME.fullmatch(value) or value in (".", ".."):
            self.fail(name, f"must be a plain name ([A-Za-z0-9._-]), got {_show(value)}")
        return value

    def head(self, doc: Any, *, sealed: bool) -> ManifestHead:
        doc = self.obj(doc, "(the document)", ("format_version",), None)
        version = doc["format_version"]
        if type(version) is not int or version not in READ_FORMAT_VERSIONS:
            raise CorruptCheckpointError(
                f"{self.where} has format_version {_show(version)}; this coci reads "
                f"formats {', '.join(map(str, READ_FORMAT_VERSIONS[:-1]))} and "
                f"{READ_FORMAT_VERSIONS[-1]}",
                step=self.step,
            )
        self.version = version
        if not sealed:
            raise CorruptCheckpointError(
                f"{self.where}: format {version} has no valid checksum; the manifest is damaged",
                step=self.step,
            )
        self.obj(doc, "(the document)", _REQUIRED_TOP_FIELDS, _TOP_FIELDS)
        step = self.int_(doc["step"], "step", 0, MAX_STEP)
        sequence = self.int_(doc.get("sequence", 0), "sequence", 0, MAX_SEQUENCE)
        created = doc["created_unix"]
        if type(created) not in (int, float) or not 0 <= created <= MAX_CREATED_UNIX:
            self.fail("created_unix", f"must be a time in [0, 2**37], got {_show(created)}")
        run = self.str_(doc["run"], "run", MAX_RUN)
        if not run.isascii() or not run.isalnum():
            self.fail("run", f"must be letters and digits, got {_show(run)}")
        bases = tuple(
            self.int_(b, f"bases[{i}]", 0, step - 1)
            for i, b in enumerate(self.list_(doc["bases"], "bases"))
        )
        if len(set(bases)) != len(bases):
            self.fail("bases", "repeats a step")
        return ManifestHead(step, float(created), run, bases, sequence)

    def manifest(self, doc: Any, *, sealed: bool) -> Manifest:
        step, created, run, bases, sequence = self.head(doc, sealed=sealed)
        files: dict[str, int] = {}
        for i, f in enumerate(self.list_(doc["files"], "files")):
            f = self.obj(f, f"files[{i}]", ("name", "nbytes"), ("name", "nbytes"))
            name = self.file_name(f["name"], f"files[{i}].name")
            if name in files:
                self.fail(f"files[{i}].name", f"repeats {name!r}")
            files[name] = self.int_(f["nbytes"], f"files[{i}].nbytes")
        world_size = self.int_(doc["world_size"], "world_size", 1, MAX_WORLD_SIZE)
        self.world_size = world_size
        metadata = doc["metadata"]
        if type(metadata) is not dict:
            self.fail("metadata", f"must be an object, got {_show(metadata)}")
        token = self.str_(doc["token"], "token", MAX_TOKEN)
        tensors = self.entries(doc["tensors"], "tensors", files)
        self.tree(doc["tree"], "tree", tensors, root=True)
        per_rank = []
        ranks = self.list_(doc["per_rank"], "per_rank")
        if len(ranks) > world_size:
            self.fail("per_rank", f"has {len(ranks)} ranks, the world size is {world_size}")
        for r, rank in enumerate(ranks):
            name = f"per_rank[{r}]"
            rank = self.obj(rank, name, ("tree", "tensors"), ("tree", "tensors"))
            own = self.entries(rank["tensors"], f"{name}.tensors", files)
            if rank["tree"] is not None or own:
                self.tree(rank["tree"], f"{name}.tree", own, root=True)
            per_rank.append(RankState(tree=rank["tree"], tensors=own))
        return Manifest(
            step=step,
            created_unix=created,
            tree=doc["tree"],
            tensors=tensors,
            files=tuple(DataFile(n, size) for n, size in files.items()),
            format_version=self.version or FORMAT_VERSION,
            world_size=world_size,
            metadata=metadata,
            per_rank=tuple(per_rank),
            token=token,
            bases=bases,
            run=run,
            sequence=sequence,
        )

    def tree(self, tree: Any, name: str, entries: tuple[TensorEntry, ...], root: bool) -> None:
        try:
            check_tree(
                tree,
                n_leaves=len(entries),
                kinds=[e.kind for e in entries],
                keys=[e.key for e in entries],
                what=f"field {name}",
                ints=self.version is None or self.version >= INTS_FORMAT_VERSION,
            )
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{self.where}: {e}", step=self.step) from None
        if root and not (type(tree) is dict and tree.get("t") in ("dict", "odict")):
            self.fail(name, f"must be a dict node, got {_show(tree)}")

    def entries(self, value: Any, name: str, files: dict[str, int]) -> tuple[TensorEntry, ...]:
        out: list[TensorEntry] = []
        for t in self.list_(value, name):
            entry = _plain_entry(t, files)
            out.append(entry if entry is not None else self.entry(t, f"{name}[{len(out)}]", files))
        return tuple(out)

    def entry(self, t: Any, name: str, files: dict[str, int] | None) -> TensorEntry:
        """The checked entry; every check below has its error message (the common case is
        accepted by :func:`_plain_entry` first, without building any)."""
        t = self.obj(t, name, _ENTRY_REQUIRED_FIELDS, _ENTRY_FIELDS)
        key = self.str_(t["key"], f"{name}.key")
        where = f"{name} ({key[:200]!r})"
        kind = t["kind"]
        if kind not in _KINDS:
            self.fail(f"{where}.kind", f"must be one of {_KINDS}, got {_show(kind)}")
        dtype = self.str_(t["dtype"], f"{where}.dtype", 64)
        try:
            itemsize = decode_dtype(dtype).itemsize
        except CorruptCheckpointError:
            self.fail(f"{where}.dtype", f"is an unknown dtype {dtype!r}")
        dims = self.list_(t["shape"], f"{where}.shape")
        if len(dims) > MAX_NDIM:
            self.fail(f"{where}.shape", f"has {len(dims)} dimensions, more than {MAX_NDIM}")
        shape = tuple(self.int_(n, f"{where}.shape[{i}]") for i, n in enumerate(dims))
        numel, extent = 1, 1
        for n in shape:
            numel *= n
            extent *= max(n, 1)
            if extent > MAX_ARRAY_BYTES:
                self.fail(f"{where}.shape", f"{list(shape)} is larger than any array coci stores")
        raw = numel * itemsize
        if raw > MAX_ARRAY_BYTES:
            self.fail(f"{where}.shape", f"{list(shape)} of {dtype} is {raw} bytes, too large")
        numpy_dtype = t.get("numpy_dtype")
        if kind == "ndarray":
            try:
                ndarray_dtype(numpy_dtype, dtype)
            except CorruptCheckpointError as e:
                self.fail(f"{where}.numpy_dtype", f"is wrong: {e}")
        elif numpy_dtype is not None:
            self.fail(f"{where}.numpy_dtype", f"is set for a {kind}")
        if kind == "torch_save" and (dtype != "uint8" or len(shape) != 1):
            self.fail(f"{where}", "is a torch.save leaf that is not a 1-D uint8 array")
        codec = self.str_(t["codec"], f"{where}.codec", 64)
        pieces = tuple(
            self.piece(p, f"{where}.pieces[{i}]")
            for i, p in enumerate(self.list_(t["pieces"], f"{where}.pieces"))
        )
        boxes = None
        if "boxes" in t:
            if self.version is not None and self.version < BOXES_FORMAT_VERSION:
                self.fail(f"{where}.boxes", f"is not a field of format {self.version}")
            if kind != "tensor":
                self.fail(f"{where}.boxes", f"is set for a {kind}")
            boxes = self.boxes(t["boxes"], f"{where}.boxes", shape)
        covered = 0
        for i, p in enumerate(pieces):
            pname = f"{where}.pieces[{i}]"
            if p.start != covered:
                self.fail(f"{pname}.start", f"is {p.start}: the pieces do not tile the array")
            covered += p.length
            if covered > raw:
                self.fail(f"{pname}.length", f"goes past the array's {raw} bytes")
            if p.params is None and p.nbytes != p.length:
                self.fail(f"{pname}.nbytes", f"is {p.nbytes} for a raw piece of {p.length}")
            if files is not None:
                if p.file not in files:
                    self.fail(f"{pname}.file", f"names {p.file!r}, which is not in files")
                if p.offset + p.nbytes > files[p.file]:
                    self.fail(
                        f"{pname}.offset",
                        f"{p.offset} + {p.nbytes} bytes is past the end of {p.file} "
                        f"({files[p.file]} bytes)",
                    )
        if covered != raw:
            self.fail(f"{where}.pieces", f"cover {covered} of its {raw} bytes ({shape}, {dtype})")
        return TensorEntry(
            key=key,
            kind=kind,
            dtype=dtype,
            shape=shape,
            codec=codec,
            pieces=pieces,
            numpy_dtype=numpy_dtype,
            boxes=boxes,
        )

    def boxes(self, value: Any, name: str, shape: tuple[int, ...]) -> tuple[Region, ...]:
        """An array's boxes: each ``[offsets, shape]`` inside the array and not empty, sorted
        by offsets, at most one per rank, their elements as many as the array's. (That they do
        not overlap is checked where they are read: with as many elements, an overlap leaves
        an element unfilled.)"""
        items = self.list_(value, name)
        if not 1 <= len(items) <= self.world_size:
            self.fail(name, f"must hold 1 to {self.world_size} boxes (one per rank at most)")
        boxes: list[Region] = []
        total = 0
        for i, item in enumerate(items):
            bname = f"{name}[{i}]"
            if type(item) is not list or len(item) != 2:
                self.fail(bname, f"must be a pair [offsets, shape], got {_show(item)}")
            for part in item:
                if type(part) is not list or len(part) != len(shape):
                    self.fail(bname, f"must hold {len(shape)} offsets and {len(shape)} sizes")
            offsets = tuple(self.int_(o, f"{bname}[0]") for o in item[0])
            sizes = tuple(self.int_(n, f"{bname}[1]", 1) for n in item[1])
            if any(o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)):
                self.fail(bname, f"{[list(offsets), list(sizes)]} is outside shape {list(shape)}")
            if boxes and offsets <= boxes[-1].offsets:
                self.fail(bname, "is not after the box before it (boxes are sorted by offsets)")
            boxes.append(Region(offsets, sizes))
            total += math.prod(sizes)
        if total != math.prod(shape):
            self.fail(name, f"hold {total} elements, the array {math.prod(shape)}")
        return tuple(boxes)

    def piece(self, p: Any, name: str) -> Piece:
        p = self.obj(p, name, _PIECE_FIELDS[:-1], _PIECE_FIELDS)
        params = p.get("params")
        if params is not None and type(params) is not dict:
            self.fail(f"{name}.params", f"must be an object or null, got {_show(params)}")
        return Piece(
            file=self.file_name(p["file"], f"{name}.file"),
            offset=self.int_(p["offset"], f"{name}.offset"),
            nbytes=self.int_(p["nbytes"], f"{name}.nbytes"),
            start=self.int_(p["start"], f"{name}.start"),
            length=self.int_(p["length"], f"{name}.length"),
            crc32c=self.int_(p["crc32c"], f"{name}.crc32c", 0, 0xFFFFFFFF),
            params=params,
        )


_ENTRY_KEYS = frozenset(_ENTRY_FIELDS[:-1])  # an entry with boxes takes the full checker
_ENTRY_REQUIRED = frozenset(_ENTRY_REQUIRED_FIELDS)
_PIECE_KEYS = frozenset(_PIECE_FIELDS)
_PIECE_REQUIRED = frozenset(_PIECE_FIELDS[:-1])
_MAX_CRC = 0xFFFFFFFF
_itemsizes: dict[str, int] = {}


def _itemsize(dtype: str) -> int | None:
    size = _itemsizes.get(dtype)
    if size is None:
        try:
            size = _itemsizes[dtype] = decode_dtype(dtype).itemsize
        except CorruptCheckpointError:
            return None
    return size


def _plain_entry(t: Any, files: dict[str, int]) -> TensorEntry | None:
    """A ``"tensor"`` entry that passes every check of :meth:`RecordChecker.entry`, checked
    without building an error message; None for anything else (which the full checker then
    accepts or refuses with its message)."""
    if type(t) is not dict or not t.keys() >= _ENTRY_REQUIRED or not t.keys() <= _ENTRY_KEYS:
        return None
    key, dtype, dims, codec, stored = t["key"], t["dtype"], t["shape"], t["codec"], t["pieces"]
    if (
        t["kind"] != "tensor"
        or t.get("numpy_dtype") is not None
        or type(key) is not str
        or type(dtype) is not str
        or len(dtype) > 64
        or type(codec) is not str
        or len(codec) > 64
        or type(dims) is not list
        or len(dims) > MAX_NDIM
        or type(stored) is not list
    ):
        return None
    itemsize = _itemsize(dtype)
    if itemsize is None:
        return None
    numel = extent = 1
    for n in dims:
        if type(n) is not int or not 0 <= n <= MAX_INT:
            return None
        numel *= n
        extent *= max(n, 1)
        if extent > MAX_ARRAY_BYTES:
            return None
    raw = numel * itemsize
    if raw > MAX_ARRAY_BYTES:
        return None
    pieces = []
    covered = 0
    for p in stored:
        if type(p) is not dict or not p.keys() >= _PIECE_REQUIRED or not p.keys() <= _PIECE_KEYS:
            return None
        name, offset, nbytes, start, length, crc = (
            p["file"],
            p["offset"],
            p["nbytes"],
            p["start"],
            p["length"],
            p["crc32c"],
        )
        params = p.get("params")
        if (
            type(name) is not str
            or name not in files  # the names in files are checked plain names
            or type(offset) is not int
            or type(nbytes) is not int
            or type(start) is not int
            or type(length) is not int
            or type(crc) is not int
            or not 0 <= offset <= MAX_INT
            or not 0 <= nbytes <= MAX_INT
            or not 0 <= length <= MAX_INT
            or not 0 <= crc <= _MAX_CRC
            or start != covered
            or (params is None and nbytes != length)
            or (params is not None and type(params) is not dict)
            or offset + nbytes > files[name]
        ):
            return None
        covered += length
        if covered > raw:
            return None
        pieces.append(Piece(name, offset, nbytes, start, length, crc, params))
    if covered != raw:
        return None
    return TensorEntry(key, "tensor", dtype, tuple(dims), codec, tuple(pieces), None)
