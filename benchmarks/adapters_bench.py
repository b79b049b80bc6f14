#!/usr/bin/env python
"""Throughput of a CPU training run with coci's framework adapters against the frameworks' own
checkpointing (issues 4 and 5).

Lightning: (a) no checkpointing, (b) CociCheckpoint every K steps, (c) ModelCheckpoint every K
steps (synchronous torch.save), (d) ModelCheckpoint with AsyncCheckpointIO, (e) CociCheckpoint
with its own plan (policy "coci", given an MTBF). Accelerate: (a) no checkpointing, (b)
CociCheckpointer every K steps, (c) accelerator.save_state every K steps.

Run (about 8 minutes on 2 idle cores, 3 repetitions; ``--quick``: about 3 minutes, one
repetition; with 2 torch threads a busy neighbour can make steps 10-20x slower, see
docs/benchmarks-adapters.md, where ``--threads 1 --reps 2`` took 7.5 minutes):

    python -m benchmarks.adapters_bench --dir bench-tmp/adapters

Writes benchmarks/results/adapters-<time>.json (every run: per-step times, load, CPU used by
other processes, checkpoints, coci's save telemetry) and prints Markdown tables;
``--report FILE.json`` prints the tables of an earlier run again.

Method. The model is a small causal transformer (torch.nn.TransformerEncoder) on synthetic
tokens, trained with Adam. Every run is a fresh Trainer / Accelerator in this process for
``--steps`` optimizer steps. The clock starts at the end of step ``--warmup`` (after any save
taken at that step) and stops after step ``--steps`` once every pending background save
(coci's writer, AsyncCheckpointIO's thread) is finished; so the window contains every save
from step ``2*K`` on and all of their background work. Each repetition runs every method once,
in an order rotated by one per repetition; the tables quote medians over repetitions. Between
runs the checkpoint files are deleted and ``sync`` is called (outside the clock), so that the
page cache's writeback of one method does not land in the next.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import clean, dir_bytes, scratch
from benchmarks._lib.machine import Idle, Others, loadavg, thread_cpu, uptime
from benchmarks._lib.results import results_path
from benchmarks._lib.timing import med

perf = time.perf_counter

# -- model and data -----------------------------------------------------------------------


class TinyGPT(torch.nn.Module):
    """Token + position embeddings, a causal TransformerEncoder stack, a linear head."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        layer = torch.nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True
        )
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos(pos)
        h = self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (x,) = batch
    logits = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
    )


def dataset(cfg: dict[str, Any], n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randint(0, cfg["vocab"], (n, cfg["seq"] + 1), generator=g)
    )


def make_model(cfg: dict[str, Any]) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(cfg["vocab"], cfg["seq"], cfg["d"], cfg["layers"], cfg["heads"])


def state_mb(cfg: dict[str, Any]) -> tuple[int, float]:
    n = sum(p.numel() for p in make_model(cfg).parameters())
    return n, n * 4 * 3 / 1e6  # weights + Adam's two moments, float32


# -- Lightning ----------------------------------------------------------------------------


