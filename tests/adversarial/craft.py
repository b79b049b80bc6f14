"""Crafting damaged checkpoints: manifests edited as JSON (resealed with a valid checksum, or
not), delta chains, storages that delete a step at a chosen call.

Self-contained on purpose (the seal is computed here, not imported), so that these tests also
run against a coci that predates format 3 and show its defects.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from coci_core.engine.format.manifest import step_dir_name
from coci_core.storage import Storage, StorageWrapper
from tests.harness.states import assert_same


def manifest_path(root: Path, step: int) -> Path:
    return root / step_dir_name(step) / "manifest.json"


def read_doc(root: Path, step: int) -> dict[str, Any]:
    """A step's manifest as JSON, without its checksum field."""
    doc: dict[str, Any] = json.loads(manifest_path(root, step).read_bytes())
    doc.pop("checksum", None)
    return doc


def seal_bytes(body: bytes) -> bytes:
    """``body`` (a JSON object) with a valid format-3 checksum as its last field."""
    digest = hashlib.sha256(body).hexdigest()
    return body[:-1] + b',"checksum":"sha256:' + digest.encode() + b'"}'


def encode_doc(
    doc: dict[str, Any], *, seal: bool = True, raw: dict[str, str] | None = None
) -> bytes:
    """A manifest's bytes: compact JSON (NaN allowed, to craft it), sealed when ``seal``;
    ``raw`` replaces JSON strings ``"<name>"`` by raw text."""
    body = json.dumps(doc, separators=(",", ":"), allow_nan=True)
    for name, text in (raw or {}).items():
        body = body.replace(json.dumps(name), text)
    data = body.encode("utf-8")
    return seal_bytes(data) if seal else data


def write_doc(root: Path, step: int, doc: dict[str, Any], **kwargs: Any) -> None:
    manifest_path(root, step).write_bytes(encode_doc(doc, **kwargs))


def edit_manifest(
    root: Path, step: int, edit: Callable[[dict[str, Any]], Any], *, seal: bool = True
) -> None:
    """Edit a manifest as JSON; ``seal=False`` keeps the old checksum (random damage)."""
    path = manifest_path(root, step)
    old = json.loads(path.read_bytes()).get("checksum")
    doc = read_doc(root, step)
    edit(doc)
    if seal or old is None:
        path.write_bytes(encode_doc(doc, seal=seal))
    else:
        body = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
        path.write_bytes(body[:-1] + b',"checksum":' + json.dumps(old).encode() + b"}")


def same(a: Any, b: Any) -> bool:
    """Exactly equal: bitwise for tensors and arrays, == (and types) for the rest."""
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def craft_chain(root: Path, n: int, *, list_bases: bool = True) -> dict[str, Any]:
    """Steps 0..n-1 of one constant state, each step k >= 1 an XOR delta against step k-1
    (a chain n steps deep). ``list_bases``: each manifest lists its whole chain (as coci's
    writer does); otherwise only its direct base. Returns the state."""
    from coci_core import CheckpointManager

    state = {"w": torch.full((20000,), 1.5), "n": 7}
    with CheckpointManager(root, keep_last=None, compression="lossless") as mgr:
        mgr.save(0, state).wait()
        mgr.save(1, state).wait()
    template = read_doc(root, 1)
    (piece,) = template["tensors"][0]["pieces"]
    assert piece["params"]["codec"] == "coci.xor-zstd/1" and piece["params"]["base_step"] == 0
    for k in range(2, n):
        shutil.copytree(root / step_dir_name(1), root / step_dir_name(k))
    for k in range(1, n):
        doc = json.loads(json.dumps(template))
        doc["step"] = k
        doc["tensors"][0]["pieces"][0]["params"]["base_step"] = k - 1
        doc["bases"] = list(range(k)) if list_bases else [k - 1]
        write_doc(root, k, doc)
    return state


class HookedStorage(StorageWrapper):
    """Delegates to ``inner``; before each call, ``hook(op, path)`` runs (e.g. to delete a
    step directory at a chosen point: a deterministic concurrent deletion)."""

    def __init__(self, inner: Storage, hook: Callable[[str, str], None]) -> None:
        super().__init__(inner)
        self.hook = hook

    def list_dir(self, path: str = "") -> list[str]:
        self.hook("list_dir", path)
        return self.inner.list_dir(path)

    def exists(self, path: str) -> bool:
        self.hook("exists", path)
        return self.inner.exists(path)

    def read_bytes(self, path: str) -> bytes:
        self.hook("read_bytes", path)
        return self.inner.read_bytes(path)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.hook("read_into", path)
        self.inner.read_into(path, offset, out)

    def size(self, path: str) -> int | None:
        self.hook("size", path)
        return self.inner.size(path)
