"""Restore time, cold, of one state saved by each method; the disk's cold read limit beside it.

``python -m benchmarks.restore_bench --size-gb 1 --repeats 3``

Each round saves nothing new: the files are written once, then every round reads each method's
files after evicting them from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` on every
file; the page cache cannot be dropped system-wide without root), methods interleaved, each
round starting one method later than the one before:

* ``read_limit``: every coci data file read into one buffer allocated and written before, in
  16 MiB ``readinto`` calls, each dropped from the page cache after it (no checks), then summed
  like every method's result: the disk.
* ``coci_raw``, ``coci_lossless``: ``CheckpointManager.restore()``, every checksum verified.
* ``coci_raw_into``, ``coci_lossless_into``: ``restore(into={"model": model})`` into a model
  allocated (and written) before, read in place in 16 MiB reads, each checksummed after it and
  dropped from the page cache, every checksum verified.
* ``coci_raw_into_overlap``: the same with each read's checksum on a helper thread while the
  next one is read; ``coci_raw_into_cached``: leaving what was read in the page cache;
  ``coci_raw_into_whole``: each piece (62.5 MB here) read in one call: what each choice gives.
* ``torch_load``, ``torch_load_mmap``: ``torch.load(weights_only=True)`` (mmap touches every
  page: the tensors are summed, as a resume would read them).
* ``safetensors``: ``safetensors.torch.load_file``.
* ``dcp``: ``torch.distributed.checkpoint.load`` into preallocated tensors.

Besides the time, each method's peak resident memory above what the process held just before
it (VmHWM, reset through ``/proc/self/clear_refs``; the model is allocated before, as at a
resume). Prints medians and ratios and writes a JSON results file (``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import drop_file_cache, free
from benchmarks._lib.results import run_recorded
from benchmarks._lib.timing import med
from coci_core import CheckpointManager
from coci_core.engine.restore import read as restore_module
from coci_core.storage import local as local_storage

MiB = 1 << 20


class _Model(torch.nn.Module):
    """The benchmark's state as a module's buffers (what ``restore(into=...)`` fills)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in state.items():
            self.register_buffer(name, t)


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) * 1024 if match else 0


