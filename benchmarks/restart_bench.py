"""Restart time: from a new process's start to the end of its first training step after a
resume, coci against each framework's own checkpointing, the same state, interleaved per round.

``python -m benchmarks.restart_bench --size-mb 1024 --repeats 3``

For Lightning: ``CociCheckpoint`` against ``ModelCheckpoint`` (``fit(ckpt_path="last")`` for
both); for Accelerate: ``CociCheckpointer.resume()`` against ``accelerator.load_state``. The
state is a model's weights and Adam's two moments (``--size-mb`` in all). Each method's
checkpoint is written once by a first process; then every round starts, for each method, a new
process with the checkpoint's pages evicted from the page cache (the libraries stay cached, as on
a node that restarts a job), which resumes and exits at the end of its first step. ``fresh``
starts the same job without a checkpoint: the start-up that every method pays, so that
``restart - fresh`` is what resuming costs, and ``native / fresh`` is the most any checkpointing
library could gain over the native one on the whole restart (one whose resume cost nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._lib.files import drop_file_cache
from benchmarks._lib.results import log, run_recorded
from benchmarks._lib.timing import med

FRAMEWORKS = {"lightning": ("coci", "native", "fresh"), "accelerate": ("coci", "native", "fresh")}
NATIVE = {"lightning": "ModelCheckpoint", "accelerate": "load_state"}


def _child(cfg: dict[str, Any]) -> float | None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.restart_child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{cfg} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    for line in out.stdout.splitlines():
        if line.startswith("FIRST "):
            return float(line.split()[1])
    return None


def run(size_mb: int, repeats: int, frameworks: list[str], root: Path) -> dict[str, Any]:
    dirs = {(fw, m): root / f"{fw}-{m}" for fw in frameworks for m in FRAMEWORKS[fw]}
    for (fw, method), d in dirs.items():
        if method != "fresh":
            log(f"{fw} {method}: writing the checkpoint ({size_mb} MB)")
            cfg = {"framework": fw, "method": method, "phase": "save", "dir": str(d)}
            _child({**cfg, "size_mb": size_mb})
    times: dict[str, list[float]] = {f"{fw}/{m}": [] for fw, m in dirs}
    for r in range(repeats):
        for (fw, method), d in dirs.items():
            if d.exists():
                drop_file_cache(d)
            cfg = {"framework": fw, "method": method, "phase": "resume", "dir": str(d)}
            seconds = _child({**cfg, "size_mb": size_mb})
            if seconds is None:
                raise RuntimeError(f"{fw} {method}: no first step reported")
            times[f"{fw}/{method}"].append(seconds)
            log(f"round {r + 1}: {fw} {method}: first step {seconds:.2f} s after process start")
    result: dict[str, Any] = {"size_mb": size_mb, "repeats": repeats, "seconds": times}
    summary: dict[str, Any] = {}
    for fw in frameworks:
        fresh = med(times[f"{fw}/fresh"])
        row = {m: med(times[f"{fw}/{m}"]) for m in FRAMEWORKS[fw]}
        row["resume_cost_coci_s"] = row["coci"] - fresh
        row["resume_cost_native_s"] = row["native"] - fresh
        row["native_over_coci"] = row["native"] / row["coci"]
        # what a library whose resume cost nothing would reach: the start-up bounds the ratio
        row["native_over_fresh"] = row["native"] / fresh
        row["native_over_coci_resume_cost"] = (
            row["resume_cost_native_s"] / row["resume_cost_coci_s"]
            if row["resume_cost_coci_s"] > 0
            else None
        )
        summary[fw] = row
    result["summary"] = summary
    return result


def _table(result: dict[str, Any]) -> str:
    lines = [
        "| framework | coci (s) | native (s) | fresh start (s) | resume cost coci / native (s) "
        "| native / coci | native / fresh (the bound) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fw, row in result["summary"].items():
        lines.append(
            f"| {fw} (native: {NATIVE[fw]}) | {row['coci']:.2f} | {row['native']:.2f} | "
            f"{row['fresh']:.2f} | {row['resume_cost_coci_s']:.2f} / "
            f"{row['resume_cost_native_s']:.2f} | {row['native_over_coci']:.2f}x | "
            f"{row['native_over_fresh']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS))
    parser.add_argument("--scratch", default=None, help="where checkpoints go (a local disk)")
    args = parser.parse_args()
    result, path = run_recorded(
        "restart",
        lambda tmp: run(args.size_mb, args.repeats, args.frameworks, tmp),
        scratch_dir=args.scratch,
    )
    print(_table(result))
    log(f"results in {path}")


if __name__ == "__main__":
    main()
