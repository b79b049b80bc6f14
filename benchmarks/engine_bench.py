#!/usr/bin/env python
"""Benchmark of coci's engine against the copy limit, torch.save, DCP async_save, safetensors
and raw fsync'ed disk writes; restore speed; and step-time overhead in a CPU training loop.

Run (about 20 minutes on 2 idle cores; it only creates and deletes cell-*/ and train/ under --dir):

    python benchmarks/engine_bench.py --sizes 100M,1G,4G --reps 5 --dir /work/bench-tmp/engine

Writes benchmarks/results/engine-<time>.json (every sample, load averages, machine) and prints
Markdown tables; ``--report FILE.json`` prints the tables of an earlier run again.

Method: every method runs once as a warm-up (its first, allocating save is reported apart);
then ``--reps`` repetitions, each running every method once, in an order rotated by one per
repetition. Medians are over repetitions. Each save is made durable and its file pages are
dropped from the page cache before the next method runs, so that methods do not overlap.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from coci_core import CheckpointManager

PAGE = 4096
ALIGN = 64
CHUNK = 64 * 1024 * 1024
perf = time.perf_counter


# -- small helpers ------------------------------------------------------------------------


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


_HZ = os.sysconf("SC_CLK_TCK")


def _cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process and its threads)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return user + nice + system + irq + softirq + steal, int(own[11]) + int(own[12])


class Others:
    """CPU used by everything but this process (cores, averaged over a window): the
    disturbance of a sample. Kernel writeback threads count too (a few % during writes)."""

    def __enter__(self) -> Others:
        self.t0, (self.b0, self.s0) = perf(), _cpu_jiffies()
        return self

    def __exit__(self, *exc: object) -> None:
        b, own = _cpu_jiffies()
        wall = max(perf() - self.t0, 1e-3)
        self.cores = max(0.0, ((b - self.b0) - (own - self.s0)) / _HZ / wall)


class Idle:
    """Waits (within a total budget) until other processes leave the cores alone."""

    def __init__(self, budget_s: float, threshold: float, log: Callable[[str], None]) -> None:
        self.budget_s, self.threshold, self.log = budget_s, threshold, log
        self.waited_s = 0.0

    def wait(self, max_s: float = 90.0) -> float:
        start, quiet = perf(), 0
        while (
            quiet < 2
            and perf() - start < max_s
            and self.waited_s + (perf() - start) < self.budget_s
        ):
            with Others() as o:
                time.sleep(1.0)
            quiet = quiet + 1 if o.cores < self.threshold else 0
        waited = perf() - start
        self.waited_s += waited
        if waited > 3:
            self.log(
                f"    (waited {waited:.0f} s for other processes to leave the cores; {uptime()})"
            )
        return waited


IDLE: Idle | None = None
RETRIES = 2
DISTURBED = 0.3  # cores used by others during a sample above which it is retried


def sample(
    fn: Callable[[], dict[str, Any]], cleanup: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Run one measurement; if other processes used the cores meanwhile, wait and retry."""
    discarded: list[dict[str, Any]] = []
    for attempt in range(RETRIES + 1):
        la = loadavg()[0]
        with Others() as o:
            r = fn()
        r["load1_before"], r["others_cores"] = la, round(o.cores, 3)
        if (
            o.cores < DISTURBED
            or attempt == RETRIES
            or IDLE is None
            or IDLE.waited_s >= IDLE.budget_s
        ):
            break
        discarded.append(r)
        if cleanup is not None:
            cleanup()
        IDLE.wait(60)
    if discarded:
        r["discarded"] = discarded
    return r


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def human(n: float) -> str:
    for unit, m in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= m:
            return f"{n / m:.3g} {unit}"
    return f"{n:.0f} B"


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "p25": q[0],
        "p75": q[2],
        "mean": statistics.fmean(xs),
    }


