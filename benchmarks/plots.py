"""Draw the benchmark pages' plots from the results files in ``docs/results``.

``python -m benchmarks.plots [--results DIR] [--out DIR]`` writes one SVG per plot (default
``docs/img/benchmarks``). The output depends only on the results files (no dates, no random
ids), so a re-run on unchanged results rewrites the same files.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the non-interactive backend
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "img" / "benchmarks"


def _error_bars(rows: list[list[float]]) -> list[list[float]]:
    """[median, min, max] rows as matplotlib's (below, above) distances."""
    return [[m - lo for m, lo, _ in rows], [hi - m for m, _, hi in rows]]


def engine_1g(results: dict[str, Any]) -> Figure:
    """Stall and time to durable per method for one state size."""
    methods = results["methods"]
    size_gb = results["state_bytes"] / 1e9
    fig, (stall, durable) = plt.subplots(1, 2, figsize=(9.0, 3.6), sharey=True)
    names = list(methods)
    for ax, key, label in (
        (stall, "stall_s", "stall (s): the training loop waits"),
        (durable, "durable_s", "time to durable (s): on disk, fsync'ed"),
    ):
        rows = [methods[n].get(key) for n in names]
        shown = [i for i, r in enumerate(rows) if r]
        values = [rows[i] for i in shown]
        ax.barh(
            shown,
            [v[0] for v in values],
            xerr=_error_bars(values),
            color=["tab:green" if names[i].startswith("coci") else "tab:gray" for i in shown],
            capsize=3,
        )
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    stall.set_yticks(range(len(names)), names)
    stall.invert_yaxis()
    fig.suptitle(f"{size_gb:g} GB state: median, bars min-max (coci in green)")
    fig.tight_layout()
    return fig


