#!/usr/bin/env python
"""The loop at every interval (the protocol of PCcheck and CheckFreq): a CPU training loop saving
every N steps, for N in ``--every``, with coci and the strongest configuration of each peer.

Run (about 25-35 minutes on 2 idle cores: 3 rounds, N = 1,2,5,10,50, 1 GB of state, torch
threads 1 and 2; the log prints the expected time of each cell after its warm-up):

    python -m benchmarks.loop_bench --dir bench-tmp/loop

    python -m benchmarks.loop_bench --quick                 # a tiny model, a smoke test (~1 min)
    python -m benchmarks.loop_bench --every 1,10 --methods none,coci,dcp_zero --rounds 5
    python -m benchmarks.loop_bench --report RESULT.json    # the tables of an earlier run again

The loop: an MLP of ``--layers`` linear layers of ``--width`` x ``--width`` (ReLU between them)
trained with Adam (``fused=True``: torch's fastest CPU Adam, so that the step is the forward
and backward pass, not a slow optimizer) on one fixed random batch of ``--batch`` rows. The
state saved is ``{"model": model.state_dict(), "optim": opt.state_dict(), "step": step}``:
weights and Adam's two moments, 12 bytes a parameter: the default 4096 x 5 (84 M parameters)
is 1.0 GB. ``--quick``: 256 x 2, batch 8 (1.6 MB). Every step is ``zero_grad``, forward,
backward, the method's wait before the update (if any), ``opt.step()``.

Methods (``--methods``), each in the configuration its authors recommend for not stalling:

* ``none``: no saves: the baseline step time of the round.
* ``coci``: ``CheckpointManager(dir, keep_last=2).save(step, state, block=True)`` (default
  options otherwise): returns once the state is copied into reused host buffers; the writer
  thread persists it.
* ``coci_nb``: the same with ``block=False``: the copy overlaps the next forward and backward
  pass; ``mgr.before_update()`` before the next ``opt.step()`` waits for it (torch optimizers
  call it themselves; the loop calls it by hand to time the wait).
* ``dcp_zero``: torchtitan's "zero-overhead" checkpointing (``async_mode="async_with_pinned_mem"``)
  on CPU: ``dcp.async_save(state, storage_writer=FileSystemWriter(path, sync_files=True),
  planner=DefaultSavePlanner(enable_plan_caching=True),
  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=<one DefaultStager,
  reused>)`` in a one-process gloo group, the stager with ``StagingOptions(use_pinned_memory=
  False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False)``
  (pinned memory and non-blocking copies need an accelerator; torchtitan turns all four on
  on GPUs). The copy into shared memory runs on a staging thread, the write in a separate
  process; as torchtitan does, the loop waits for ``staging_completion`` only right before the
  next ``opt.step()`` and for the previous ``upload_completion`` before the next save, and
  deletes checkpoints beyond the newest 2 on a purge thread (``keep_latest_k=2``).
* ``dcp_thread``: ``dcp.async_save`` with the default thread executor, the same planner, writer
  and waits, and a reused ``DefaultStager(StagingOptions(False, False, True, False))``
  (staging on a thread into reused buffers; shared memory only helps a separate process).
* ``torch_save_bg``: Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``: ``save_checkpoint``
  clones every tensor on the calling thread (the installed Lightning 2.6 does, ``_clone_tensor``,
  so the next optimizer step cannot race the save; with a Lightning that does not, the
  benchmark clones first, as a correct user must) and ``torch.save``s the clone on a one-thread
  executor. ``TorchCheckpointIO`` does not fsync: the benchmark's subclass fsyncs the file and
  its directory after the write (what durability needs; it counts in the time to durable, not
  in the loop) and deletes files beyond the newest 2. Lightning's queue is unbounded: a save
  that comes while others are queued and less than 4x the state's bytes of memory are free
  waits for the queue first (counted as stall; ``memory_waits``).

Protocol: per torch thread setting (``--threads``, default 1 and all cores, one cell each) the
model is trained a few steps, then every method runs a warm-up block (its first, allocating
save and the DCP process's start are not in the medians). Then ``--rounds`` rounds: a ``none``
block at the start and one at the end of the round (its baseline: the mean step time of
both), and between them, for each N, every saving method once, in an order rotated by one per
round. A block of interval N is one lead-in step and then P periods of [save, N steps], with
P = max(``--min-periods``, ceil(``--min-steps`` / N)) (default: N=1: 10 saves, N=2: 5, N=5: 2,
N=10 and N=50: 1; 95 steps per method and round). After each block the method settles
(untimed): every pending save is waited for, its files are fsync'ed and dropped from the page
cache, old checkpoints are deleted (at most 2 per method are kept) and ``sync`` runs, so that
methods do not overlap. ``uptime`` and the load are recorded before and after each block; a
block during which other processes used more than 0.3 cores (this process and its children,
the DCP writer process included, excluded) is run again after waiting for quiet cores, within
``--idle-budget`` seconds in all.

Per method, interval and round (medians over rounds are printed):

* stall (s): the training thread's time in the save call (building the state dict included)
  plus any wait before the optimizer steps until the next save; mean per save.
* after-save step (ms): the mean compute time (without the waits) of the steps after each save
  until the next, and its slowdown against ``none``: background work competing for the cores,
  the memory bandwidth or the GIL.
* overhead %: (the periods' wall time / their steps) against the mean ``none`` step of the
  same round.
* durable (s): from the save call until its files are fsync'ed (coci: its commit,
  ``SaveEvent.time_to_durable_s``; DCP: ``upload_completion`` done; Lightning: the fsync after
  ``torch.save``); mean per save.
* lost (steps) and cost %: the lost-work-weighted cost. With t the loop's time per step with
  saves (s), t0 the ``none`` step, N the interval, D the time to durable and F the mean steps
  between failures (``--failure-every``, default 1000): a failure at a uniformly random time
  loses, on average, ``L = N / 2 + D / t`` steps (half an interval, plus the steps made while
  the newest save was not yet durable), redone at t per step, so the expected time per useful
  step is ``t * (1 + L / F)`` and ``cost % = 100 * (t * (1 + L / F) / t0 - 1)``: the overhead
  per step plus the expected lost work per step (restarts cost the same for every method and
  are left out). The JSON keeps L and t for other F.

The JSON result (every block's samples, the machine, load before and after each block) goes to
``--out`` (default ``benchmarks/results/loop-<time>.json``); checkpoints go to a temporary
directory under ``--dir`` (default: the system's temporary directory), removed after. Peak
memory: the model (~1.4x the state), a host copy of the state per saving method (~5x, the DCP
process's shared memory included) and Lightning's queue (up to a few states).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import drop_file_cache, free, fsync_path, rm
from benchmarks._lib.machine import (
    Idle,
    Others,
    loadavg,
    machine,
    mem_available_gib,
    thread_cpu,
    uptime,
)
from benchmarks._lib.results import log, run_recorded
from benchmarks._lib.timing import human, parse_choices, perf, stats

INTERVALS = (1, 2, 5, 10, 50)
METHODS = ("none", "coci", "coci_nb", "dcp_zero", "dcp_thread", "torch_save_bg")
KEEP = 2  # checkpoints kept per method (torchtitan's smallest keep_latest_k)
DISTURBED = 0.3  # cores used by other processes during a block above which it is run again
RETRIES = 2


# -- the load of other processes (this process's children excluded) -----------------------


# -- the training loop ----------------------------------------------------------------------


class Trainer:
    """An MLP and fused Adam on one fixed batch; ``state()`` is what every method saves."""

    def __init__(self, width: int, layers: int, batch: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        mods: list[torch.nn.Module] = []
        for i in range(layers):
            mods.append(torch.nn.Linear(width, width))
            if i < layers - 1:
                mods.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*mods)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5, fused=True)
        self.x = torch.randn(batch, width)
        self.target = torch.randn(batch, width)
        self.step_no = 0
        self.params = sum(p.numel() for p in self.model.parameters())
        self.info = {"width": width, "layers": layers, "batch": batch, "params": self.params}

    def forward_backward(self) -> None:
        self.step_no += 1
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.target)
        loss.backward()  # type: ignore[no-untyped-call]

    def update(self) -> None:
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "step": self.step_no,
        }

    def state_bytes(self) -> int:
        def walk(x: Any) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, dict):
                return sum(walk(v) for v in x.values())
            if isinstance(x, (list, tuple)):
                return sum(walk(v) for v in x)
            return 0

        return walk(self.state())


# -- methods --------------------------------------------------------------------------------


class Saver:
    """One method: ``save`` (timed as the call), ``before_update`` (timed as the wait before
    an optimizer step), ``settle`` (untimed: every pending save durable, files fsync'ed and
    out of the page cache; returns each save's time to durable)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.durable: list[float] = []
        self.lock = threading.Lock()
        self.extra: dict[str, Any] = {}

    def save(self, step: int, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def before_update(self) -> None:
        pass

    def wait_all(self) -> None:
        raise NotImplementedError

    def checkpoints(self) -> list[Path]:
        """This method's checkpoints on disk, oldest first."""
        return sorted(
            (p for p in self.root.iterdir() if p.name.startswith("step-")),
            key=lambda p: int(p.name.split("-")[1].split(".")[0]),
        )

    def settle(self) -> tuple[list[float], dict[str, Any]]:
        self.wait_all()
        for old in self.checkpoints()[:-KEEP]:
            rm(old)
        for p in self.root.rglob("*"):
            if p.is_file():
                with contextlib.suppress(FileNotFoundError):
                    fsync_path(p)
        for d in [self.root, *(p for p in self.root.rglob("*") if p.is_dir())]:
            with contextlib.suppress(FileNotFoundError):
                fsync_path(d)
        drop_file_cache(self.root)
        os.sync()
        with self.lock:
            out, self.durable = self.durable, []
            extra, self.extra = self.extra, {}
        return out, extra

    def close(self) -> None:
        pass


def _wait_writer_idle(directory: Path, timeout_s: float = 300.0) -> None:
    """Until at most ``KEEP`` steps are left in ``directory`` and coci's writer threads
    (``coci-persist``) have used no CPU for three polls in a row (their retention is done)."""
    deadline = perf() + timeout_s
    last, quiet = -1.0, 0
    while quiet < 3 and perf() < deadline:
        time.sleep(0.02)
        steps = sum(p.name.startswith("step-") for p in directory.iterdir())
        cpu = thread_cpu().get("coci-persist", 0.0)
        quiet = quiet + 1 if cpu == last and steps <= KEEP else 0
        last = cpu


class Coci(Saver):
    # coci's defaults (compression "auto", on_busy "wait": a save waits for the previous
    # persist), keep_last=2 as the peers; block=False lets the copy overlap the next forward
    # and backward pass, the optimizer's pre-hook (here before_update by hand) waits for it.
    def __init__(self, root: Path, block: bool) -> None:
        super().__init__(root)
        from coci_core import CheckpointManager

        self.block = block
        self.mgr = CheckpointManager(root, keep_last=KEEP)
        self.handles: list[Any] = []

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.handles.append(self.mgr.save(step, state, block=self.block))

    def before_update(self) -> None:
        if not self.block:
            self.mgr.before_update()

    def wait_all(self) -> None:
        self.mgr.wait()
        _wait_writer_idle(self.root)  # retention after the commit, untimed
        with self.lock:
            for h in self.handles:
                ev = h.event
                if ev is None or ev.outcome != "committed":
                    raise AssertionError(f"coci save of step {h.step}: {ev}")
                self.durable.append(ev.time_to_durable_s)
            self.extra["engine_stall_s"] = [h.event.stall_s for h in self.handles]
            self.extra["copy_s"] = [h.event.copy_s for h in self.handles]
        self.handles = []

    def checkpoints(self) -> list[Path]:
        return []  # coci applies keep_last itself

    def close(self) -> None:
        self.mgr.close()


def _init_group(scratch: Path) -> bool:
    """A one-process gloo group for DCP (its PROCESS executor needs one); whether it was
    started here (and is destroyed at the end)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    # the DCP writer process starts its own group at MASTER_ADDR (else the host's name)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init = f"file://{scratch / 'gloo-store'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    return True


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 sent to ``path`` meanwhile: DCP's writer process, started now,
    inherits it and logs two lines a save there, not in the benchmark's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _stop_dcp_process() -> None:
    """Ends DCP's writer process (it lives as long as this one otherwise)."""
    with contextlib.suppress(Exception):
        from torch.distributed.checkpoint import _async_process_executor as ape

        if ape._CHECKPOINT_PROCESS is not None:
            ape._CHECKPOINT_PROCESS = None  # its __del__ asks it to end and joins it


class Dcp(Saver):
    def __init__(self, root: Path, process: bool) -> None:
        super().__init__(root)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.process = process
        # one stager for the whole run: it keeps its staging buffers across saves
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,  # needs an accelerator
                use_shared_memory=process,  # the writer process reads them without a copy
                use_async_staging=True,  # the copy runs on a staging thread
                use_non_blocking_copy=False,  # needs an accelerator
            )
        )
        self.upload: Any = None
        self.staging: Any = None
        self.purges: list[threading.Thread] = []

    def save(self, step: int, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
            async_save,
        )

        t0 = perf()
        if self.upload is not None:  # torchtitan's maybe_wait_for_saving: the previous upload
            self.upload.result()
        path = self.root / f"step-{step}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resp = async_save(
                state,
                storage_writer=FileSystemWriter(path, sync_files=True),
                planner=DefaultSavePlanner(enable_plan_caching=True),
                async_checkpointer_type=(
                    AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
                ),
                async_stager=self.stager,
            )
        assert isinstance(resp, AsyncSaveResponse)  # use_async_staging: two futures
        self.staging, self.upload = resp.staging_completion, resp.upload_completion

        def done(fut: Any, t0: float = t0) -> None:
            if fut.exception() is None:
                with self.lock:
                    self.durable.append(perf() - t0)

        self.upload.add_done_callback(done)
        # torchtitan's purge thread: older checkpoints are deleted off the training thread
        old = [p for p in self.checkpoints() if p != path][: -(KEEP - 1)]
        if old:

            def purge(old: list[Path] = old) -> None:
                for p in old:
                    rm(p)

            th = threading.Thread(target=purge, daemon=True)
            th.start()
            self.purges.append(th)

    def before_update(self) -> None:
        if self.staging is not None:  # torchtitan's maybe_wait_for_staging
            self.staging.result()
            self.staging = None

    def wait_all(self) -> None:
        self.before_update()
        if self.upload is not None:
            self.upload.result()
            self.upload = None
        for th in self.purges:
            th.join()
        self.purges = []

    def close(self) -> None:
        self.wait_all()
        self.stager.close()


