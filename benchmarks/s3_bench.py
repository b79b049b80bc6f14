"""Checkpoints to S3 (a SeaweedFS server on loopback, started here), interleaved per round.

``python -m benchmarks.s3_bench --size-mb 1024 --repeats 3``

Methods, each on the same state and the same server:

* ``raw_put``: s3fs's own put of one object of the state's size (``pipe_file``): the limit.
* ``coci_remote``: ``CheckpointManager("s3://...")``, ``block=True``: time until committed
  in the bucket (the training loop waits for the copy into host memory only: ``stall``).
* ``coci_local``: ``CheckpointManager(local)`` alone (local disk): the stall to compare with.
* ``coci_tiers``: ``CheckpointManager(local, remote="s3://...")``: the stall, the time until
  committed locally, and until committed in the bucket (``remote.flush()``).
* ``dcp_fsspec``: ``torch.distributed.checkpoint.save`` with DCP's ``FsspecWriter``.
* ``torch_save_fsspec``: ``torch.save`` into ``fsspec.open(url, "wb")``: what Lightning's
  ModelCheckpoint does with an ``s3://`` dirpath (the loop waits for all of it).

Prints a table of medians and writes the results as JSON (``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.results import run_recorded
from benchmarks._lib.timing import med
from coci_core import CheckpointManager

MiB = 1 << 20


def _state(size_mb: int) -> dict[str, torch.Tensor]:
    """Ten float32 tensors of ``size_mb`` MB in all (random: nothing compresses)."""
    n = size_mb * MiB // 4 // 10
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(n, generator=g) for i in range(10)}


def _timed(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    started = time.perf_counter()
    out = fn()
    out.setdefault("durable_s", time.perf_counter() - started)
    return out


def run(size_mb: int, repeats: int, workdir: Path) -> dict[str, Any]:
    import fsspec
    import torch.distributed.checkpoint as dcp
    from tests.harness.s3 import start_s3_server
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # room for every round's objects: deleted ones are freed only when SeaweedFS vacuums
    volumes = 16 + (6 * size_mb * repeats) // 64
    server = start_s3_server(workdir / "seaweedfs", max_volumes=volumes)
    options = server.storage_options
    fs = server.filesystem()
    state = _state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    blob = b"".join(t.numpy().tobytes() for t in state.values())
    samples: dict[str, list[dict[str, float]]] = {}

    def raw_put(prefix: str) -> dict[str, float]:
        fs.pipe_file(f"{prefix}/raw.bin", blob)
        return {}

    def coci_remote(prefix: str) -> dict[str, float]:
        with CheckpointManager(
            f"s3://{prefix}/coci", storage_options=options, compression="none"
        ) as mgr:
            started = time.perf_counter()
            handle = mgr.save(1, state, block=True)
            stall = time.perf_counter() - started
            handle.wait()
            return {"stall_s": stall, "durable_s": time.perf_counter() - started}

    def coci_local(prefix: str) -> dict[str, float]:
        local = workdir / f"local-only-{prefix.rsplit('/', 1)[-1]}"
        with CheckpointManager(local, compression="none") as mgr:
            started = time.perf_counter()
            handle = mgr.save(1, state, block=True)
            stall = time.perf_counter() - started
            handle.wait()
            out = {"stall_s": stall, "durable_s": time.perf_counter() - started}
        shutil.rmtree(local, ignore_errors=True)
        return out

    def coci_tiers(prefix: str) -> dict[str, float]:
        local = workdir / f"local-{prefix.rsplit('/', 1)[-1]}"
        with CheckpointManager(
            local,
            remote=f"s3://{prefix}/tiers",
            remote_storage_options=options,
            compression="none",
        ) as mgr:
            assert mgr.remote is not None
            started = time.perf_counter()
            handle = mgr.save(1, state, block=True)
            stall = time.perf_counter() - started
            handle.wait()
            local_s = time.perf_counter() - started
            mgr.remote.flush()
            out = {"stall_s": stall, "local_s": local_s, "durable_s": time.perf_counter() - started}
        shutil.rmtree(local, ignore_errors=True)
        return out

    def dcp_fsspec(prefix: str) -> dict[str, float]:
        writer = FsspecWriter(f"s3://{prefix}/dcp", **options)
        dcp.save(state, storage_writer=writer, no_dist=True)
        return {}

    def torch_save_fsspec(prefix: str) -> dict[str, float]:
        with fsspec.open(f"s3://{prefix}/last.ckpt", "wb", **options) as f:
            torch.save(state, f)
        return {}

    methods = {
        "raw_put": raw_put,
        "coci_remote": coci_remote,
        "coci_local": coci_local,
        "coci_tiers": coci_tiers,
        "dcp_fsspec": dcp_fsspec,
        "torch_save_fsspec": torch_save_fsspec,
    }
    try:
        for round_ in range(repeats):
            for name, method in methods.items():  # interleaved: every method once per round
                prefix = f"{server.bucket}/r{round_}-{name}"
                samples.setdefault(name, []).append(_timed(lambda m=method, p=prefix: m(p)))
                with contextlib.suppress(FileNotFoundError):  # coci_local writes no object
                    fs.rm(prefix, recursive=True)
                print(f"round {round_} {name}: {samples[name][-1]}", flush=True)
    finally:
        server.stop()
    summary = {}
    limit = med([s["durable_s"] for s in samples["raw_put"]])
    for name, rows in samples.items():
        durable = med([r["durable_s"] for r in rows])
        summary[name] = {
            "durable_s": durable,
            "MB_per_s": nbytes / 1e6 / durable,
            "vs_raw_put": limit / durable,
            "stall_s": med([r.get("stall_s", r["durable_s"]) for r in rows]),
        }
    return {"size_bytes": nbytes, "repeats": repeats, "samples": samples, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-mb", type=int, default=256, help="state size in MB")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians over them)")
    parser.add_argument("--out", default=None, help="results directory")
    args = parser.parse_args()
    result, path = run_recorded(
        "s3", lambda tmp: run(args.size_mb, args.repeats, tmp), out_dir=args.out
    )
    print(f"\n{args.size_mb} MB, {args.repeats} rounds, medians ({path})")
    print(f"{'method':<20} {'durable s':>10} {'MB/s':>8} {'x raw put':>10} {'loop waits s':>13}")
    for name, row in result["summary"].items():
        print(
            f"{name:<20} {row['durable_s']:>10.2f} {row['MB_per_s']:>8.0f} "
            f"{row['vs_raw_put']:>10.2f} {row['stall_s']:>13.3f}"
        )


if __name__ == "__main__":
    main()
