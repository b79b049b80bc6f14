"""The first save's stall with and without ``warm_up``, against the steady stall.

``python -m benchmarks.first_save_bench --size-gb 1 --repeats 3``

Each round makes two new managers (``block=True``, no compression): one saves twice (the first
save allocates and faults in the host buffers; the second is the steady stall), the other calls
``warm_up(state)`` first (joined, as when it ran in the background after the first optimizer
step) and then saves. Cold and warm are interleaved; medians and ratios are printed and written
as JSON (``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import free
from benchmarks._lib.results import run_recorded
from benchmarks._lib.timing import med
from coci_core import CheckpointManager


def _stall(mgr: CheckpointManager, step: int, state: dict[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    handle = mgr.save(step, state, block=True)
    stall = time.perf_counter() - started
    handle.wait()
    return stall


def run(size_gb: float, repeats: int, root: Path) -> dict[str, Any]:
    n = int(size_gb * 1e9) // 4 // 8
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(n, generator=g) for i in range(8)}
    samples: dict[str, list[float]] = {"first_cold": [], "steady": [], "first_warm": []}
    for round_ in range(repeats):
        with CheckpointManager(root / f"cold{round_}", compression="none", keep_last=1) as mgr:
            samples["first_cold"].append(_stall(mgr, 1, state))
            samples["steady"].append(_stall(mgr, 2, state))
        free()
        with CheckpointManager(root / f"warm{round_}", compression="none", keep_last=1) as mgr:
            mgr.warm_up(state).join()
            samples["first_warm"].append(_stall(mgr, 1, state))
        free()
        print({k: round(v[-1], 3) for k, v in samples.items()}, flush=True)
    steady = med(samples["steady"])
    summary = {k: {"stall_s": med(v), "vs_steady": med(v) / steady} for k, v in samples.items()}
    return {"size_bytes": 8 * n * 4, "repeats": repeats, "samples": samples, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GB")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians over them)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: temp)")
    parser.add_argument("--out", default=None, help="results directory")
    args = parser.parse_args()
    result, path = run_recorded(
        "first_save",
        lambda tmp: run(args.size_gb, args.repeats, tmp),
        scratch_dir=args.dir,
        out_dir=args.out,
    )
    print(f"\n{args.size_gb:g} GB, {args.repeats} rounds, medians ({path})")
    for name, row in result["summary"].items():
        print(f"{name:<12} stall {row['stall_s']:.3f} s  ({row['vs_steady']:.2f}x steady)")


if __name__ == "__main__":
    main()
