"""The versioned JSON manifest: the commit record of one checkpoint.

A step directory is a checkpoint exactly when it holds a manifest that parses: the manifest is
written last, after every data file (of every rank) is durable.

Format 2 stores each array as one or more *pieces* (byte ranges, possibly in different ranks'
data files); format 1 (one piece per array, in ``data-r0.bin``) is still read.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from coci_core.errors import CorruptCheckpointError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "DataFile",
    "Manifest",
    "Piece",
    "RankState",
    "TensorEntry",
    "parse_step_dir",
    "parse_tensor_entry",
    "step_dir_name",
]

FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{10,})$")


def step_dir_name(step: int) -> str:
    """The directory name of a committed step (zero-padded, so names sort by step)."""
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a committed step directory's name, or None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


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


@dataclass(frozen=True)
class DataFile:
    """A data file of the checkpoint and its size in bytes."""

    name: str
    nbytes: int


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

    @property
    def nbytes(self) -> int:
        """Total size of the data files."""
        return sum(f.nbytes for f in self.files)

    def to_json(self) -> bytes:
        """The manifest as UTF-8 JSON."""
        doc = asdict(self)
        doc["format_version"] = FORMAT_VERSION
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and check a manifest.

        Raises:
            CorruptCheckpointError: the manifest is not valid JSON, has an unknown format
                version, or lacks or mistypes a field.
        """
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{where} is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{where} is not a JSON object")
        version = doc.get("format_version")
        if version not in _READABLE_VERSIONS:
            raise CorruptCheckpointError(
                f"{where} has format_version {version!r}; this coci reads {_READABLE_VERSIONS}"
            )
        try:
            tensors = tuple(parse_tensor_entry(t, version) for t in doc["tensors"])
            files = tuple(
                DataFile(name=_safe_name(f["name"]), nbytes=_nonneg_int(f["nbytes"], "nbytes"))
                for f in doc["files"]
            )
            metadata = doc.get("metadata", {})
            if not isinstance(metadata, dict):
                raise TypeError("metadata must be an object")
            per_rank = tuple(
                RankState(
                    tree=r["tree"],
                    tensors=tuple(parse_tensor_entry(t, version) for t in r["tensors"]),
                )
                for r in doc.get("per_rank", ())
            )
            return cls(
                step=_nonneg_int(doc["step"], "step"),
                created_unix=float(doc["created_unix"]),
                tree=doc["tree"],
                tensors=tensors,
                files=files,
                format_version=version,
                world_size=_nonneg_int(doc.get("world_size", 1), "world_size"),
                metadata=metadata,
                per_rank=per_rank,
                token=str(doc.get("token", "")),
                bases=tuple(_nonneg_int(b, "bases") for b in doc.get("bases", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where} is malformed: {type(e).__name__}: {e}") from e


def parse_tensor_entry(t: Any, version: int = FORMAT_VERSION) -> TensorEntry:
    """A tensor entry from its JSON form (format ``version``)."""
    shape = tuple(_nonneg_int(x, "shape") for x in t["shape"])
    if version == 1:
        nbytes = _nonneg_int(t["nbytes"], "nbytes")
        pieces: tuple[Piece, ...] = (
            Piece(
                file=_safe_name(t["file"]),
                offset=_nonneg_int(t["offset"], "offset"),
                nbytes=nbytes,
                start=0,
                length=nbytes,
                crc32c=_nonneg_int(t["crc32c"], "crc32c"),
            ),
        )
    else:
        pieces = tuple(
            Piece(
                file=_safe_name(p["file"]),
                offset=_nonneg_int(p["offset"], "offset"),
                nbytes=_nonneg_int(p["nbytes"], "nbytes"),
                start=_nonneg_int(p["start"], "start"),
                length=_nonneg_int(p["length"], "length"),
                crc32c=_nonneg_int(p["crc32c"], "crc32c"),
                params=_params(p.get("params")),
            )
            for p in t["pieces"]
        )
    return TensorEntry(
        key=str(t["key"]),
        kind=_one_of(t["kind"], ("tensor", "ndarray", "torch_save"), "kind"),
        dtype=str(t["dtype"]),
        shape=shape,
        codec=str(t["codec"]),
        pieces=pieces,
        numpy_dtype=None if t.get("numpy_dtype") is None else str(t["numpy_dtype"]),
    )


def _params(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"params must be an object, got {value!r}")
    return value


def _nonneg_int(value: Any, name: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _one_of(value: Any, allowed: tuple[str, ...], name: str) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return str(value)


def _safe_name(value: Any) -> str:
    # File names come from the manifest: refuse anything that could point outside the step.
    if type(value) is not str or not value or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError(f"file name must be a plain name, got {value!r}")
    return value