def _reset_peak() -> int:
    """Reset the peak resident memory to the current one (Linux); the current one."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _vm("VmRSS")


def _state(size_gb: float) -> dict[str, torch.Tensor]:
    n = int(size_gb * 1e9) // 4 // 16
    g = torch.Generator().manual_seed(0)
    # half random (incompressible), half a smooth signal (compresses), like weights + moments
    return {
        f"t{i}": (torch.randn(n, generator=g) if i % 2 else torch.linspace(0, 1, n).half().float())
        for i in range(16)
    }


def _touch(tensors: Any) -> float:
    """Read every byte (a resume does): the sum of each tensor."""
    if isinstance(tensors, dict):
        return sum(_touch(v) for v in tensors.values())
    return float(tensors.float().sum()) if isinstance(tensors, torch.Tensor) else 0.0


def run(size_gb: float, repeats: int, root: Path, only: list[str] | None = None) -> dict[str, Any]:
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    state = _state(size_gb)
    nbytes = sum(t.numel() * 4 for t in state.values())
    paths = {
        "coci_raw": root / "coci-raw",
        "coci_lossless": root / "coci-lossless",
        "torch_load": root / "model.pt",
        "safetensors": root / "model.safetensors",
        "dcp": root / "dcp",
    }
    with CheckpointManager(paths["coci_raw"], compression="none") as mgr:
        mgr.save(1, {"model": state}, block=True).wait()
    with CheckpointManager(paths["coci_lossless"], compression="lossless") as mgr:
        mgr.save(1, {"model": state}, block=True).wait()
    torch.save(state, paths["torch_load"])
    safetensors.torch.save_file(state, str(paths["safetensors"]))
    dcp.save(state, checkpoint_id=str(paths["dcp"]), no_dist=True)
    shapes = {k: (v.shape, v.dtype) for k, v in state.items()}
    data_files = sorted(paths["coci_raw"].rglob("data-*"))
    os.sync()

    # written once, so that the read limit does not count the kernel mapping fresh pages
    buffer = memoryview(bytearray(b"\1" * max(f.stat().st_size for f in data_files)))

    def read_limit() -> None:
        for f in data_files:
            with open(f, "rb", buffering=0) as fh:
                size = f.stat().st_size
                for start in range(0, size, 16 * MiB):
                    fh.readinto(buffer[start : min(size, start + 16 * MiB)])
                    os.posix_fadvise(fh.fileno(), start, 16 * MiB, os.POSIX_FADV_DONTNEED)
            _touch(torch.frombuffer(buffer[: size - size % 4], dtype=torch.float32))

    def coci(which: str) -> Callable[[], None]:
        def restore() -> None:
            with CheckpointManager(paths[which]) as mgr:
                _touch(mgr.restore())

        return restore

    # the live model a resume restores into: allocated and written before (not timed)
    model = _Model({k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()})

    def coci_into(
        which: str, *, chunk: int | None = None, overlap: bool = False, drop: bool = True
    ) -> Callable[[], None]:
        def restore() -> None:
            knobs = restore_module.READ_CHUNK_BYTES, restore_module.OVERLAP_CHECKSUMS
            restore_module.READ_CHUNK_BYTES = chunk or knobs[0]
            restore_module.OVERLAP_CHECKSUMS = overlap
            local_storage.DROP_READ_PAGES = drop
            try:
                with CheckpointManager(paths[which]) as mgr:
                    mgr.restore(into={"model": model})
            finally:
                restore_module.READ_CHUNK_BYTES, restore_module.OVERLAP_CHECKSUMS = knobs
                local_storage.DROP_READ_PAGES = True
            _touch(dict(model.state_dict()))

        return restore

    def dcp_load() -> None:
        target = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
        dcp.load(target, checkpoint_id=str(paths["dcp"]), no_dist=True)
        _touch(target)

    methods: dict[str, tuple[Path, Callable[[], None]]] = {
        "read_limit": (paths["coci_raw"], read_limit),
        "coci_raw": (paths["coci_raw"], coci("coci_raw")),
        "coci_raw_into": (paths["coci_raw"], coci_into("coci_raw")),
        "coci_raw_into_overlap": (paths["coci_raw"], coci_into("coci_raw", overlap=True)),
        "coci_raw_into_cached": (paths["coci_raw"], coci_into("coci_raw", drop=False)),
        "coci_raw_into_whole": (paths["coci_raw"], coci_into("coci_raw", chunk=1 << 62)),
        "coci_lossless": (paths["coci_lossless"], coci("coci_lossless")),
        "coci_lossless_into": (paths["coci_lossless"], coci_into("coci_lossless")),
        "torch_load": (
            paths["torch_load"],
            lambda: _touch(torch.load(paths["torch_load"], weights_only=True)),
        ),
        "torch_load_mmap": (
            paths["torch_load"],
            lambda: _touch(torch.load(paths["torch_load"], weights_only=True, mmap=True)),
        ),
        "safetensors": (
            paths["safetensors"],
            lambda: _touch(safetensors.torch.load_file(str(paths["safetensors"]))),
        ),
        "dcp": (paths["dcp"], dcp_load),
    }
    if only:
        unknown = sorted(set(only) - set(methods))
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; allowed: {sorted(methods)}")
        methods = {k: v for k, v in methods.items() if k in {"read_limit", "coci_raw", *only}}
    del state
    free()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    peaks: dict[str, list[int]] = {name: [] for name in methods}
    names = list(methods)
    for round_ in range(repeats):
        # each round starts one method later, so no method always follows the same one
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            path, method = methods[name]
            drop_file_cache(path)
            free()
            before = _reset_peak()
            started = time.perf_counter()
            method()
            samples[name].append(time.perf_counter() - started)
            peaks[name].append(_vm("VmHWM") - before)
            free()
            print(
                f"round {round_} {name}: {samples[name][-1]:.3f} s, "
                f"peak +{peaks[name][-1] / 1e6:.0f} MB",
                flush=True,
            )
    limit = med(samples["read_limit"])
    summary = {
        name: {
            "seconds": med(xs),
            "GB_per_s": nbytes / 1e9 / med(xs),
            "vs_read_limit": limit / med(xs),
            "coci_raw_faster_x": med(xs) / med(samples["coci_raw"]),
            "peak_extra_bytes": max(peaks[name]),
        }
        for name, xs in samples.items()
    }
    return {
        "size_bytes": nbytes,
        "repeats": repeats,
        "samples": samples,
        "peak_extra_bytes": peaks,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GB")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians over them)")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="results directory")
    parser.add_argument(
        "--methods", nargs="+", default=None, help="only these (read_limit, coci_raw always run)"
    )
    args = parser.parse_args()
    result, path = run_recorded(
        "restore",
        lambda tmp: run(args.size_gb, args.repeats, tmp, args.methods),
        scratch_dir=args.dir,
        out_dir=args.out,
    )
    print(f"\n{args.size_gb:g} GB, {args.repeats} rounds, cold, medians ({path})")
    header = ("method", "seconds", "GB/s", "x read limit", "coci_raw is x faster", "peak +MB")
    print(
        f"{header[0]:<21} {header[1]:>8} {header[2]:>6} {header[3]:>13} {header[4]:>21} "
        f"{header[5]:>9}"
    )
    for name, row in result["summary"].items():
        print(
            f"{name:<21} {row['seconds']:>8.2f} {row['GB_per_s']:>6.2f} "
            f"{row['vs_read_limit']:>13.2f} {row['coci_raw_faster_x']:>21.2f} "
            f"{row['peak_extra_bytes'] / 1e6:>9.0f}"
        )


if __name__ == "__main__":
    main()