def adapters(results: dict[str, Any]) -> Figure:
    """Training-loop overhead per method, for each adapter."""
    runs = results["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(7.5, 1.0 + 0.6 * sum(map(len, runs.values()))))
    for ax, (adapter, run) in zip(axes, runs.items(), strict=True):
        names = list(run["methods"])
        values = [run["methods"][n]["overhead_pct"] for n in names]
        colors = ["tab:green" if "Coci" in n else "tab:gray" for n in names]
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(f"{adapter}: step time {run['baseline_step_ms']:g} ms without checkpoints")
        ax.set_xlabel("training-loop overhead (% of step time), same steps")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def planner(results: dict[str, Any]) -> Figure:
    """Expected overhead against Daly's, per policy and MTBF."""
    mtbf = results["mtbf_h"]
    policies = results["policies"]
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 3.8), sharey=True)
    for ax, key, title in (
        (axes[0], "wall_pct", "wall-clock overhead"),
        (axes[1], "convergence_pct", "convergence-weighted overhead"),
    ):
        for name, values in policies.items():
            ax.plot(range(len(mtbf)), values[key], marker="o", label=name)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_xticks(range(len(mtbf)), [f"{m} h" for m in mtbf])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xlabel("MTBF of the job")
        ax.set_title(f"{title} vs Daly (%)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("change against Daly (%)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return fig


def s3(results: dict[str, Any]) -> Figure:
    """Time until durable in the bucket, and how long the training loop waits, per method."""
    summary = results["summary"]
    names = list(summary)
    fig, (durable, waits) = plt.subplots(1, 2, figsize=(9.0, 3.4), sharey=True)
    colors = ["tab:green" if n.startswith("coci") else "tab:gray" for n in names]
    durable.barh(range(len(names)), [summary[n]["durable_s"] for n in names], color=colors)
    durable.set_xlabel("time until durable (s; coci_local: on the local disk)")
    waits.barh(range(len(names)), [summary[n]["stall_s"] for n in names], color=colors)
    waits.set_xlabel("training loop waits (s)")
    durable.set_yticks(range(len(names)), names)
    durable.invert_yaxis()
    for ax in (durable, waits):
        ax.grid(axis="x", alpha=0.3)
    size_gb = results["size_bytes"] / 1e9
    fig.suptitle(
        f"{size_gb:.2g} GB state to S3 (SeaweedFS on loopback), median of {results['repeats']}"
    )
    fig.tight_layout()
    return fig


def s3_loop(results: dict[str, Any]) -> Figure:
    """Training-loop overhead per method against the same run without checkpoints, and the
    time after the loop until the newest checkpoint is durable in the bucket."""
    quiet = results.get("quiet_rounds") or []
    summary = results["summary_quiet"] if quiet else results["summary"]
    names = [n for n in summary if n != "none"]
    fig, (overhead, after) = plt.subplots(1, 2, figsize=(10.0, 3.9), sharey=True)
    colors = ["tab:green" if n.startswith("coci") else "tab:gray" for n in names]
    y = np.arange(len(names))
    rows = [summary[n]["overhead_pct"] for n in names]
    overhead.barh(
        y - 0.2,
        [r[0] for r in rows],
        height=0.4,
        xerr=_error_bars(rows),
        color=colors,
        alpha=0.45,
        capsize=3,
        label="loop time vs the round's run without saves",
    )
    rows = [summary[n]["excess_overhead_pct"] for n in names]
    overhead.barh(
        y + 0.2,
        [r[0] for r in rows],
        height=0.4,
        xerr=_error_bars(rows),
        color=colors,
        capsize=3,
        label="time beyond the run's median step (steadier)",
    )
    overhead.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    overhead.axvline(0, color="black", linewidth=0.8)
    overhead.set_xlabel("loop overhead (% of the loop without saves)")
    rows = [summary[n]["last_durable_after_loop_s"] or [0.0, 0.0, 0.0] for n in names]
    after.barh(
        range(len(names)), [r[0] for r in rows], xerr=_error_bars(rows), color=colors, capsize=3
    )
    after.set_xlabel("after the loop until the last save is in the bucket (s)")
    overhead.set_yticks(range(len(names)), [f"{n} ({summary[n]['checkpoints']:g})" for n in names])
    overhead.invert_yaxis()
    for ax in (overhead, after):
        ax.grid(axis="x", alpha=0.3)
    cfg = results["config"]
    fig.suptitle(
        f"{results['size_bytes'] / 1e9:.2g} GB state, {cfg['steps']} Lightning steps, saves every "
        f"{cfg['every_n_steps']} (checkpoints in brackets): median, bars min-max of "
        f"{len(quiet) or cfg['rounds']} {'quiet ' if quiet else ''}rounds",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def restore(results: dict[str, Any]) -> Figure:
    """Cold restore time per method, with the disk's read limit measured in the same run."""
    samples = results["samples"]
    names = list(samples)
    rows = [[float(np.median(samples[n])), min(samples[n]), max(samples[n])] for n in names]
    fig, ax = plt.subplots(figsize=(7.0, 1.0 + 0.3 * len(names)))
    colors = ["tab:green" if n.startswith("coci") else "tab:gray" for n in names]
    ax.barh(
        range(len(names)), [r[0] for r in rows], xerr=_error_bars(rows), color=colors, capsize=3
    )
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("restore time, page cache evicted (s): median, bars min-max")
    ax.grid(axis="x", alpha=0.3)
    size = results["size_bytes"] / 1e9
    ax.set_title(f"{size:.3g} GB state to tensors in memory, {results['repeats']} rounds")
    fig.tight_layout()
    return fig


def tensor_count(results: dict[str, Any]) -> Figure:
    """Stall and warm restore per state of the same bytes in more tensors, per method."""
    cells = results["cells"]
    states = [c["state"]["name"] for c in cells]
    panels = (
        ("saves", "stall_s", "reps", ("copy", "coci", "dcp_async", "torch_save"), "stall (s)"),
        (
            "restores",
            "seconds",
            "warm",
            ("coci_restore", "torch_load", "torch_load_mmap", "dcp_load"),
            "restore, warm page cache (s)",
        ),
    )
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 3.8))
    for ax, (part, key, runs, names, label) in zip(axes, panels, strict=True):
        names = tuple(n for n in names if all(n in c[part] for c in cells))  # an older run's
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            medians = [float(np.median([r[key] for r in c[part][name][runs]])) for c in cells]
            color = "tab:green" if name.startswith("coci") else None
            ax.bar(np.arange(len(states)) + j * width, medians, width, label=name, color=color)
        ax.set_xticks(np.arange(len(states)) + 0.4 - width / 2, states)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"The same bytes in more tensors: medians of {results['rounds']} rounds")
    fig.tight_layout()
    return fig


def save_overheads(results: dict[str, Any]) -> Figure:
    """Stall with the small tensors copied at once or one by one, and the time in garbage
    collections per save with the writer's collector paused or running, per state."""
    cells = results["cells"]
    states = [c["state"]["name"] for c in cells]
    x = np.arange(len(states))
    fig, (stall, collect) = plt.subplots(1, 2, figsize=(10.0, 3.8))
    for j, (key, label, color) in enumerate(
        (("runs", "one torch.cat for the small tensors", "tab:green"),
         ("per_tensor", "one copy per tensor", "tab:gray"))
    ):  # fmt: skip
        medians = [float(np.median(c["copy"][key])) for c in cells]
        stall.bar(x + j * 0.4, medians, 0.4, label=label, color=color)
    stall.set_ylabel("stall of save(block=True) (s)")
    for j, (key, label, color) in enumerate(
        (("paused", "collector paused (coci)", "tab:green"),
         ("running", "collector running", "tab:gray"))
    ):  # fmt: skip
        means = [c["summary"][key]["mean"] for c in cells]
        total = [m.get("gc_writer_s", 0.0) + m.get("gc_main_s", 0.0) for m in means]
        collect.bar(x + j * 0.4, total, 0.4, label=label, color=color)
    collect.set_ylabel("in garbage collections per save (s)")
    for ax in (stall, collect):
        ax.set_xticks(x + 0.2, states)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"What a save costs beyond the copy: {results['rounds']} rounds, interleaved")
    fig.tight_layout()
    return fig