def run_lightning(method: str, cfg: dict[str, Any], a: argparse.Namespace, d: Path) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from coci_lightning import CociCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return lm_loss(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=3e-4)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(
                dataset(cfg, cfg["batch"] * (a.steps + 1)), batch_size=cfg["batch"], shuffle=True
            )

    coci_cb: CociCheckpoint | None = None
    callbacks: list[Any] = []
    plugins: list[Any] = []
    if method in ("coci_every_k", "coci_plan", "coci_plan_long"):
        kw: dict[str, Any] = dict(dirpath=d / "coci", keep_last=3, save_on_train_end=False)
        if method == "coci_every_k":
            kw.update(policy="every_n_steps", every_n_steps=a.every)
        else:
            kw.update(policy="coci", mtbf_s=a.mtbf if method == "coci_plan" else a.mtbf_long)
        coci_cb = CociCheckpoint(**kw, **_coci_block(a))
        callbacks.append(coci_cb)
    elif method in ("modelckpt", "modelckpt_async"):
        callbacks.append(
            ModelCheckpoint(dirpath=d / "mc", every_n_train_steps=a.every, save_top_k=-1)
        )
        if method == "modelckpt_async":
            plugins.append(AsyncCheckpointIO())
    t: dict[str, Any] = {"starts": {}, "end": None, "coci_saved": set()}

    class Clock(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            t["starts"][trainer.global_step] = perf()
            if coci_cb is not None and coci_cb._last_saved_step is not None:
                t["coci_saved"].add(coci_cb._last_saved_step)

        def on_train_end(self, trainer: Any, *args: Any) -> None:
            # Runs before the checkpoint callbacks' on_train_end (Lightning puts them last),
            # after every step's saves. Wait for background work, then stop the clock.
            if coci_cb is not None and coci_cb.checkpointer is not None:
                if coci_cb._last_saved_step is not None:
                    t["coci_saved"].add(coci_cb._last_saved_step)
                coci_cb.checkpointer.wait()
            io = trainer.strategy.checkpoint_io
            while io is not None:
                if isinstance(io, AsyncCheckpointIO) and io._executor is not None:
                    io._executor.submit(lambda: None).result()  # one worker: FIFO
                io = getattr(io, "checkpoint_io", None)
            t["end"] = perf()
            t["threads"] = thread_cpu()

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=a.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=method != "none",
        callbacks=[*callbacks, Clock()],
        plugins=plugins or None,
        default_root_dir=str(d),
        num_sanity_val_steps=0,
    )
    t_fit = perf()
    trainer.fit(Module())
    t_fit = perf() - t_fit
    r = _times(t["starts"], t["end"], a)
    r["fit_s"] = t_fit
    r["thread_cpu_s"] = t.get("threads", {})
    if coci_cb is not None:
        r["saved_steps"] = sorted(t["coci_saved"])
        r["coci_events"] = _coci_events(d / "coci")
    elif method != "none":
        r["saved_steps"] = sorted(int(p.stem.split("step=")[1]) for p in (d / "mc").glob("*.ckpt"))
    else:
        r["saved_steps"] = []
    r["disk_bytes"] = dir_bytes(d)
    del trainer
    return r


# -- Accelerate ---------------------------------------------------------------------------