def _clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_tree(v) for v in x)
    return x


class LightningAsync(Saver):
    def __init__(self, root: Path, state_bytes: int) -> None:
        super().__init__(root)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        outer = self

        class DurableTorchIO(TorchCheckpointIO):
            """TorchCheckpointIO, then fsync (it writes through fsspec and never syncs) and
            the newest ``KEEP`` files kept; runs on AsyncCheckpointIO's executor thread."""

            def save_checkpoint(
                self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
            ) -> None:
                super().save_checkpoint(checkpoint, path, storage_options)
                fsync_path(Path(path))
                fsync_path(Path(path).parent)
                outer.saved(Path(path))

        self.io = AsyncCheckpointIO(DurableTorchIO())
        from lightning.pytorch.plugins.io import async_plugin

        # does save_checkpoint clone on the calling thread? (else the next step races the save)
        self.clones = hasattr(async_plugin, "_clone_tensor")
        self.state_bytes = state_bytes
        self.started: dict[Path, float] = {}
        self.pending = 0
        self.memory_waits = 0
        self.max_pending = 0

    def saved(self, path: Path) -> None:
        with self.lock:
            self.durable.append(perf() - self.started.pop(path))
            self.pending -= 1
        for old in self.checkpoints()[:-KEEP]:
            rm(old)

    def save(self, step: int, state: dict[str, Any]) -> None:
        t0 = perf()
        if self.pending and mem_available_gib() * 2**30 < 4 * self.state_bytes:
            self.memory_waits += 1  # the unbounded queue would run out of memory: drain it
            self.wait_all()
        path = self.root / f"step-{step}.ckpt"
        with self.lock:
            self.started[path] = t0
            self.pending += 1
            self.max_pending = max(self.max_pending, self.pending)
        if not self.clones:
            state = _clone_tree(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.io.save_checkpoint(state, path)

    def wait_all(self) -> None:
        self.io.teardown()  # waits for the queue; the next save starts a new executor

    def settle(self) -> tuple[list[float], dict[str, Any]]:
        durable, extra = super().settle()
        extra.update(
            memory_waits=self.memory_waits,
            max_queued=self.max_pending,
            lightning_clones=self.clones,
        )
        self.memory_waits = self.max_pending = 0
        return durable, extra

    def close(self) -> None:
        self.wait_all()


def make_saver(method: str, root: Path, state_bytes: int) -> Saver:
    if method in ("coci", "coci_nb"):
        return Coci(root, block=method == "coci")
    if method in ("dcp_zero", "dcp_thread"):
        return Dcp(root, process=method == "dcp_zero")
    if method == "torch_save_bg":
        return LightningAsync(root, state_bytes)
    raise ValueError(method)


# -- blocks ---------------------------------------------------------------------------------


def periods_for(every: int, args: argparse.Namespace) -> int:
    return max(int(args.min_periods), math.ceil(int(args.min_steps) / every))


def run_block(trainer: Trainer, saver: Saver | None, every: int, periods: int) -> dict[str, Any]:
    """One lead-in step, then ``periods`` x [save, ``every`` steps] (no save with ``saver``
    None); the saver settled after it (untimed)."""
    compute: list[float] = []  # per step: zero_grad .. opt.step without the wait
    waits: list[float] = []  # per step: the wait before opt.step
    calls: list[float] = []  # per save: the save call

    def one_step() -> None:
        t0 = perf()
        trainer.forward_backward()
        t1 = perf()
        if saver is not None:
            saver.before_update()
        t2 = perf()
        trainer.update()
        t3 = perf()
        compute.append((t1 - t0) + (t3 - t2))
        waits.append(t2 - t1)

    out: dict[str, Any] = {"load_before": loadavg(), "uptime_before": uptime()}
    with Others() as o:
        one_step()  # the lead-in: not in the periods
        t0 = perf()
        for _ in range(periods):
            if saver is not None:
                s0 = perf()
                saver.save(trainer.step_no, trainer.state())
                calls.append(perf() - s0)
            for _ in range(every):
                one_step()
        loop_s = perf() - t0
    s0 = perf()
    durable, extra = saver.settle() if saver is not None else ([], {})
    n = periods * every
    out.update(
        every=every,
        periods=periods,
        steps=n,
        loop_s=loop_s,
        loop_step_s=loop_s / n,
        lead_in_s=compute[0] + waits[0],
        step_s=compute[1:],
        wait_s=waits[1:],
        save_call_s=calls,
        durable_s=durable,
        settle_s=perf() - s0,
        others_cores=round(o.cores, 3),
        load_after=loadavg(),
        uptime_after=uptime(),
        **extra,
    )
    if saver is not None:
        # per save: the call plus the waits before the updates of the steps after it
        out["stall_s"] = [
            c + sum(waits[1 + k * every : 1 + (k + 1) * every]) for k, c in enumerate(calls)
        ]
    return out


def sampled(fn: Callable[[], dict[str, Any]], idle: Idle | None) -> dict[str, Any]:
    """``fn()``, run again (after waiting for quiet cores) while other processes disturbed it,
    within the idle budget."""
    discarded: list[dict[str, Any]] = []
    for attempt in range(RETRIES + 1):
        r = fn()
        if (
            r["others_cores"] < DISTURBED
            or attempt == RETRIES
            or idle is None
            or idle.waited_s >= idle.budget_s
        ):
            break
        discarded.append(r)
        idle.wait(60)
    if discarded:
        r["discarded"] = discarded
    return r


def fmt_block(r: dict[str, Any]) -> str:
    parts = [f"step {statistics.fmean(r['step_s']) * 1e3:.1f} ms", f"loop {r['loop_s']:.2f} s"]
    if r.get("stall_s"):
        parts.append(f"stall {statistics.fmean(r['stall_s']):.3f} s")
    if r.get("durable_s"):
        parts.append(f"durable {statistics.fmean(r['durable_s']):.2f} s")
    parts.append(f"others {r['others_cores']:.2f}")
    if r.get("discarded"):
        parts.append(f"(run {len(r['discarded']) + 1}x)")
    return ", ".join(parts)


# -- one cell: one torch thread setting -----------------------------------------------------


def block_metrics(r: dict[str, Any], none_step: float, failure_every: float) -> dict[str, float]:
    """The reported numbers of one block against the round's ``none`` step time."""
    t, n_every = r["loop_step_s"], r["every"]
    after = statistics.fmean(r["step_s"])
    durable = statistics.fmean(r["durable_s"]) if r.get("durable_s") else math.nan
    lost = n_every / 2 + durable / t
    return {
        "stall_s": statistics.fmean(r["stall_s"]),
        "save_call_s": statistics.fmean(r["save_call_s"]),
        "after_step_s": after,
        "slowdown_pct": 100 * (after / none_step - 1),
        "loop_step_s": t,
        "overhead_pct": 100 * (t / none_step - 1),
        "durable_s": durable,
        "lost_steps": lost,
        "cost_pct": 100 * (t * (1 + lost / failure_every) / none_step - 1),
    }


def cell(
    threads: int,
    trainer: Trainer,
    args: argparse.Namespace,
    scratch: Path,
    idle: Idle | None,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    t_cell = perf()
    savers_names = [m for m in args.methods if m != "none"]
    out: dict[str, Any] = {
        "threads": threads,
        "uptime_before": uptime(),
        "mem_available_gib_before": mem_available_gib(),
        "warmup": {},
        "rounds": [],
    }
    log(f"cell: {threads} torch thread(s); {uptime()}")
    for _ in range(3):  # the loop at this thread count, before anything is timed
        trainer.forward_backward()
        trainer.update()
    state_bytes = trainer.state_bytes()
    root = scratch / f"threads-{threads}"
    savers = {m: make_saver(m, root / m, state_bytes) for m in savers_names}
    try:
        none_w = run_block(trainer, None, 1, args.none_steps)
        out["warmup"]["none"] = none_w
        log(f"  warmup none: {fmt_block(none_w)}")
        for m, s in savers.items():
            if m == "dcp_zero":  # the first save starts DCP's writer process
                dcp_log = scratch / "dcp-process.log"
                try:
                    with _stderr_to(dcp_log):
                        r = run_block(trainer, s, 1, 2)
                except BaseException:
                    with contextlib.suppress(OSError):
                        print(dcp_log.read_text()[-4000:], file=sys.stderr)
                    raise
            else:
                r = run_block(trainer, s, 1, 2)
            out["warmup"][m] = r
            log(f"  warmup {m}: {fmt_block(r)}")
        # the expected duration of the rounds, from the warm-up
        t0 = statistics.fmean(none_w["step_s"])
        steps = 2 * (1 + args.none_steps) + len(savers) * sum(
            1 + periods_for(e, args) * e for e in args.every
        )
        per_save = {
            m: statistics.fmean(r["stall_s"]) for m, r in out["warmup"].items() if m in savers
        }
        saves = sum(periods_for(e, args) for e in args.every)
        settle = sum(r["settle_s"] for m, r in out["warmup"].items() if m in savers)
        est = args.rounds * (steps * t0 + saves * sum(per_save.values()) + len(args.every) * settle)
        out["expected_s"] = est
        log(f"  expected: about {est / 60:.1f} min for {args.rounds} round(s) of this cell")
        for rnd in range(args.rounds):
            if idle is not None:
                idle.wait(60)
            k = rnd % len(savers_names) if savers_names else 0
            order = savers_names[k:] + savers_names[:k]
            rec: dict[str, Any] = {"round": rnd, "order": order, "none": [], "blocks": []}
            # the round's baseline (measured whether or not --methods names `none`)
            r = sampled(functools.partial(run_block, trainer, None, 1, args.none_steps), idle)
            rec["none"].append(r)
            log(f"  round {rnd} none: {fmt_block(r)}")
            for every in args.every:
                periods = periods_for(every, args)
                for m in order:
                    if idle is not None:
                        idle.wait(20)
                    r = sampled(
                        functools.partial(run_block, trainer, savers[m], every, periods), idle
                    )
                    r["method"] = m
                    rec["blocks"].append(r)
                    log(f"  round {rnd} every {every:>3} {m:<14} {fmt_block(r)}")
            r = sampled(functools.partial(run_block, trainer, None, 1, args.none_steps), idle)
            rec["none"].append(r)
            log(f"  round {rnd} none: {fmt_block(r)}")
            rec["none_step_s"] = statistics.fmean(s for b in rec["none"] for s in b["step_s"])
            for b in rec["blocks"]:
                b["metrics"] = block_metrics(b, rec["none_step_s"], args.failure_every)
            out["rounds"].append(rec)
    finally:
        for s in savers.values():
            s.close()
        rm(root)
        free()
    out["summary"] = summarize(out, savers_names, args.every)
    out["uptime_after"] = uptime()
    out["seconds"] = perf() - t_cell
    return out


METRICS = (
    "stall_s",
    "save_call_s",
    "after_step_s",
    "slowdown_pct",
    "loop_step_s",
    "overhead_pct",
    "durable_s",
    "lost_steps",
    "cost_pct",
)


def summarize(c: dict[str, Any], methods: list[str], every: list[int]) -> dict[str, Any]:
    """Per method and interval: every metric's stats over rounds (median, min, max...)."""
    out: dict[str, Any] = {
        "none": {"step_s": stats([r["none_step_s"] for r in c["rounds"]])},
    }
    for m in methods:
        out[m] = {}
        for e in every:
            blocks = [
                b for r in c["rounds"] for b in r["blocks"] if b["method"] == m and b["every"] == e
            ]
            out[m][str(e)] = {
                k: stats([b["metrics"][k] for b in blocks if b["metrics"][k] == b["metrics"][k]])
                for k in METRICS
            }
            out[m][str(e)]["saves_per_block"] = blocks[0]["periods"] if blocks else 0
    return out


# -- report ---------------------------------------------------------------------------------


def _m(st: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
    return "-" if not st else f"{st['median'] * scale:.{digits}f}"


def _range(st: dict[str, float], digits: int = 1) -> str:
    if not st:
        return "-"
    if st["n"] == 1:
        return f"{st['median']:.{digits}f}"
    return f"{st['median']:.{digits}f} ({st['min']:.{digits}f} to {st['max']:.{digits}f})"


def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    mod = res["model"]
    L = [
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']:.1f} GiB RAM, torch "
        f"{m['torch']}, python {m['python']}, disk {m['disk']}",
        f"Command: `{res.get('command', '?')}`; load before: "
        f"`{res.get('uptime_before', '?').split('load average: ')[-1]}`",
        f"Model: MLP {mod['width']} x {mod['layers']}, batch {mod['batch']}, "
        f"{mod['params'] / 1e6:.1f} M parameters, fused Adam; state {human(res['state_bytes'])}. "
        f"{res['rounds']} round(s), medians over rounds; cost: failures every "
        f"{res['failure_every']:g} steps.",
    ]
    for c in res["cells"]:
        none = c["summary"]["none"]["step_s"]
        L += [
            "",
            f"### {c['threads']} torch thread(s): `none` step {_m(none, 1, 1e3)} ms",
            "",
            "| method | every | saves/block | stall (s) | after-save step (ms) | slowdown % | "
            "overhead % | durable (s) | lost (steps) | cost % |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for meth, by_every in c["summary"].items():
            if meth == "none":
                continue
            for e, s in by_every.items():
                L.append(
                    f"| {meth} | {e} | {s['saves_per_block']} | {_m(s['stall_s'])} | "
                    f"{_m(s['after_step_s'], 1, 1e3)} | {_m(s['slowdown_pct'], 1)} | "
                    f"{_range(s['overhead_pct'])} | {_m(s['durable_s'], 2)} | "
                    f"{_m(s['lost_steps'], 1)} | {_m(s['cost_pct'], 1)} |"
                )
        disturbed = sum(
            len(b.get("discarded", ())) for r in c["rounds"] for b in [*r["none"], *r["blocks"]]
        )
        extra = [f"cell {c['seconds'] / 60:.1f} min", f"{disturbed} disturbed block(s) re-run"]
        lw = [
            b.get("memory_waits", 0)
            for r in c["rounds"]
            for b in r["blocks"]
            if b["method"] == "torch_save_bg"
        ]
        if any(lw):
            extra.append(f"torch_save_bg waited {sum(lw)}x for its queue (memory)")
        L += ["", "; ".join(extra)]
    return "\n".join(L)


# -- command line ---------------------------------------------------------------------------


def _threads(s: str) -> list[int]:
    out: list[int] = []
    for x in s.split(","):
        n = (os.cpu_count() or 1) if x == "all" else int(x)
        if n not in out:
            out.append(n)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--every",
        default=None,
        help="save intervals N, comma list (default 1,2,5,10,50; --quick: 1,2,5)",
    )
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma list of {METHODS} (the `none` baseline runs in every round regardless)",
    )
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick: 2)")
    ap.add_argument(
        "--threads",
        default="1,all",
        help="torch thread settings, one cell each: comma list of numbers and 'all' "
        "(os.cpu_count()); default %(default)s",
    )
    ap.add_argument("--width", type=int, default=None, help="MLP width (default 4096; quick 256)")
    ap.add_argument("--layers", type=int, default=None, help="linear layers (default 5; quick 2)")
    ap.add_argument("--batch", type=int, default=None, help="batch rows (default 16; quick 8)")
    ap.add_argument(
        "--min-steps",
        type=int,
        default=None,
        help="steps per block at least: periods = max(min-periods, ceil(min-steps / N)) "
        "(default 10; quick 4)",
    )
    ap.add_argument("--min-periods", type=int, default=1, help="saves per block at least")
    ap.add_argument(
        "--none-steps",
        type=int,
        default=None,
        help="steps of each `none` block (two a round; default 10; quick 4)",
    )
    ap.add_argument(
        "--failure-every",
        type=float,
        default=1000,
        help="mean steps between failures for the lost-work-weighted cost (default %(default)s)",
    )
    ap.add_argument("--quick", action="store_true", help="a tiny model: a smoke test")
    ap.add_argument(
        "--dir", default=None, help="scratch directory on the disk under test (default: temp)"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="results directory (default: benchmarks/results; file loop-<time>.json)",
    )
    ap.add_argument(
        "--idle-budget",
        type=float,
        default=None,
        help="total seconds the run may wait for other processes to leave the cores "
        "(disturbed blocks are re-run within it; 0: never wait; default 300, --quick 0)",
    )
    ap.add_argument(
        "--idle-threshold", type=float, default=0.15, help="cores used by others that count as idle"
    )
    ap.add_argument("--report", metavar="JSON", help="print the tables of an earlier run and exit")
    args = ap.parse_args(argv)
    if args.report:
        res: dict[str, Any] = json.loads(Path(args.report).read_text())
        print(report(res))
        return res
    q = args.quick
    defaults = {
        "every": "1,2,5" if q else ",".join(map(str, INTERVALS)),
        "rounds": 2 if q else 3,
        "width": 256 if q else 4096,
        "layers": 2 if q else 5,
        "batch": 8 if q else 16,
        "min_steps": 4 if q else 10,
        "none_steps": 4 if q else 10,
        "idle_budget": 0 if q else 300,
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.every = sorted({int(x) for x in str(args.every).split(",") if x})
    args.methods = parse_choices(args.methods, METHODS, "methods")
    args.threads = _threads(args.threads)
    if args.rounds < 1 or not args.every or min(args.every) < 1:
        raise SystemExit("--rounds and every interval must be >= 1")
    idle = Idle(args.idle_budget, args.idle_threshold, log) if args.idle_budget else None
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    threads_before = torch.get_num_threads()

    def run(scratch: Path) -> dict[str, Any]:
        started_group = False
        if any(m.startswith("dcp") for m in args.methods):
            started_group = _init_group(scratch)
        trainer = Trainer(args.width, args.layers, args.batch)
        trainer.forward_backward()
        trainer.update()  # Adam's state exists from here on
        out: dict[str, Any] = {
            "machine": machine(disk_of=str(scratch)),
            "rounds": args.rounds,
            "quick": args.quick,
            "every": args.every,
            "methods": args.methods,
            "failure_every": args.failure_every,
            "model": trainer.info,
            "state_bytes": trainer.state_bytes(),
            "args": {k: v for k, v in vars(args).items() if k not in ("dir", "out")},
            "cells": [],
        }
        log(
            f"machine: {out['machine']}; model {trainer.info}, state "
            f"{human(out['state_bytes'])}; {uptime()}"
        )
        t0 = perf()
        try:
            for threads in args.threads:
                if idle is not None:
                    idle.wait(60)
                out["cells"].append(cell(threads, trainer, args, scratch, idle))
        finally:
            _stop_dcp_process()
            if started_group:
                import torch.distributed as dist

                dist.destroy_process_group()
            torch.set_num_threads(threads_before)
        out["seconds"] = perf() - t0
        out["idle_waited_s"] = idle.waited_s if idle is not None else 0.0
        return out

    res, path = run_recorded("loop", run, scratch_dir=args.dir, out_dir=args.out)
    print(report(res))
    log(f"results in {path}")
    return res


if __name__ == "__main__":
    main()
