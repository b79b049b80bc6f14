#!/usr/bin/env python
"""Bytes written for a half-frozen fine-tune, two ways (about 3 minutes):

- ``fresh-optimizer``: embeddings and the first half of the blocks frozen, a new Adam over the
  trainable half (the usual fine-tune: the frozen half has no moments, so only 25% of the state
  bytes are frozen);
- ``optimizer-kept``: the same layers frozen mid-run with the pre-training Adam kept (as when
  layers are frozen during training): the frozen half's moments stay in the state, unchanged,
  so 50% of the state bytes are frozen.

Each sequence (saves every 10 steps) is replayed through coci's ``none``, ``lossless`` and
``auto`` modes by ``compression_bench.replay``; the table gives written / raw bytes.

    python -m benchmarks.finetune_bench --dir bench-tmp/finetune
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from benchmarks._lib.files import scratch
from benchmarks._lib.machine import uptime
from benchmarks._lib.results import results_path, write_json
from benchmarks.compression_bench import (
    FT_SCHEDULE,
    TRAIN_STEPS,
    gpt_runs,
    log,
    replay,
    summarize,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--methods", default="none,lossless,auto")
    args = ap.parse_args()
    args.dir = scratch(args.dir, "finetune")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    res: dict[str, object] = {"command": " ".join(sys.argv), "uptime_start": uptime(), "runs": []}
    runs: list[dict[str, object]] = []
    for kept in (False, True):
        name = "optimizer-kept" if kept else "fresh-optimizer"
        log(f"training {name} ({uptime()})")
        _, ft, _, ft_acc, info = gpt_runs(
            TRAIN_STEPS, set(), FT_SCHEDULE[-1], set(FT_SCHEDULE), keep_optimizer=kept
        )
        run = replay(
            f"finetune-{name}",
            [(s, ft[s]) for s in FT_SCHEDULE],
            ft_acc,
            root,
            args.methods.split(","),
        )
        run["summary"] = summarize(run)
        run["info"] = info
        runs.append(run)
    res["runs"] = runs
    res["uptime_end"] = uptime()
    out = results_path("finetune", args.out)
    write_json(out, res)
    print(f"uptime before/after: `{res['uptime_start']}` / `{res['uptime_end']}`; results {out}")
    print(
        "| fine-tune | frozen share of state bytes | method | written / raw, steady "
        "(delta saves and one base per 8) | median time to durable ms |"
    )
    print("|---|---|---|---|---|")
    for run in runs:
        info = run["info"]
        assert isinstance(info, dict)
        summary = run["summary"]
        assert isinstance(summary, dict)
        for method, row in summary.items():
            print(
                f"| {run['name']} | {info['frozen_fraction_of_state']:.1%} | {method} | "
                f"{row['written_fraction_steady']:.1%} | {row['ttd_median_ms']:.0f} |"
            )


if __name__ == "__main__":
    main()