def drop_file_cache(path: Path) -> None:
    """Evict a file's (clean) pages from the page cache; directories are walked."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def free() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


# -- the state: a transformer's fp32 weights plus Adam state ------------------------------


def transformer_layout(
    target_bytes: int,
) -> tuple[list[tuple[str, tuple[int, ...]]], dict[str, int]]:
    """Parameter names and shapes of a GPT-style transformer whose weights + Adam state (12
    bytes per parameter) come to about ``target_bytes``."""
    if target_bytes < 300e6:
        d, vocab = 384, 8192
    elif target_bytes < 2e9:
        d, vocab = 1024, 32768
    else:
        d, vocab = 2048, 32768
    per_layer = 12 * d * d + 13 * d
    target_params = target_bytes / 12
    layers = max(1, round((target_params - vocab * d - 2 * d) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("tok_emb.weight", (vocab, d)),
        ("pos_emb.weight", (1024, d)),
    ]
    for i in range(layers):
        p = f"blocks.{i}."
        shapes += [
            (p + "ln1.weight", (d,)),
            (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.proj.weight", (d, d)),
            (p + "attn.proj.bias", (d,)),
            (p + "ln2.weight", (d,)),
            (p + "ln2.bias", (d,)),
            (p + "mlp.fc1.weight", (4 * d, d)),
            (p + "mlp.fc1.bias", (4 * d,)),
            (p + "mlp.fc2.weight", (d, 4 * d)),
            (p + "mlp.fc2.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes, {"d_model": d, "vocab": vocab, "layers": layers}


def build_state(target_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    shapes, info = transformer_layout(target_bytes)
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(16 * 2**20 + 4099, generator=gen)  # 64 MB of noise, copied around

    def filled(shape: tuple[int, ...], salt: int) -> torch.Tensor:
        t = torch.empty(shape)
        flat = t.view(-1)
        pos, start = 0, (salt * 7919) % 4096
        while pos < flat.numel():
            n = min(flat.numel() - pos, source.numel() - start)
            flat[pos : pos + n].copy_(source[start : start + n])
            pos += n
            start = 0
        return t

    model = collections.OrderedDict()
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(shapes):
        model[name] = filled(shape, 3 * i)
        opt_state[i] = {
            "step": torch.tensor(float(100)),
            "exp_avg": filled(shape, 3 * i + 1),
            "exp_avg_sq": filled(shape, 3 * i + 2).abs_(),
        }
    param_groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "params": list(range(len(shapes))),
        }
    ]
    state = {
        "model": model,
        "optim": {"state": opt_state, "param_groups": param_groups},
        "step": 100,
    }
    tensors = list(model.values()) + [t for s in opt_state.values() for t in s.values()]
    info.update(
        params=sum(t.numel() for t in model.values()),
        tensors=len(tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors),
    )
    return state, info


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state's tensors under dotted names (what safetensors can hold)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state["model"].items():
        out[f"model.{k}"] = v
    for i, s in state["optim"]["state"].items():
        for k, v in s.items():
            out[f"optim.state.{i}.{k}"] = v
    return out


def clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, clone_tree(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return x


class BenchArena:
    """The reused, page-aligned buffer of the copy limit and the raw disk writes."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        offsets, off = [], 0
        for t in tensors:
            offsets.append(off)
            off = (off + t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
        self.total = max((off + PAGE - 1) // PAGE * PAGE, PAGE)
        raw = torch.empty(self.total + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        self.bytes = raw[start : start + self.total]
        self._raw = raw
        self.views = [
            self.bytes[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors, strict=True)
        ]
        self.np = self.bytes.numpy()


def compute_fn(seconds: float) -> tuple[Callable[[], None], dict[str, Any]]:
    """Matmuls that take about ``seconds`` on an idle machine (the simulated forward/backward)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    trials = []
    for _ in range(20):  # the fastest trial: robust against other processes on the cores
        t0 = perf()
        for _ in range(3):
            a @ b
        trials.append((perf() - t0) / 3)
    one = min(trials)
    n = max(1, round(seconds / one))

    def compute() -> None:
        for _ in range(n):
            torch.mm(a, b)

    return compute, {"matmul_1024_s": one, "matmuls": n, "target_s": seconds}


# -- save methods -------------------------------------------------------------------------


class SaveCell:
    """Every save method on one state; each ``run_<name>`` does one save and returns metrics."""

    def __init__(
        self,
        state: dict[str, Any],
        info: dict[str, Any],
        root: Path,
        compute: Callable[[], None],
        dcp_threads: int,
    ) -> None:
        self.state = state
        self.info = info
        self.root = root
        self.compute = compute
        self.dcp_threads = dcp_threads
        self.tensors = flat_tensors(state)
        self.tensor_list = list(self.tensors.values())
        self.arena: BenchArena | None = None
        self.mgr: CheckpointManager | None = None
        self.stagers: dict[str, Any] = {}
        self.counter = 0

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None
        for s in self.stagers.values():
            s.close()
        self.stagers.clear()
        self.arena = None
        free()

    def _step(self) -> int:
        self.counter += 1
        return self.counter

    # (the simulated compute alone, for the slowdown of compute under a background copy)
    def run_compute(self) -> dict[str, Any]:
        t0 = perf()
        self.compute()
        return {"compute_s": perf() - t0}

    def run_copy(self) -> dict[str, Any]:
        t0 = perf()
        if self.arena is None:
            self.arena = BenchArena(self.tensor_list)
        for dst, src in zip(self.arena.views, self.tensor_list, strict=True):
            dst.copy_(src)
        return {"stall_s": perf() - t0}

    def _manager(self) -> CheckpointManager:
        if self.mgr is None:
            self.mgr = CheckpointManager(self.root / "coci", keep_last=1)
        return self.mgr

    def run_coci_block(self) -> dict[str, Any]:
        mgr = self._manager()
        t0 = perf()
        h = mgr.save(self._step(), self.state, block=True)
        t1 = perf()
        ev = h.wait()
        t2 = perf()
        return {
            "stall_s": t1 - t0,
            "engine_stall_s": ev.stall_s,
            "copy_s": ev.copy_s,
            "persist_s": ev.persist_s,
            # time to durable: the engine's commit time; wait() returns later (waited_s)
            "durable_s": ev.time_to_durable_s,
            "waited_s": t2 - t0,
            "bytes": ev.bytes_written,
            "first_save": ev.first_save,
        }

    def run_coci_nb(self) -> dict[str, Any]:
        mgr = self._manager()
        t0 = perf()
        h = mgr.save(self._step(), self.state, block=False)
        t1 = perf()
        self.compute()
        t2 = perf()
        mgr.before_update()
        t3 = perf()
        ev = h.wait()
        t4 = perf()
        return {
            # time to durable: the engine's own commit time (it may commit during the compute)
            "waited_s": t4 - t0,
            "durable_s": ev.time_to_durable_s,
            "stall_s": (t1 - t0) + (t3 - t2),
            "save_call_s": t1 - t0,
            "before_update_s": t3 - t2,
            "compute_s": t2 - t1,
            "engine_stall_s": ev.stall_s,
            "copy_s": ev.copy_s,
            "persist_s": ev.persist_s,
            "bytes": ev.bytes_written,
            "first_save": ev.first_save,
        }

    def _file_save(self, name: str, save: Callable[[Path], None]) -> dict[str, Any]:
        path = self.root / name
        rm(path)
        t0 = perf()
        save(path)
        t1 = perf()
        fsync_path(path)
        fsync_path(path.parent)
        t2 = perf()
        size = path.stat().st_size
        drop_file_cache(path)
        return {"stall_s": t1 - t0, "durable_s": t2 - t0, "bytes": size}

    def run_torch_save(self) -> dict[str, Any]:
        return self._file_save("state.pt", lambda p: torch.save(self.state, p))

    def run_safetensors(self) -> dict[str, Any]:
        from safetensors.torch import save_file

        return self._file_save("state.safetensors", lambda p: save_file(self.tensors, p))

    def _raw_write(self, direct: bool, threads: int = 1) -> dict[str, Any]:
        """One fsync'ed file from the reused buffer, in CHUNK-sized writes; with ``threads`` > 1
        the chunks are written with pwrite by that many threads (more I/O in flight)."""
        if self.arena is None:
            self.run_copy()
        assert self.arena is not None
        total = self.arena.total
        path = self.root / f"raw-{'direct' if direct else 'buffered'}-{threads}.bin"
        rm(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        mv = self.arena.np.data
        starts = list(range(0, total, CHUNK))

        def writer(fd: int, mine: list[int]) -> None:
            for start in mine:
                view = mv[start : min(start + CHUNK, total)]
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], start + done)

        t0 = perf()
        fd = os.open(path, flags, 0o644)
        try:
            if threads == 1:
                writer(fd, starts)
            else:
                ths = [
                    threading.Thread(target=writer, args=(fd, starts[i::threads]))
                    for i in range(threads)
                ]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join()
            os.fsync(fd)
        finally:
            os.close(fd)
        t1 = perf()
        drop_file_cache(path)
        t2 = perf()
        rm(path)
        return {"durable_s": t1 - t0, "bytes": total, "unlink_s": perf() - t2}

    def run_raw_direct_2t(self) -> dict[str, Any]:
        return self._raw_write(direct=True, threads=2)

    def run_raw_buffered(self) -> dict[str, Any]:
        return self._raw_write(direct=False)

    def run_raw_direct(self) -> dict[str, Any]:
        return self._raw_write(direct=True)

    def _dcp(self, async_staging: bool) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        key = "async" if async_staging else "sync"
        if key not in self.stagers:
            # On CPU, pinned memory and non-blocking copies need an accelerator; shared memory
            # only helps a separate upload process. The stager caches its buffers across saves.
            self.stagers[key] = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=async_staging,
                    use_non_blocking_copy=False,
                )
            )
        path = self.root / f"dcp-{key}-{self._step()}"
        writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=self.dcp_threads)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = perf()
            resp = dcp.async_save(
                self.state, storage_writer=writer, async_stager=self.stagers[key], no_dist=True
            )
            t1 = perf()
            out: dict[str, Any] = {}
            if async_staging:
                done_at: list[float] = []
                resp.upload_completion.add_done_callback(lambda _f: done_at.append(perf()))
                self.compute()
                t2 = perf()
                resp.staging_completion.result()
                t3 = perf()
                resp.upload_completion.result()
                # time to durable: when the upload finished (it may finish during the compute)
                out.update(
                    save_call_s=t1 - t0,
                    before_update_s=t3 - t2,
                    compute_s=t2 - t1,
                    stall_s=(t1 - t0) + (t3 - t2),
                    waited_s=perf() - t0,
                )
            else:
                resp.result()
                out.update(stall_s=t1 - t0)
            t4 = done_at[0] if async_staging and done_at else perf()
        fsync_path(path)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        drop_file_cache(path)
        for old in self.root.glob(f"dcp-{key}-*"):
            if old != path:
                rm(old)
        out.update(durable_s=t4 - t0, bytes=size)
        return out

    def run_dcp_sync(self) -> dict[str, Any]:
        return self._dcp(async_staging=False)

    def run_dcp_async(self) -> dict[str, Any]:
        return self._dcp(async_staging=True)


# -- restore methods ----------------------------------------------------------------------


class RestoreCell:
    def __init__(self, root: Path, reference: dict[str, torch.Tensor]) -> None:
        self.root = root
        self.coci_dir = root / "coci"
        self.reference = reference
        self.mgr = CheckpointManager(self.coci_dir, keep_last=None)
        self.step = self.mgr.latest_step()
        self.files = {
            "coci_restore": self.coci_dir,
            "torch_load": root / "state.pt",
            "safetensors_load": root / "state.safetensors",
            "safetensors_mmap": root / "state.safetensors",
            "raw_read": self.coci_dir / f"step-{self.step:010d}" / "data-r0.bin",
        }
        self.checked: set[str] = set()

    def available(self) -> list[str]:
        return [
            m
            for m, p in self.files.items()
            if p.exists() and (m != "coci_restore" or self.step is not None)
        ]

    def close(self) -> None:
        self.mgr.close()

    def run(self, method: str, cold: bool) -> dict[str, Any]:
        if cold:
            drop_file_cache(self.files[method])
        t0 = perf()
        if method == "coci_restore":
            out = self.mgr.restore(self.step)
            flat = flat_tensors(out)
        elif method == "torch_load":
            out = torch.load(self.files[method], weights_only=True)
            flat = flat_tensors(out)
        elif method == "safetensors_load":
            from safetensors.torch import load_file

            flat = load_file(self.files[method], backend="pread")  # reads into process memory
        elif method == "safetensors_mmap":
            from safetensors.torch import load_file

            # the default backend maps the file lazily: touch one value per 4 KiB page so that
            # every page is actually read (page faults), as a training job would on first use
            flat = load_file(self.files[method])
            for v in flat.values():
                if v.numel():
                    float(v.reshape(-1)[:: max(1, PAGE // v.element_size())].sum())
        else:
            path = self.files[method]
            n = path.stat().st_size
            buf = torch.empty(n, dtype=torch.uint8)
            mv = buf.numpy().data
            with open(path, "rb", buffering=0) as f:
                got = 0
                while got < n:
                    got += f.readinto(mv[got : min(got + CHUNK, n)])
            flat = None
        t1 = perf()
        if flat is not None and method not in self.checked:  # once, untimed: same bytes back
            self.checked.add(method)
            bad = [k for k, v in self.reference.items() if not torch.equal(flat[k], v)]
            if bad:
                raise AssertionError(f"{method}: {len(bad)} tensors differ, e.g. {bad[:3]}")
        size = sum(
            p.stat().st_size
            for p in (
                [self.files[method]]
                if self.files[method].is_file()
                else self.files[method].rglob("*")
            )
            if p.is_file()
        )
        return {"seconds": t1 - t0, "bytes": size}


# -- cells --------------------------------------------------------------------------------


def run_rotation(
    methods: list[str],
    reps: int,
    fn: Callable[[str], dict[str, Any]],
    log: Callable[[str], None],
    first_label: str = "first",
) -> dict[str, Any]:
    """Warm-up (first) pass in the listed order, then ``reps`` passes rotated by one each."""
    out: dict[str, Any] = {m: {first_label: None, "reps": []} for m in methods}
    for m in methods:
        la = loadavg()
        with Others() as o:
            r = fn(m)  # the first save is never retried: it is the allocating one
        r["load1_before"], r["others_cores"] = la[0], round(o.cores, 3)
        out[m][first_label] = r
        log(f"    {first_label:>6} {m:<18} {fmt_sample(r)}")
    for rep in range(reps):
        if IDLE is not None:
            IDLE.wait(30)
        k = rep % len(methods)
        order = methods[k:] + methods[:k]
        for m in order:
            r = sample(lambda m=m: fn(m))
            r["rep"] = rep
            out[m]["reps"].append(r)
            log(f"    rep {rep:>2} {m:<18} {fmt_sample(r)}")
    return out


def fmt_sample(r: dict[str, Any]) -> str:
    keys = ("stall_s", "compute_s", "durable_s", "seconds")
    parts = [f"{k}={r[k]:.3f}" for k in keys if k in r]
    if "others_cores" in r:
        parts.append(
            f"others={r['others_cores']:.2f}"
            + (f" (retried {len(r['discarded'])}x)" if r.get("discarded") else "")
        )
    if "bytes" in r and ("durable_s" in r or "seconds" in r):
        t = r.get("durable_s", r.get("seconds"))
        parts.append(f"{r['bytes'] / t / 1e6:.0f} MB/s")
    return " ".join(parts)


def size_cell(
    size: int, args: argparse.Namespace, compute: Callable[[], None], log: Callable[[str], None]
) -> dict[str, Any]:
    root = Path(args.dir) / f"cell-{size}"
    rm(root)
    root.mkdir(parents=True)
    cell: dict[str, Any] = {
        "target_bytes": size,
        "uptime_before": uptime(),
        "mem_available_gib_before": mem_available_gib(),
    }
    t0 = perf()
    state, info = build_state(size)
    cell["state"] = info
    cell["build_s"] = perf() - t0
    log(f"  state: {info} (built in {cell['build_s']:.1f} s)")
    reps = args.reps if size < 2e9 else args.big_reps
    cell["reps"] = reps
    big = size >= 2e9
    methods = [
        "compute",
        "copy",
        "coci_block",
        "coci_nb",
        "torch_save",
        "safetensors",
        "raw_buffered",
        "raw_direct",
        "raw_direct_2t",
    ]
    dcp_methods = ["dcp_sync", "dcp_async"] if not args.no_dcp else []
    if args.quick:
        methods = [m for m in methods if m not in ("safetensors",)]
    groups = [methods + dcp_methods] if not big else [methods, ["compute", *dcp_methods]]
    cell["groups"] = groups
    saves: dict[str, Any] = {}
    for gi, group in enumerate(groups):
        if len(group) <= 1:
            continue
        sc = SaveCell(state, info, root, compute, args.dcp_threads)
        try:
            log(f"  save group {gi}: {group}, {reps} reps (load {loadavg()})")
            res = run_rotation(group, reps, lambda m, sc=sc: getattr(sc, f"run_{m}")(), log)
        finally:
            sc.close()
        for m, v in res.items():
            saves[m if m not in saves else f"{m}@g{gi}"] = v
    cell["saves"] = saves
    free()
    reference = flat_tensors(state)
    rc = RestoreCell(root, reference)
    try:
        rmethods = rc.available()
        log(f"  restore: {rmethods}, {reps} reps, each cold then warm")
        restores: dict[str, Any] = {m: {"cold": [], "warm": []} for m in rmethods}
        for rep in range(reps):
            k = rep % len(rmethods)
            for m in rmethods[k:] + rmethods[:k]:
                for kind in ("cold", "warm"):
                    r = sample(lambda m=m, kind=kind: rc.run(m, cold=kind == "cold"), cleanup=free)
                    r["rep"] = rep
                    restores[m][kind].append(r)
                    free()
                    log(f"    rep {rep:>2} {m:<18} {kind} {fmt_sample(r)}")
        cell["restores"] = restores
    finally:
        rc.close()
    del state, reference
    free()
    rm(root)
    cell["uptime_after"] = uptime()
    cell["seconds"] = perf() - t0
    return cell


# -- training loop ------------------------------------------------------------------------


def training_cell(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    root = Path(args.dir) / "train"
    rm(root)
    root.mkdir(parents=True)
    torch.manual_seed(0)
    width, layers, batch = args.train_width, args.train_layers, args.train_batch
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(batch, width)
    target = torch.randn(batch, width)
    params = sum(p.numel() for p in model.parameters())
    cell: dict[str, Any] = {
        "uptime_before": uptime(),
        "model": {"width": width, "layers": layers, "batch": batch, "params": params},
    }
    mgr = CheckpointManager(root / "coci", keep_last=1)
    bg: dict[str, threading.Thread | None] = {"thread": None}
    global_step = [0]

    def sd() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": global_step[0]}

    def save(method: str) -> None:
        if method == "coci_block":
            mgr.save(global_step[0], sd(), block=True)
        elif method == "coci_nb":
            mgr.save(global_step[0], sd(), block=False)
        elif method == "torch_save":
            torch.save(sd(), root / "ckpt.pt")
        elif method == "clone_bg_torch_save":
            if bg["thread"] is not None:
                bg["thread"].join()
            snapshot = clone_tree(sd())
            th = threading.Thread(target=torch.save, args=(snapshot, root / "ckpt-bg.pt"))
            th.start()
            bg["thread"] = th

    def settle() -> None:
        mgr.wait()
        if bg["thread"] is not None:
            bg["thread"].join()
            bg["thread"] = None
        for p in root.glob("*.pt"):
            fsync_path(p)
            drop_file_cache(p)

    def block(method: str, nsteps: int, save_at: set[int]) -> dict[str, Any]:
        times, save_steps, save_calls = [], [], []
        for i in range(nsteps):
            global_step[0] += 1
            t0 = perf()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            if method == "coci_nb":
                mgr.before_update()
            opt.step()
            if i in save_at:
                s0 = perf()
                save(method)
                save_calls.append(perf() - s0)
            times.append(perf() - t0)
            save_steps.append(i in save_at)
        settle()
        return {"step_s": times, "save_step": save_steps, "save_call_s": save_calls}

    methods = ["none", "coci_block", "coci_nb", "torch_save", "clone_bg_torch_save"]
    n = args.train_steps
    save_at = {i for i in range(n) if i % args.train_every == args.train_every // 2}
    cell.update(
        steps_per_block=n,
        save_every=args.train_every,
        save_at=sorted(save_at),
        rounds=args.train_rounds,
    )
    res: dict[str, Any] = {m: {"warmup": None, "rounds": []} for m in methods}
    log(
        f"  training: {params / 1e6:.1f} M params, batch {batch}, {n} steps per block, saves at "
        f"{sorted(save_at)}"
    )
    try:
        warm_n = args.train_every + 1
        for m in methods:
            la = loadavg()
            r = block(m, warm_n, {args.train_every // 2})
            r["load1_before"] = la[0]
            res[m]["warmup"] = r
            log(f"    warmup {m:<20} steps {[round(t, 3) for t in r['step_s']]}")
        for rnd in range(args.train_rounds):
            if IDLE is not None:
                IDLE.wait(30)
            k = rnd % len(methods)
            for m in methods[k:] + methods[:k]:
                la = loadavg()
                r = sample(lambda m=m: block(m, n, save_at))
                r["round"] = rnd
                res[m]["rounds"].append(r)
                log(
                    f"    round {rnd} {m:<20} mean {statistics.fmean(r['step_s']):.3f} s, "
                    f"steps {[round(t, 2) for t in r['step_s']]} load {la[0]} others "
                    f"{r['others_cores']:.2f}"
                    + (f" (retried {len(r['discarded'])}x)" if r.get("discarded") else "")
                )
    finally:
        mgr.close()
    cell["methods"] = res
    cell["state_bytes"] = 0
    with contextlib.suppress(Exception):
        m = CheckpointManager(root / "coci", keep_last=1)
        cell["state_bytes"] = sum(t.nbytes for t in m.manifest(m.latest_step()).tensors)
        m.close()
    cell["uptime_after"] = uptime()
    rm(root)
    return cell


# -- report -------------------------------------------------------------------------------


def fmt_s(st: dict[str, float], scale: float = 1.0, unit: str = "s", digits: int = 3) -> str:
    if not st:
        return "-"
    med, lo, hi = (st[k] * scale for k in ("median", "min", "max"))
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def _load(u: str) -> str:
    return u.split("load average: ")[-1]


def _nd(rs: list[dict[str, Any]]) -> str:
    """Samples, and how many of them other processes disturbed (>= DISTURBED cores)."""
    return f"{len(rs)} ({sum(r.get('others_cores', 0) >= DISTURBED for r in rs)})"


def report(res: dict[str, Any]) -> str:
    L: list[str] = []
    m = res["machine"]
    L.append(
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']:.1f} GiB RAM, torch "
        f"{m['torch']}, "
        f"python {m['python']}, disk {m['disk']}"
    )
    L.append(
        f"Command: `{res['command']}` (started {res['started']}, took {res['seconds'] / 60:.1f} "
        "min, "
        f"of which {res.get('idle_waited_s', 0) / 60:.1f} min waiting for idle cores)"
    )
    L.append("")
    for cell in res["cells"]:
        st = cell["state"]
        L.append(
            f"### State {human(st['bytes'])}: {st['tensors']} tensors, {st['params'] / 1e6:.1f} M "
            "params "
            f"(d={st['d_model']}, {st['layers']} layers, vocab {st['vocab']}); {cell['reps']} "
            "reps; "
            f"load before/after: `{_load(cell['uptime_before'])}` / `{_load(cell['uptime_after'])}`"
        )
        L.append("")
        saves = cell["saves"]
        L.append(
            "| method | first save stall s | steady stall s, median (min-max) | stall / copy | "
            "time to durable s | durable MB/s | compute s | samples (disturbed) |"
        )
        L.append("|---|---|---|---|---|---|---|---|")
        copy_med = stats([r["stall_s"] for r in saves["copy"]["reps"]]).get("median")
        for name, v in saves.items():
            reps = v["reps"]
            stall = stats([r["stall_s"] for r in reps if "stall_s" in r])
            dur = stats([r["durable_s"] for r in reps if "durable_s" in r])
            mbs = stats([r["bytes"] / r["durable_s"] / 1e6 for r in reps if "durable_s" in r])
            comp = stats([r["compute_s"] for r in reps if "compute_s" in r])
            first = v["first"].get("stall_s") if v.get("first") else None
            ratio = f"{stall['median'] / copy_med:.2f}x" if stall and copy_med else ""
            label = f"{name} (matmuls only)" if name.startswith("compute") else name
            L.append(
                f"| {label} | {'' if first is None else f'{first:.3f}'} | "
                f"{fmt_s(stall) if stall else ''} | "
                f"{ratio} | {fmt_s(dur) if dur else ''} | {fmt_s(mbs, digits=0) if mbs else ''} | "
                f"{fmt_s(comp) if comp else ''} | {_nd(reps)} |"
            )
        for name in ("coci_block", "coci_nb"):
            reps = saves.get(name, {}).get("reps", [])
            if reps:
                L.append("")
                extra = ""
                if name == "coci_nb":
                    extra = (
                        f", save() call {fmt_s(stats([r['save_call_s'] for r in reps]))}, "
                        f"before_update {fmt_s(stats([r['before_update_s'] for r in reps]))}"
                    )
                L.append(
                    f"{name}: engine copy_s {fmt_s(stats([r['copy_s'] for r in reps]))}, "
                    "persist_s (crc+write+fsync+commit) "
                    f"{fmt_s(stats([r['persist_s'] for r in reps]))}, "
                    f"wait() returned after {fmt_s(stats([r['waited_s'] for r in reps]))}, "
                    f"engine stall_s {fmt_s(stats([r['engine_stall_s'] for r in reps]))}" + extra
                )
        raw = saves.get("raw_direct", {}).get("reps", [])
        if raw and "unlink_s" in raw[0]:
            L.append("")
            L.append(f"unlink of the raw file: {fmt_s(stats([r['unlink_s'] for r in raw]))} s")
        L.append("")
        rs = cell.get("restores", {})
        if rs:
            L.append(
                "| restore | cold s | cold MB/s | warm (page cache) s | warm MB/s | samples "
                "(disturbed) |"
            )
            L.append("|---|---|---|---|---|---|")
            for name, v in rs.items():
                c, w = v["cold"], v["warm"]
                L.append(
                    f"| {name} | {fmt_s(stats([r['seconds'] for r in c]))} | "
                    f"{fmt_s(stats([r['bytes'] / r['seconds'] / 1e6 for r in c]), digits=0)} | "
                    f"{fmt_s(stats([r['seconds'] for r in w]))} | "
                    f"{fmt_s(stats([r['bytes'] / r['seconds'] / 1e6 for r in w]), digits=0)} | "
                    f"{_nd(c + w)} |"
                )
            L.append("")
    tr = res.get("training")
    if tr:
        md = tr["model"]
        L.append(
            f"### Training loop: MLP {md['layers']}xLinear({md['width']}), "
            f"{md['params'] / 1e6:.1f} M params, "
            f"Adam, batch {md['batch']}, state {human(tr.get('state_bytes', 0))}; {tr['rounds']} "
            "rounds x "
            f"{tr['steps_per_block']} steps per method, saves after steps {tr['save_at']} of each "
            "block; "
            f"load before/after `{_load(tr['uptime_before'])}` / `{_load(tr['uptime_after'])}`"
        )
        L.append("")
        L.append(
            "| method | mean step s | median step s | mean save-step s | overhead (mean) | "
            "overhead per round, median (min-max) | save call s, median | first save step s | "
            "rounds (disturbed) |"
        )
        L.append("|---|---|---|---|---|---|---|---|---|")
        base = tr["methods"]["none"]["rounds"]
        base_mean = statistics.fmean(t for r in base for t in r["step_s"])
        base_round = {r["round"]: statistics.fmean(r["step_s"]) for r in base}
        for name, v in tr["methods"].items():
            rounds = v["rounds"]
            steps = [t for r in rounds for t in r["step_s"]]
            ssteps = [
                t for r in rounds for t, s in zip(r["step_s"], r["save_step"], strict=True) if s
            ]
            calls = [c for r in rounds for c in r["save_call_s"]]
            prs = stats(
                [(statistics.fmean(r["step_s"]) / base_round[r["round"]] - 1) * 100 for r in rounds]
            )
            w = v["warmup"]
            first = [t for t, s in zip(w["step_s"], w["save_step"], strict=True) if s]
            L.append(
                f"| {name} | {statistics.fmean(steps):.3f} | {statistics.median(steps):.3f} | "
                f"{statistics.fmean(ssteps):.3f} | "
                f"{(statistics.fmean(steps) / base_mean - 1) * 100:+.1f}% | "
                f"{prs['median']:+.1f}% ({prs['min']:+.1f} to {prs['max']:+.1f}) | "
                f"{statistics.median(calls) if calls else 0:.3f} | {first[0] if first else 0:.3f} "
                f"| {_nd(rounds)} |"
            )
        L.append("")
    return "\n".join(L)


def machine() -> dict[str, Any]:
    cpu_model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu_model = line.split(":", 1)[1].strip()
            break
    disk = subprocess.run(
        ["df", "-hT", "/work"], capture_output=True, text=True
    ).stdout.splitlines()[-1]
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "disk": " ".join(disk.split()[:3]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sizes",
        default="100M,1G,4G",
        help="state sizes (decimal units); empty: training loop only",
    )
    ap.add_argument("--reps", type=int, default=5, help="steady-state repetitions per method")
    ap.add_argument("--big-reps", type=int, default=3, help="repetitions for states >= 2 GB")
    ap.add_argument(
        "--dir", default="/work/bench-tmp/engine", help="scratch directory on the disk under test"
    )
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results"), help="results directory"
    )
    ap.add_argument(
        "--compute-s",
        type=float,
        default=1.0,
        help="simulated compute between save(block=False) and before_update",
    )
    ap.add_argument(
        "--dcp-threads", type=int, default=1, help="FileSystemWriter thread_count for DCP"
    )
    ap.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    ap.add_argument("--no-train", action="store_true", help="skip the training loop")
    ap.add_argument("--train-width", type=int, default=4096)
    ap.add_argument("--train-layers", type=int, default=4)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=10, help="steps per method per round")
    ap.add_argument("--train-every", type=int, default=5, help="save every N steps")
    ap.add_argument("--train-rounds", type=int, default=3)
    ap.add_argument(
        "--idle-budget",
        type=float,
        default=300,
        help="total seconds the run may wait for other processes to leave the cores",
    )
    ap.add_argument(
        "--idle-threshold", type=float, default=0.15, help="cores used by others that count as idle"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 reps, small training, no safetensors save",
    )
    ap.add_argument("--report", metavar="JSON", help="print the tables of an earlier run and exit")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
    if args.quick:
        args.reps, args.big_reps, args.train_rounds = 2, 1, 1
        args.train_layers, args.train_steps, args.train_every = 2, 6, 3
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_path = out_dir / f"engine-{stamp}.json"
    Path(args.dir).mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    t_start = perf()
    res: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": machine(),
        "args": vars(args),
        "cells": [],
    }
    global IDLE
    IDLE = Idle(args.idle_budget, args.idle_threshold, log)
    IDLE.wait(60)
    compute, cinfo = compute_fn(args.compute_s)
    res["compute"] = cinfo
    log(f"machine {res['machine']}; compute {cinfo}; {uptime()}")

    def dump() -> None:
        res["seconds"] = perf() - t_start
        out_path.write_text(json.dumps(res, indent=1, default=str))

    for s in filter(None, args.sizes.split(",")):
        size = parse_size(s)
        IDLE.wait(90)
        log(f"cell {s} ({uptime()}, MemAvailable {mem_available_gib():.1f} GiB)")
        res["cells"].append(size_cell(size, args, compute, log))
        dump()
    if not args.no_train:
        IDLE.wait(90)
        log(f"training loop ({uptime()})")
        res["training"] = training_cell(args, log)
    res["idle_waited_s"] = IDLE.waited_s
    dump()
    log(f"done in {res['seconds'] / 60:.1f} min; results in {out_path}")
    print(report(res))


if __name__ == "__main__":
    main()