def run_accelerate(method: str, cfg: dict[str, Any], a: argparse.Namespace, d: Path) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    from coci_accelerate import CociCheckpointer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(d),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    model = make_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    loader = torch.utils.data.DataLoader(
        dataset(cfg, cfg["batch"] * (a.steps + 1)), batch_size=cfg["batch"], shuffle=True
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ckpt = None
    if method == "coci_every_k":
        ckpt = CociCheckpointer(
            accelerator,
            d / "coci",
            policy="every_n_steps",
            every_n_steps=a.every,
            keep_last=3,
            **_coci_block(a),
        )
    starts: dict[int, float] = {}
    saved: list[int] = []
    model.train()
    step = 0  # counted after the optimizer step, like Lightning's global_step
    t_fit = perf()
    # Steps are numbered as Lightning's global_step: step s is the s-th optimizer step, and
    # starts[s] is taken after step s (and its save) finished.
    starts[0] = perf()
    for batch in loader:
        loss = lm_loss(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()
        step += 1  # noqa: SIM113
        if ckpt is not None:
            if ckpt.step(step, loss=loss_value) is not None:
                saved.append(step)
        elif method == "save_state" and step % a.every == 0:
            accelerator.save_state(str(d / "save_state" / f"step-{step}"))
            saved.append(step)
        if step >= a.steps:
            break
        starts[step] = perf()
    if ckpt is not None:
        ckpt.wait()
    end = perf()
    threads = thread_cpu()
    if ckpt is not None:
        ckpt.close()
    t_fit = perf() - t_fit
    r = _times(starts, end, a)
    r["fit_s"] = t_fit
    r["saved_steps"] = saved
    r["thread_cpu_s"] = threads
    if ckpt is not None:
        r["coci_events"] = _coci_events(d / "coci")
    r["disk_bytes"] = dir_bytes(d)
    accelerator.free_memory()
    del accelerator, model, optimizer, loader, ckpt
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return r


# -- shared -------------------------------------------------------------------------------


def _coci_block(a: argparse.Namespace) -> dict[str, bool]:
    """The ``block`` argument of the coci adapters that ``--coci-block`` asks for."""
    return {} if a.coci_block == "default" else {"block": a.coci_block == "true"}


def _times(starts: dict[int, float], end: float | None, a: argparse.Namespace) -> dict:
    """The window: from the start of step warmup+1 (after step warmup) to the end (after the
    last step and the wait for background saves)."""
    assert end is not None, "the run did not reach its end"
    steps = sorted(starts)
    step_times = [starts[s + 1] - starts[s] for s in steps if s + 1 in starts]
    step_times.append(end - starts[steps[-1]])  # the last step, up to the final wait
    window = end - starts[a.warmup]
    n = a.steps - a.warmup
    inside = step_times[a.warmup :]
    return {
        "window_s": window,
        "window_steps": n,
        "mean_step_s": window / n,
        "median_step_s": statistics.median(inside),
        "max_step_s": max(inside),
        "step_times_s": [round(x, 5) for x in step_times],
    }


def _coci_events(d: Path) -> list[dict[str, Any]]:
    path = d / "telemetry.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "plan":
            out.append(
                {
                    k: rec.get(k)
                    for k in (
                        "type",
                        "step",
                        "next_steps",
                        "interval_steps",
                        "mtbf_s",
                        "costs",
                        "cost_sources",
                    )
                }
            )
        if rec.get("type") == "save":
            keys = (
                "step",
                "outcome",
                "stall_s",
                "copy_s",
                "persist_s",
                "time_to_durable_s",
                "bytes_written",
                "first_save",
                "block",
            )
            out.append({"type": "save", **{k: rec.get(k) for k in keys}})
    return out


LIGHTNING = ["none", "coci_every_k", "modelckpt", "modelckpt_async", "coci_plan", "coci_plan_long"]
ACCELERATE = ["none", "coci_every_k", "save_state"]
LABEL = {
    ("lightning", "none"): "(a) no checkpointing",
    ("lightning", "coci_every_k"): "(b) CociCheckpoint every_n_steps=K",
    ("lightning", "modelckpt"): "(c) ModelCheckpoint every_n_train_steps=K",
    ("lightning", "modelckpt_async"): "(d) ModelCheckpoint + AsyncCheckpointIO",
    ("lightning", "coci_plan"): "(e) CociCheckpoint, own plan, mtbf_s=180",
    ("lightning", "coci_plan_long"): "(e') CociCheckpoint, own plan, mtbf_s=1800",
    ("accelerate", "none"): "(a) no checkpointing",
    ("accelerate", "coci_every_k"): "(b) CociCheckpointer every_n_steps=K",
    ("accelerate", "save_state"): "(c) accelerator.save_state every K steps",
}


DISTURBED = 0.3  # cores used by other processes during a run above which it is run again
# waits (at most 20 s at a time, within the run's budget) until other processes leave the cores
IDLE = Idle(0.0, DISTURBED, lambda m: print(m, flush=True), poll_s=0.5, log_after_s=2.0)


def one(adapter: str, method: str, cfg: dict[str, Any], a: argparse.Namespace) -> dict:
    discarded: list[dict[str, Any]] = []
    for attempt in range(a.retries + 1):
        r = _one(adapter, method, cfg, a)
        if r["others_cores"] < DISTURBED or attempt == a.retries or IDLE.left_s <= 0:
            break
        print(
            f"    (disturbed: others used {r['others_cores']:.2f} cores, mean step "
            f"{r['mean_step_s'] * 1e3:.0f} ms; running it again)",
            flush=True,
        )
        discarded.append({k: v for k, v in r.items() if k != "step_times_s"})
    r["discarded"] = discarded
    return r


def _one(adapter: str, method: str, cfg: dict[str, Any], a: argparse.Namespace) -> dict:
    d = Path(a.dir) / f"{adapter}-{method}"
    clean(d)
    d.mkdir(parents=True)
    gc.collect()
    waited = IDLE.wait(20)
    up0, la0 = uptime(), loadavg()
    cpu0 = time.process_time()
    with Others() as o:
        fn = run_lightning if adapter == "lightning" else run_accelerate
        r = fn(method, cfg, a, d)
    r["process_cpu_s"] = time.process_time() - cpu0  # this process, all threads, whole run
    r.update(
        adapter=adapter,
        method=method,
        uptime_before=up0,
        uptime_after=uptime(),
        load1_before=la0[0],
        load1_after=loadavg()[0],
        others_cores=round(o.cores, 3),
        idle_wait_s=round(waited, 1),
    )
    clean(d)
    gc.collect()
    return r


# -- report -------------------------------------------------------------------------------


def tables(res: dict[str, Any]) -> str:
    a = res["args"]
    out: list[str] = []
    summary: dict[str, Any] = {}
    for adapter, methods in (("lightning", LIGHTNING), ("accelerate", ACCELERATE)):
        runs = [r for r in res["runs"] if r["adapter"] == adapter]
        if not runs:
            continue
        reps = sorted({r["rep"] for r in runs})
        by = {(r["rep"], r["method"]): r for r in runs}
        base = med([by[(k, "none")]["mean_step_s"] for k in reps if (k, "none") in by])
        out.append(
            f"\n### {adapter.capitalize()} ({len(reps)} repetition(s), "
            f"steps {a['warmup'] + 1}-{a['steps']} timed, K={a['every']})\n"
        )
        out.append(
            "| method | mean step time (median over reps) | throughput | overhead vs (a) "
            "| paired overhead per rep | checkpoints in window (total) | median step "
            "| slowest step | others' cores | coci stall / persist per save |"
        )
        out.append("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        s: dict[str, Any] = {}
        for m in methods:
            rs = [by[(k, m)] for k in reps if (k, m) in by]
            if not rs:
                continue
            t = med([r["mean_step_s"] for r in rs])
            ov = (t / base - 1) * 100
            paired = []
            for k in reps:
                if (k, m) in by and (k, "none") in by:
                    paired.append(
                        (by[(k, m)]["mean_step_s"] / by[(k, "none")]["mean_step_s"] - 1) * 100
                    )
            inwin = [sum(1 for st in r["saved_steps"] if st > a["warmup"]) for r in rs]
            tot = [len(r["saved_steps"]) for r in rs]
            ev = [
                e
                for r in rs
                for e in r.get("coci_events", [])
                if e.get("type") == "save"
                and e["outcome"] == "committed"
                and e["step"] > a["warmup"]
            ]
            coci = (
                f"{med([e['stall_s'] for e in ev]) * 1e3:.0f} ms / "
                f"{med([e['persist_s'] for e in ev]):.2f} s"
                if ev
                else ""
            )
            s[m] = {
                "mean_step_s": t,
                "overhead_pct": ov,
                "paired_pct": paired,
                "ckpts_in_window": inwin,
                "ckpts_total": tot,
            }
            out.append(
                f"| {LABEL[(adapter, m)]} | {t * 1e3:.1f} ms | {1 / t:.2f} steps/s | "
                f"{'—' if m == 'none' else f'{ov:+.1f} %'} | "
                f"{', '.join(f'{p:+.1f}' for p in paired) if m != 'none' else ''} | "
                f"{'/'.join(map(str, sorted(set(inwin))))} "
                f"({'/'.join(map(str, sorted(set(tot))))}) | "
                f"{med([r['median_step_s'] for r in rs]) * 1e3:.0f} ms | "
                f"{med([r['max_step_s'] for r in rs]):.2f} s | "
                f"{med([r['others_cores'] for r in rs]):.2f} | {coci} |"
            )
        summary[adapter] = s
        out.append("")
        if "coci_every_k" in s:
            c = s["coci_every_k"]["overhead_pct"]
            for other in ("modelckpt", "modelckpt_async", "save_state"):
                if other in s:
                    o = s[other]["overhead_pct"]
                    ratio = o / c if c > 0 else math.inf
                    out.append(
                        f"- {other} overhead / coci overhead (same steps): "
                        f"{o:.1f} % / {c:.1f} % = {ratio:.1f}x (target >= 3x: "
                        f"{'met' if ratio >= 3 else 'missed'})"
                    )
        for m, mt in (("coci_plan", a["mtbf"]), ("coci_plan_long", a.get("mtbf_long"))):
            if m in s:
                o = s[m]["overhead_pct"]
                out.append(
                    f"- coci with its own plan (mtbf_s={mt:g}): {o:+.1f} % (target < 2 %: "
                    f"{'met' if o < 2 else 'missed'}), checkpoints per run "
                    f"{s[m]['ckpts_total']}"
                )
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--idle-budget",
        type=float,
        default=120.0,
        help="seconds the run may spend in total waiting for other processes",
    )
    p.add_argument("--retries", type=int, default=1, help="re-runs of a disturbed run")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps per run (N)")
    p.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    p.add_argument("--every", type=int, default=10, help="K of (b)-(d) and Accelerate (b)-(c)")
    p.add_argument("--mtbf", type=float, default=180.0, help="mtbf_s of CociCheckpoint (e)")
    p.add_argument("--mtbf-long", type=float, default=1800.0, help="mtbf_s of (e')")
    p.add_argument("--adapters", default="lightning,accelerate")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--methods", default="", help="only these methods (comma-separated)")
    p.add_argument("--quick", action="store_true", help="1 repetition of 60 steps")
    p.add_argument(
        "--coci-block",
        choices=("default", "true", "false"),
        default="default",
        help="the adapters' block argument (default: theirs, a copy before the save returns)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--report", default=None, help="print the tables of an earlier results file")
    a = p.parse_args()
    a.dir = scratch(a.dir, "adapters")
    if a.report:
        print(tables(json.loads(Path(a.report).read_text())))
        return
    a.methods = [m for m in a.methods.split(",") if m]
    IDLE.budget_s = a.idle_budget
    if a.quick:
        a.reps, a.steps, a.idle_budget, a.retries = 1, 60, 30.0, 0
    if a.threads:
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    for name in (
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "accelerate",
        "coci_core",
        "coci_lightning",
        "coci_accelerate",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    cfg = {
        "vocab": a.vocab,
        "seq": a.seq,
        "d": a.d_model,
        "layers": a.layers,
        "heads": max(1, a.d_model // 64),
        "batch": a.batch,
    }
    n_params, mb = state_mb(cfg)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
    else:
        out = results_path("adapters")
    res: dict[str, Any] = {
        "args": vars(a),
        "model": cfg,
        "params": n_params,
        "state_mb_adam": mb,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "uptime_start": uptime(),
        "command": " ".join(sys.argv),
        "runs": [],
    }
    import accelerate
    import lightning

    res["machine"].update(lightning=lightning.__version__, accelerate=accelerate.__version__)
    print(
        f"model: {n_params / 1e6:.1f} M parameters, state with Adam {mb:.0f} MB; "
        f"{res['uptime_start']}",
        flush=True,
    )
    adapters = a.adapters.split(",")
    t0 = perf()
    for rep in range(a.reps):
        # rotate the methods inside each adapter by one per repetition, and alternate which
        # adapter goes first
        order = []
        for ad in adapters[rep % len(adapters) :] + adapters[: rep % len(adapters)]:
            ms = LIGHTNING if ad == "lightning" else ACCELERATE
            k = rep % len(ms)
            order += [(ad, m) for m in ms[k:] + ms[:k] if not a.methods or m in a.methods]
        for ad, m in order:
            r = one(ad, m, cfg, a)
            r["rep"] = rep
            res["runs"].append(r)
            print(
                f"rep {rep} {ad:10s} {m:16s} mean step {r['mean_step_s'] * 1e3:7.1f} ms  "
                f"median {r['median_step_s'] * 1e3:6.1f} ms  max {r['max_step_s']:.2f} s  "
                f"saves {len(r['saved_steps']):2d}  others {r['others_cores']:.2f} cores  "
                f"load {r['load1_before']:.2f}->{r['load1_after']:.2f}  "
                f"[{perf() - t0:.0f} s]",
                flush=True,
            )
            out.write_text(json.dumps(res, indent=1))
    res["uptime_end"] = uptime()
    res["runtime_s"] = perf() - t0
    out.write_text(json.dumps(res, indent=1))
    print(f"\n{res['uptime_end']}; runtime {res['runtime_s']:.0f} s; results in {out}")
    print(tables(res))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
