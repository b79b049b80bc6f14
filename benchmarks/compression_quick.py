#!/usr/bin/env python
"""Two quick checks of the compression writer on 40 MB of drifting fp32 (about a minute):

1. "lossless" time to durable with buffered writes synced every 32 MiB (the disk works while the
   next piece is encoded) against one fsync at the end;
2. "auto" against "none", alternating, 80 saves each (medians).

    python -m benchmarks.compression_quick --dir bench-tmp
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

import coci_core.storage.local as local
from benchmarks._lib.files import scratch
from coci_core import CheckpointManager


def _state(step: int, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v + 1e-3 * step for k, v in base.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    args = ap.parse_args()
    args.dir = scratch(args.dir, "compression-quick")
    g = torch.Generator().manual_seed(0)
    base = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(10)}
    default_sync = local.SYNC_EVERY_BYTES
    for sync in (1 << 40, default_sync):
        local.SYNC_EVERY_BYTES = sync
        times = []
        with CheckpointManager(
            tempfile.mkdtemp(dir=args.dir), compression="lossless", keep_last=2
        ) as mgr:
            for step in range(8):
                times.append(mgr.save(step, _state(step, base)).wait().time_to_durable_s)
        label = "one fsync at the end" if sync == 1 << 40 else f"synced every {sync >> 20} MiB"
        print(f"lossless, {label}: median {statistics.median(times[1:]):.3f} s to durable")
    local.SYNC_EVERY_BYTES = default_sync
    mgrs = {
        mode: CheckpointManager(tempfile.mkdtemp(dir=args.dir), compression=mode, keep_last=2)
        for mode in ("none", "auto")
    }
    times2: dict[str, list[float]] = {mode: [] for mode in mgrs}
    for step in range(80):
        for mode in ("none", "auto") if step % 2 else ("auto", "none"):
            times2[mode].append(mgrs[mode].save(step, _state(step, base)).wait().time_to_durable_s)
    for mgr in mgrs.values():
        mgr.close()
    none, auto = (statistics.median(times2[m][2:]) for m in ("none", "auto"))
    print(f"none {none:.4f} s, auto {auto:.4f} s, auto / none = {auto / none:.3f}")


if __name__ == "__main__":
    main()
