#!/usr/bin/env python
"""The transformers.Trainer's own checkpoints against ``CociCallback`` on the same CPU run
(issue 39): training-loop overhead and time to durable, saving every K steps.

Methods, each a fresh ``Trainer`` in this process for ``--steps`` optimizer steps:
(a) no checkpointing (``save_strategy="no"``), (b) the Trainer's own saves
(``save_strategy="steps", save_steps=K``: ``checkpoint-N`` directories, synchronous),
(c) ``CociCallback(policy="every_n_steps", every_n_steps=K)`` (the Trainer's saves off, coci's
written in the background), (d) ``CociCallback()`` with its own plan (``--mtbf``), (e) as (c)
with ``block=False`` (the copy too in the background, overlapping the next step).

Overheads: "vs (a)", the median mean step against (a)'s; "in-run", each run's time against its
own pace (the median step outside the five steps from each save), which a machine slower for a
whole run does not move; (a)'s in-run figure, with the windows of a save every K steps, is the
estimator's floor. "Saves within the run": the same without the time after the last step (the
final save at ``max_steps``: the Trainer's, and coci's with its wait until that checkpoint is
durable), what each save within a longer run costs; the table ends with each coci row's points
over the floor against the Trainer's, both ways.

The model is a GPT-2 built from a config (no download; by default 4 layers, d=384, a 8192-token
vocabulary: about 10 M parameters, over 100 MB of state with AdamW) on synthetic tokens. The
clock starts at the end of step ``--warmup`` and stops when ``train()`` returns (coci's pending
saves are durable by then: the callback waits for them at the end of training). Each
repetition runs every method once, in an order rotated by one per repetition; the tables quote
medians over repetitions. Time to durable: coci's (from the ``save`` call to the commit,
fsync included); the Trainer's is the time ``_save_checkpoint`` holds training (it does not
fsync, so its files may still be in the page cache then).

Run (the figures in docs/benchmarks-adapters.md; about 15 minutes on 2 idle cores):

    python -m benchmarks.transformers_bench --threads 1 --reps 5 --steps 100 --dir bench-tmp/hf

``--tiny`` checks that the script runs (a tiny model, a few steps, one repetition). Writes
benchmarks/results/transformers-<time>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from benchmarks._lib.files import clean, dir_bytes, scratch
from benchmarks._lib.machine import loadavg
from benchmarks._lib.results import results_path, write_json
from coci_transformers import CociCallback

perf = time.perf_counter

METHODS = {
    "a": "(a) no checkpointing",
    "b": "(b) the Trainer's own saves, `save_steps=K`",
    "c": '(c) `CociCallback(policy="every_n_steps", every_n_steps=K)`',
    "d": "(d) `CociCallback()`, own plan",
    "e": '(e) `CociCallback(policy="every_n_steps", every_n_steps=K, block=False)`',
}


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock(TrainerCallback):
    """The time at the end of each optimizer step; each Trainer save's duration."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends[state.global_step] = perf()


def state_mb(model: torch.nn.Module) -> float:
    """Model + AdamW (two moments) in MB."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * params / 1e6


def run(method: str, a: argparse.Namespace, d: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=a.layers, n_embd=a.d_model, n_head=a.heads, vocab_size=a.vocab,
        n_positions=a.seq, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    clock = Clock()
    callbacks: list[TrainerCallback] = [clock]
    coci: CociCallback | None = None
    if method == "c":
        coci = CociCallback(policy="every_n_steps", every_n_steps=a.every, keep_last=2)
    elif method == "d":
        coci = CociCallback(mtbf_s=a.mtbf, keep_last=2)
    elif method == "e":
        coci = CociCallback(policy="every_n_steps", every_n_steps=a.every, keep_last=2, block=False)
    if coci is not None:
        callbacks.insert(0, coci)
    args = TrainingArguments(
        output_dir=str(d),
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        use_cpu=True,
        report_to="none",
        logging_steps=10,
        disable_tqdm=True,
        save_strategy="steps" if method == "b" else "no",
        save_steps=a.every,
        save_total_limit=2,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(a.steps * a.batch, a.seq, a.vocab),
        callbacks=callbacks,
    )
    saves: list[float] = []
    if method == "b":
        original = trainer._save_checkpoint

        def timed(*args: Any, **kwargs: Any) -> None:
            start = perf()
            original(*args, **kwargs)
            saves.append(perf() - start)

        trainer._save_checkpoint = timed  # type: ignore[method-assign]
    events: list[Any] = []
    if coci is not None:

        class Listen(TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                assert coci is not None
                assert coci.checkpointer is not None
                coci.checkpointer.add_listener(events.append)

        trainer.add_callback(Listen())
    trainer.train()
    end = perf()
    window = a.steps - a.warmup
    mean_step = (end - clock.ends[a.warmup]) / window
    committed = [e for e in events if getattr(e, "outcome", None) == "committed"]
    timed = range(a.warmup + 1, a.steps + 1)
    step_s = [clock.ends[k] - clock.ends[k - 1] for k in timed]
    # (a) gets the windows of (b) and (c): every K-th step
    every_k = [k for k in range(1, a.steps + 1) if k % a.every == 0]
    saved_at = [e.step for e in committed] if coci is not None else every_k
    result = {
        "method": method,
        "mean_step_s": mean_step,
        "in_run_overhead": in_run_overhead(
            step_s, end - clock.ends[a.steps], [k - a.warmup - 1 for k in saved_at]
        ),
        "within_run_overhead": in_run_overhead(step_s, 0.0, [k - a.warmup - 1 for k in saved_at]),
        "saved_at": saved_at,
        "state_mb": state_mb(model),
        "checkpoints": len(saves) if method == "b" else len(committed),
        "trainer_save_s": saves,
        "coci_stall_s": [e.stall_s for e in committed],
        "coci_durable_s": [e.time_to_durable_s for e in committed],
        "disk_bytes": dir_bytes(d),
    }
    clean(d)
    return result


#: steps after a save (the save's own included) that its stall and background work may slow
AFTER_SAVE_STEPS = 5


def in_run_overhead(step_s: list[float], tail_s: float, saves: list[int]) -> float:
    """The run's time (its steps and ``tail_s`` after the last, coci's wait for its last save)
    against its own pace: the median step outside the ``AFTER_SAVE_STEPS`` steps from each save
    (``saves``: indices into ``step_s``). A run slowed as a whole by the machine is not counted;
    (a) gets the same windows (at each K-th step): its figure is the estimator's floor."""
    after = {i + j for i in saves for j in range(AFTER_SAVE_STEPS)}
    quiet = [t for i, t in enumerate(step_s) if i not in after] or step_s
    pace = statistics.median(quiet)
    return (sum(step_s) + tail_s) / (pace * len(step_s)) - 1