def replay(results: dict[str, Any]) -> Figure:
    """The training thread's CPU in a save's replay of the last save's layout, the layout
    checked in bulk (coci) or tensor by tensor (before), per state."""
    cells = results["cells"]
    states = [c["state"]["name"] for c in cells]
    x = np.arange(len(states))
    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    for j, (key, label, color) in enumerate(
        (("bulk", "layout checked in bulk (coci)", "tab:green"),
         ("per_tensor", "one fingerprint per tensor (before)", "tab:gray"))
    ):  # fmt: skip
        medians = [float(np.median(c["samples"][key]["replay_cpu"])) for c in cells]
        ax.bar(x + j * 0.4, medians, 0.4, label=label, color=color)
    ax.set_ylabel("training thread's CPU in the replay (s)")
    ax.set_xticks(x + 0.2, states)
    ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.suptitle(f"Replaying the last save's layout: medians of {results['rounds']} rounds")
    fig.tight_layout()
    return fig


def fsdp(results: dict[str, Any]) -> Figure:
    """Blocking time, time to durable and restore onto another layout, per process count."""
    worlds = list(results["worlds"])
    panels = (
        ("blocking_s", ("coci", "coci_block_false", "dcp_async_save", "dcp_save"), "blocking (s)"),
        ("durable_s", ("coci", "coci_block_false", "dcp_async_save", "dcp_save"), "durable (s)"),
        ("restore_s", ("coci_restore", "dcp_load"), "restore onto another layout (s)"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(12.0, 3.6))
    for ax, (key, names, label) in zip(axes, panels, strict=True):
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            values = [results["worlds"][w]["summary"][name][key] for w in worlds]
            color = "tab:green" if name.startswith("coci") else None
            ax.bar(np.arange(len(worlds)) + j * width, values, width, label=name, color=color)
        ax.set_xticks(np.arange(len(worlds)) + 0.4 - width / 2, [f"{w} processes" for w in worlds])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    cfg = results["config"]
    fig.suptitle(
        f"FSDP2 model and AdamW, {cfg['state_mb']} MiB of state: medians of {cfg['rounds']} rounds"
    )
    fig.tight_layout()
    return fig


def loop(results: dict[str, Any]) -> Figure:
    """Loop overhead against the save interval, one line per method, one panel per torch
    thread setting (benchmarks/loop_bench.py)."""
    cells = results["cells"]
    fig, axes = plt.subplots(1, len(cells), figsize=(5.0 * len(cells), 3.8), squeeze=False)
    for ax, cell in zip(axes[0], cells, strict=True):
        for name, by_every in cell["summary"].items():
            if name == "none":
                continue
            every = sorted(by_every, key=int)
            rows = [by_every[e]["overhead_pct"] for e in every]
            shown = [i for i, r in enumerate(rows) if r]
            values = [[rows[i][k] for k in ("median", "min", "max")] for i in shown]
            ax.errorbar(
                [int(every[i]) for i in shown],
                [v[0] for v in values],
                yerr=_error_bars(values),
                marker="o",
                capsize=3,
                linestyle="-" if name.startswith("coci") else "--",
                label=name,
            )
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xlabel("save every N steps")
        ax.set_ylabel("loop overhead (% of the step without saves)")
        step_ms = cell["summary"]["none"]["step_s"]["median"] * 1e3
        ax.set_title(f"{cell['threads']} torch thread(s), step {step_ms:.0f} ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(
        f"{results['state_bytes'] / 1e9:.2g} GB state: median, bars min-max of "
        f"{results['rounds']} rounds"
    )
    fig.tight_layout()
    return fig


#: results file stem -> the function drawing its plot
PLOTS: dict[str, Callable[[dict[str, Any]], Figure]] = {
    "engine-1g": engine_1g,
    "adapters": adapters,
    "planner": planner,
    "s3": s3,
    "s3_loop": s3_loop,
    "restore": restore,
    "restore-4g": restore,
    "tensor-count": tensor_count,
    "save-overheads": save_overheads,
    "replay": replay,
    "fsdp": fsdp,
    "loop": loop,
}


def draw_all(results_dir: Path = RESULTS, out_dir: Path = OUT) -> list[Path]:
    """Every plot whose results file exists, as ``<out_dir>/<stem>.svg``; the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    plt.rcParams["svg.hashsalt"] = "coci"  # stable element ids: same results, same file
    for stem, draw in PLOTS.items():
        source = results_dir / f"{stem}.json"
        if not source.exists():
            continue
        fig = draw(json.loads(source.read_text()))
        target = out_dir / f"{stem}.svg"
        fig.savefig(target, format="svg", metadata={"Date": None})
        plt.close(fig)
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results files")
    parser.add_argument("--out", type=Path, default=OUT, help="where the SVG files go")
    args = parser.parse_args()
    for path in draw_all(args.results, args.out):
        print(path)


if __name__ == "__main__":
    main()
