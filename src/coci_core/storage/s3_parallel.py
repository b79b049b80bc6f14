"""Parallel multipart uploads and parallel ranged reads for S3 (s3fs), used by
:class:`~coci_core.storage.FsspecStorage` for large files.

An upload cuts the caller's chunks into parts of ``S3_PART_BYTES`` and sends up to
``S3_PARALLEL`` of them at once; at most ``2 x S3_PARALLEL`` parts are held in memory (each
part is copied once from the caller's buffers: the state is never copied whole). Any failure
aborts the multipart upload, so nothing of it stays on the server or becomes visible. A file
shorter than one part is sent with a single put.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from coci_core.knobs import S3_PARALLEL, S3_PART_BYTES

__all__ = ["abort_uploads", "is_s3", "read_ranges", "upload"]


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs file system (the parallel paths need its client calls)."""
    protocol = fs.protocol
    names = set(protocol) if isinstance(protocol, (tuple, list)) else {protocol}
    return bool(names & {"s3", "s3a"}) and hasattr(fs, "call_s3")


def _parts(chunks: Iterable[memoryview], part_bytes: int) -> Iterator[bytes]:
    """The bytes of ``chunks`` in parts of ``part_bytes`` (the last one shorter)."""
    pending = bytearray()
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while len(view):
            take = min(part_bytes - len(pending), len(view))
            pending += view[:take]
            view = view[take:]
            if len(pending) == part_bytes:
                yield bytes(pending)
                pending.clear()
    if pending:
        yield bytes(pending)


def upload(
    fs: Any,
    path: str,
    chunks: Iterable[memoryview],
    *,
    part_bytes: int = S3_PART_BYTES,
    parallel: int = S3_PARALLEL,
) -> int:
    """Write ``chunks`` to ``path`` (``bucket/key``) with a parallel multipart upload; the
    bytes written. On any error the upload is aborted and the error raised."""
    bucket, key, _ = fs.split_path(path)
    parts = _parts(chunks, part_bytes)
    first = next(parts, b"")
    second = next(parts, None)
    if second is None:  # one part or less: a single put
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=first)
        return len(first)
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    written = 0
    try:

        def send(number: int, body: bytes) -> dict[str, Any]:
            out = fs.call_s3(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
            return {"PartNumber": number, "ETag": out["ETag"]}

        done: list[dict[str, Any]] = []
        with cf.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="coci-s3") as pool:
            inflight: set[cf.Future[dict[str, Any]]] = set()

            def collect(wait_for: int) -> None:
                while len(inflight) > wait_for:
                    finished, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
                    for future in finished:
                        inflight.discard(future)
                        done.append(future.result())  # raises the part's error

            for number, body in enumerate(_chain(first, second, parts), start=1):
                written += len(body)
                inflight.add(pool.submit(send, number, body))
                collect(2 * parallel - 1)
            collect(0)
        done.sort(key=lambda part: part["PartNumber"])
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": done},
        )
    except BaseException:
        with contextlib.suppress(Exception):  # the upload's own error is the one to raise
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        raise
    return written


def _chain(first: bytes, second: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield second
    yield from rest


def read_ranges(
    fs: Any,
    path: str,
    offset: int,
    out: memoryview,
    *,
    part_bytes: int = S3_PART_BYTES,
    parallel: int = S3_PARALLEL,
) -> int:
    """Fill ``out`` with the bytes of ``path`` from ``offset`` by parallel ranged GETs of
    ``part_bytes``; the bytes read (fewer when the object is shorter)."""
    view = out.cast("B")
    ranges = [
        (start, min(start + part_bytes, len(view))) for start in range(0, len(view), part_bytes)
    ]

    def get(span: tuple[int, int]) -> int:
        lo, hi = span
        data = fs.cat_file(path, start=offset + lo, end=offset + hi)
        view[lo : lo + len(data)] = data
        return len(data)

    with cf.ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="coci-s3") as pool:
        return sum(pool.map(get, ranges))


def abort_uploads(fs: Any, prefix: str) -> int:
    """Abort the multipart uploads still open under ``prefix`` (``bucket/key-prefix``): what a
    process killed during an upload left on the server (invisible, but billed). Only for the
    holder of the prefix's owner record, so that no live upload is cut. The number aborted."""
    bucket, key, _ = fs.split_path(prefix)
    key = key.rstrip("/") + "/" if key else ""
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    aborted = 0
    for item in listed.get("Uploads", []):
        fs.call_s3(
            "abort_multipart_upload", Bucket=bucket, Key=item["Key"], UploadId=item["UploadId"]
        )
        aborted += 1
    return aborted