def over_floor(res: dict[str, Any], key: str) -> dict[str, float]:
    """Each method's median ``key`` overhead minus (a)'s (the estimator's floor)."""
    by: dict[str, list[float]] = {}
    for r in res["runs"]:
        if key in r:
            by.setdefault(r["method"], []).append(r[key])
    floor = statistics.median(by["a"]) if "a" in by else 0.0
    return {m: statistics.median(v) - floor for m, v in by.items() if m != "a"}


def table(res: dict[str, Any]) -> str:
    rows = res["runs"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    base = statistics.median(r["mean_step_s"] for r in by["a"]) if "a" in by else None
    out = [
        f"State {rows[0]['state_mb']:.0f} MB; steps {res['args']['warmup'] + 1}-"
        f"{res['args']['steps']} timed, K = {res['args']['every']}.",
        "",
        "| method | mean step (median) | overhead vs (a) | in-run overhead | saves within "
        "the run | checkpoints | stall per save | time to durable per save |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m, runs in sorted(by.items()):
        step = statistics.median(r["mean_step_s"] for r in runs)
        over = "—" if base is None or m == "a" else f"{100 * (step / base - 1):+.1f} %"
        saves = [s for r in runs for s in r["trainer_save_s"]]
        stalls = [s for r in runs for s in r["coci_stall_s"]] or saves
        durable = [s for r in runs for s in r["coci_durable_s"]] or saves
        stall = f"{1e3 * statistics.median(stalls):.0f} ms" if stalls else "—"
        dur = f"{statistics.median(durable):.2f} s" if durable else "—"
        if m == "b" and saves:
            dur += " (no fsync)"
        checkpoints = statistics.median(r["checkpoints"] for r in runs)
        in_run = statistics.median(r["in_run_overhead"] for r in runs)
        within = [r["within_run_overhead"] for r in runs if "within_run_overhead" in r]
        within_s = f"{100 * statistics.median(within):+.1f} %" if within else "—"
        out.append(
            f"| {METHODS[m]} | {1e3 * step:.1f} ms | {over} | {100 * in_run:+.1f} % "
            f"| {within_s} | {checkpoints:g} | {stall} | {dur} |"
        )
    trainer = {k: over_floor(res, k).get("b") for k in ("in_run_overhead", "within_run_overhead")}
    for m in sorted(set(by) - {"a", "b"}):
        parts = []
        for k, label in (("in_run_overhead", "whole run"), ("within_run_overhead", "within")):
            coci, base = over_floor(res, k).get(m), trainer[k]
            if coci is not None and base is not None:
                ratio = f"{base / coci:.1f}x" if coci > 0 else "coci at or below the floor"
                parts.append(f"{label} {100 * coci:.1f} against {100 * base:.1f} points ({ratio})")
        if parts:
            out.append(f"\nOver (a)'s floor, ({m}) against (b): " + "; ".join(parts) + ".")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--every", type=int, default=10, help="K")
    p.add_argument("--mtbf", type=float, default=1800.0, help="mtbf_s of (d)")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--methods", default="abcde")
    p.add_argument("--tiny", action="store_true", help="check that it runs: tiny and short")
    p.add_argument("--out", default=None, help="directory of the results file")
    a = p.parse_args()
    if a.tiny:
        a.reps, a.steps, a.warmup, a.every = 1, 6, 2, 2
        a.d_model, a.heads, a.layers, a.vocab, a.seq, a.batch = 32, 2, 1, 64, 8, 2
    if a.threads:
        torch.set_num_threads(a.threads)
    root = Path(scratch(a.dir, "transformers-bench"))
    runs = []
    methods = list(a.methods)
    for rep in range(a.reps):
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for m in order:
            r = run(m, a, root / m)
            r["rep"], r["load"] = rep, loadavg()
            runs.append(r)
            print(f"rep {rep} {m}: {1e3 * r['mean_step_s']:.1f} ms/step", file=sys.stderr)
    res = {"args": vars(a), "runs": runs}
    path = results_path("transformers", a.out)
    write_json(path, res)
    print(table(res))
    print(f"\nresults: {path}", file=sys.stderr)
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
