"""Parallel multipart uploads and ranged reads against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.storage import FsspecStorage, s3_parallel
from tests.harness.processes import Child, script
from tests.harness.s3 import S3Server

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part


def _open_uploads(server: S3Server, prefix: str) -> list[str]:
    fs = server.filesystem()
    bucket, key, _ = fs.split_path(prefix)
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    return [u["Key"] for u in listed.get("Uploads", [])]


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 3 * PART + 5])
def test_round_trip_around_part_boundaries(s3_server: S3Server, s3_prefix: str, size: int) -> None:
    """Any size, in uneven chunks, arrives byte for byte; parallel ranged reads return it."""
    data = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)
    )
    raw = data.numpy().tobytes()
    cuts = [0, size // 3, size // 3 + 7, size] if size > 8 else [0, size]
    chunks = [memoryview(raw)[a:b] for a, b in itertools.pairwise(cuts)]
    fs = s3_server.filesystem()
    path = f"{s3_prefix}/f.bin"
    written = s3_parallel.upload(fs, path, chunks, part_bytes=PART, parallel=3)
    assert written == size
    assert fs.cat_file(path) == raw
    out = bytearray(size)
    assert s3_parallel.read_ranges(fs, path, 0, memoryview(out), part_bytes=PART) == size
    assert bytes(out) == raw
    assert _open_uploads(s3_server, s3_prefix) == []


def test_a_failure_mid_upload_leaves_nothing(s3_server: S3Server, s3_prefix: str) -> None:
    """The chunk source fails after two parts were sent: the error reaches the caller, no
    object exists, and no multipart upload stays open."""

    def chunks() -> Iterator[memoryview]:
        for _ in range(3):
            yield memoryview(b"x" * PART)
        raise RuntimeError("the snapshot went away")

    fs = s3_server.filesystem()
    path = f"{s3_prefix}/torn.bin"
    with pytest.raises(RuntimeError, match="snapshot went away"):
        s3_parallel.upload(fs, path, chunks(), part_bytes=PART, parallel=2)
    assert not fs.exists(path)
    assert _open_uploads(s3_server, s3_prefix) == []


def test_a_large_state_saves_and_restores_through_the_parallel_paths(
    s3_server: S3Server, s3_prefix: str
) -> None:
    """A 48 MB state (several 16 MiB parts, several ranged reads) restores exactly."""
    url = f"s3://{s3_prefix}/run"
    state = {"w": torch.randn(12 * MiB, generator=torch.Generator().manual_seed(1))}
    with CheckpointManager(
        url, storage_options=s3_server.storage_options, compression="none"
    ) as mgr:
        mgr.save(1, state, block=True).wait()
        restored = mgr.restore()
    assert torch.equal(restored["w"], state["w"])


_KILLED_WRITER = """
import json, sys
from coci_core.storage import FsspecStorage
storage = FsspecStorage(sys.argv[1], **json.loads(sys.argv[2]))
def chunks():
    for i in range(4):
        yield memoryview(bytes([i]) * (5 << 20))
    print("PARTS SENT", flush=True)
    sys.stdin.read()  # blocks until killed
    yield memoryview(b"never")
from coci_core.storage import s3_parallel
s3_parallel.upload(storage.fs, storage._path("step-0000000002/data-r0-x.bin"), chunks(),
                   part_bytes=5 << 20, parallel=2)
"""


def test_sigkill_during_a_multipart_upload(s3_server: S3Server, s3_prefix: str) -> None:
    """A writer killed (SIGKILL) while its multipart upload is open: nothing becomes visible,
    the committed step restores, and the next writer aborts the open upload at its first save."""
    url = f"s3://{s3_prefix}/run"
    options = s3_server.storage_options
    with CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(1, {"w": torch.ones(1000)}, block=True).wait()
    with Child(script(_KILLED_WRITER, url, json.dumps(options))) as child:
        assert child.readline().strip() == "PARTS SENT"
        assert _open_uploads(s3_server, s3_prefix)  # the upload is open on the server
        child.kill()
        child.wait(timeout_s=30)
    with CheckpointManager(url, storage_options=options) as mgr:
        assert mgr.steps() == [1]
        assert torch.equal(mgr.restore()["w"], torch.ones(1000))
        mgr.save(2, {"w": torch.zeros(1000)}, block=True).wait()
        # aborted under the owner record, which the first save takes
        assert _open_uploads(s3_server, s3_prefix) == []
        assert torch.equal(mgr.restore()["w"], torch.zeros(1000))
    assert FsspecStorage(url, **options).exists("step-0000000002/manifest.json")
