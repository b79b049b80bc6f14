#!/usr/bin/env python
"""Only the "10 lossy restores" part of compression_bench.py, for chosen lossy settings.

The protocol of tests/codecs/test_lossy_training.py (400 steps of Adam, a lossy save every 10
steps, a restore into the model and the optimizer every 40: 10 restores), on the test's small
CNN (``test_cnn``) and on the 0.55 M digits CNN (``digits_cnn``). About 30-60 s per setting on
one core. Run:

    python -m benchmarks.lossy_restores_bench --dir bench-tmp/lossy \\
        --models digits_cnn,test_cnn --configs defaults,b2q,b2log

Prints a markdown table (the columns of docs/compression.md's table, plus the largest recorded
relative bound of the log-domain pieces) and writes benchmarks/results/lossy-restores-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import scratch
from benchmarks._lib.machine import uptime
from benchmarks._lib.results import results_path, write_json
from benchmarks.compression_bench import log, lossy_restores

CONFIGS: dict[str, dict[str, Any] | None] = {
    "defaults": None,
    "b2": {"lossy_bits": 2},
    "b2q": {"lossy_bits": 2, "lossy_optimizer": "quantized"},
    "b8first": {"lossy_optimizer": "first_moment"},
    "b2log": {"lossy_bits": 2, "lossy_optimizer": "log_second_moment"},
    "b2log_o0": {"lossy_bits": 2, "lossy_optimizer": "log_second_moment", "lossy_outliers": 0},
    "b2log_o1": {"lossy_bits": 2, "lossy_optimizer": "log_second_moment", "lossy_outliers": 1},
    "b2log_o2": {"lossy_bits": 2, "lossy_optimizer": "log_second_moment", "lossy_outliers": 2},
    "b2q_o0": {"lossy_bits": 2, "lossy_optimizer": "quantized", "lossy_outliers": 0},
    "b4log": {"lossy_bits": 4, "lossy_optimizer": "log_second_moment"},
    "b8log": {"lossy_bits": 8, "lossy_optimizer": "log_second_moment"},
}


def row(r: dict[str, Any], ref: float, name: str) -> str:
    bits = r.get("bits", {})
    tot = sum(bits.values()) or 1
    return (
        f"| {r['model']} | {name}: {json.dumps(r['options'] or {})} | "
        f"{r['raw_state_bytes'] / 1e3:.0f} | {r['accuracy']:.4f} | "
        f"{100 * (r['accuracy'] - ref):+.2f} | {r['restores']} | {r['lossy_saves']} | "
        f"{r['ratio_lossy_saves']:.1f} | {r['ratio_qdelta_pieces']:.1f} | "
        f"{r['ratio_all_saves']:.1f} | {r['max_abs_error']:.2e} | "
        f"{r['max_rel_error']:.2e} | "
        + ", ".join(f"{b}: {v / tot:.0%}" for b, v in sorted(bits.items()))
        + " |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--models", default="digits_cnn,test_cnn")
    ap.add_argument("--configs", default="defaults,b2q,b2log", help=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    args.dir = scratch(args.dir, "lossy-restores")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two threads on a shared 2-core machine run much slower
    started = time.time()
    res: dict[str, Any] = {"command": " ".join(sys.argv), "uptime_before": uptime()}
    res["reference"], res["runs"] = {}, []
    lines = []
    for model in args.models.split(","):
        ref = lossy_restores(model, None, None, steps=args.steps)["accuracy"]
        res["reference"][model] = ref
        for name in args.configs.split(","):
            r = lossy_restores(model, Path(args.dir), CONFIGS[name], steps=args.steps)
            r["config"] = name
            res["runs"].append(r)
            lines.append(row(r, ref, name))
            log(lines[-1])
    res["uptime_after"] = uptime()
    res["seconds"] = time.time() - started
    path = results_path("lossy-restores", args.out)
    write_json(path, res)
    print(
        "| model | options | raw state KB | accuracy | vs. no restores (points) | restores | "
        "lossy saves | ratio of lossy saves | qdelta pieces ratio | ratio all saves | "
        "max abs err bound | max rel err bound (log pieces) | bits (share of qdelta bytes) |"
    )
    print("|" + "---|" * 13)
    print("\n".join(lines))
    print(
        "\nReference (no restores): "
        + ", ".join(f"{k} {v:.4f}" for k, v in res["reference"].items())
        + f"; uptime before/after: `{res['uptime_before']}` / `{res['uptime_after']}`"
    )
    log(f"done in {res['seconds']:.0f} s; results in {path}")


if __name__ == "__main__":
    main()
