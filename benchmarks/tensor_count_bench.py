#!/usr/bin/env python
"""Cost that grows with the number of tensors: coci against torch.save/torch.load and DCP on
states of the same bytes split into more and more tensors.

Run (full sizes; about 10-20 minutes on 2 idle cores, DCP on the 50,000-tensor state is most
of it):

    python -m benchmarks.tensor_count_bench --rounds 3

    python -m benchmarks.tensor_count_bench --quick            # small sizes, a smoke test
    python -m benchmarks.tensor_count_bench --states 64x4MiB,3000-mixed --methods copy,coci
    python -m benchmarks.tensor_count_bench --report RESULT.json   # the tables again

States (fp32, contents from a seeded generator):

* ``64x4MiB``: 64 tensors of 4 MiB (256 MiB).
* ``3000-mixed``: 3,000 tensors of log-uniformly spread sizes (64 B to ~1 MiB, median
  ~3.5 KB, three quarters of them at most 64 KiB), 256 MiB.
* ``50000x1KiB``: 50,000 tensors of 1 KiB (49 MiB).
* ``gpt-adamw``: a small GPT-style model (token and position embeddings, pre-norm blocks of
  attention and MLP, a head) built here, with ``torch.optim.AdamW`` state after one training
  step: ``{"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}``, a few thousand
  tensors (AdamW's ``step`` is a 0-d tensor per parameter).

Save methods, each run once as a warm-up (reported as ``first``), then ``--rounds`` rounds that
run every method once, in an order rotated by one each round (medians over rounds):

* ``copy``: the copy limit: one ``memcpy`` of the state's bytes (one flat source buffer into
  one preallocated buffer of the same size). ``copy_foreach`` (``torch._foreach_copy_`` of the
  tensors into views of one preallocated buffer) and ``copy_loop`` (one ``copy_`` per tensor
  into the same views) beside it: what batching the per-tensor copies can give.
* ``coci``: ``CheckpointManager.save(step, state, block=True)`` (default options: compression
  ``"auto"``, ``keep_last=3``, ``--keep-last``); stall: the time in ``save()``; durable: the
  engine's commit time (``SaveEvent.time_to_durable_s``); ``handle.wait()`` returns a little
  later (``waited_s``). The writer thread's retention after the commit (``retention_s``) is
  waited for, untimed, so that it does not compete with the next sample for the GIL.
* ``torch_save``: ``torch.save`` to one file; stall: the call; durable: the call plus fsync of
  the file and its directory.
* ``dcp_save``: ``torch.distributed.checkpoint.save`` (``FileSystemWriter(sync_files=True)``,
  ``no_dist=True``); stall = durable.
* ``dcp_async``: ``dcp.async_save`` with a ``DefaultStager`` that reuses its host buffers across
  saves (no pinned or shared memory: CPU tensors); stall: until ``async_save`` returns (it
  copies the state into the stager's buffers); durable: until its future's ``result()``.

Every save is made durable and its files are dropped from the page cache before the next method
runs. Restores read the last save of each method, each round cold then warm:

* cold: the files' pages are dropped first with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after an
  fsync (dropping the whole page cache needs root); warm: every page of the files in the page
  cache (read through once first, untimed), as a checkpoint just written or read is.
* ``coci_restore``: ``CheckpointManager.restore()`` by a new manager, as a resume calls it (the
  newest checkpoint, of the ``keep_last`` in the directory; every checksum verified);
  ``torch_load``: ``torch.load(weights_only=True)``; ``torch_load_mmap``: the same with
  ``mmap=True``, every tensor then copied into process memory (``clone``: a mapped load reads
  nothing until used, and a resume uses every tensor); ``dcp_load``: ``dcp.load`` into a state of
  the same structure allocated (``empty_like``) inside the timed region, as the other two
  allocate theirs. Each method's result is compared with the saved state once (untimed).

Printed per state: medians, ratios in the same run (coci stall / copy limit, stall of each state
/ stall of ``64x4MiB`` when it ran, restore / torch.load) and the per-tensor cost of the stall,
``(coci stall - copy limit) / tensors`` in µs: what the save spends per tensor beyond moving the
bytes. The JSON result (every sample, the machine, load averages) goes to ``--out`` (default: a
``coci-bench-results`` directory in the system's temporary directory); checkpoints go to a
temporary directory under ``--dir`` (default: the system's temporary directory), removed after.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import (
    dir_bytes,
    drop_file_cache,
    free,
    fsync_path,
    load_file_cache,
    rm,
)
from benchmarks._lib.machine import Idle, machine, mem_available_gib, thread_cpu, uptime
from benchmarks._lib.results import log, run_recorded
from benchmarks._lib.timing import human, med, parse_choices, perf
from benchmarks.engine import measure
from benchmarks.engine.measure import fmt_sample, run_rotation, sample
from coci_core import CheckpointManager

MiB = 1 << 20
STATES = ("64x4MiB", "3000-mixed", "50000x1KiB", "gpt-adamw")
SAVE_METHODS = ("copy", "copy_foreach", "copy_loop", "coci", "torch_save", "dcp_save", "dcp_async")
RESTORE_METHODS = ("coci_restore", "torch_load", "torch_load_mmap", "dcp_load")
# --quick: the same shapes of state, about 1/32 of the bytes and 1/10 of the tensors
QUICK = {"64x4MiB": (64, 128 * 1024), "3000-mixed": (300, 8 * MiB), "50000x1KiB": (5000, 1024)}
FULL = {"64x4MiB": (64, 4 * MiB), "3000-mixed": (3000, 256 * MiB), "50000x1KiB": (50000, 1024)}


# -- states ---------------------------------------------------------------------------------


def _filled(numel: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(numel, generator=gen)


def uniform_state(n: int, nbytes: int, seed: int = 0) -> dict[str, Any]:
    """``n`` fp32 tensors of ``nbytes`` each, under ``t00000``... keys."""
    gen = torch.Generator().manual_seed(seed)
    numel = nbytes // 4
    return {f"t{i:05d}": _filled(numel, gen) for i in range(n)}


def mixed_state(n: int, total: int, seed: int = 0) -> dict[str, Any]:
    """``n`` fp32 tensors whose sizes are spread log-uniformly (16 elements to ~1/n^0.5 of the
    total) and scaled to ``total`` bytes (multiples of 16 elements, at least 16), in shapes of
    one or two dimensions, under names of layers and parameters (``layers.0012.w3``)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    lo, hi = math.log(16), math.log(max(64.0, total / 4 / math.sqrt(n)))
    raw = torch.exp(lo + u * (hi - lo))
    scaled = raw * (total / 4 / float(raw.sum()))
    sizes = [max(16, int(x) // 16 * 16) for x in scaled.tolist()]
    sizes[0] += max(0, total // 4 - sum(sizes)) // 16 * 16  # the rounding's remainder
    out: dict[str, Any] = {}
    for i, numel in enumerate(sizes):
        t = _filled(numel, gen)
        if numel % 256 == 0 and numel >= 4096:
            t = t.view(numel // 256, 256)
        out[f"layers.{i // 8:04d}.w{i % 8}"] = t
    return out


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return out


class TinyGPT(torch.nn.Module):
    """A GPT-style decoder: 12 parameter tensors per block, 6 more around the blocks."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def gpt_state(quick: bool, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TinyGPT's state dict and AdamW's after one step on random tokens."""
    vocab, d, layers, heads, seq = (2048, 64, 8, 4, 32) if quick else (8192, 128, 64, 4, 128)
    torch.manual_seed(seed)
    model = TinyGPT(vocab, d, layers, heads, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    idx = torch.randint(0, vocab, (2, seq))
    logits = model(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    params = sum(p.numel() for p in model.parameters())
    return state, {"vocab": vocab, "d_model": d, "layers": layers, "seq": seq, "params": params}


def leaves(x: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a nested state, under dotted paths (dict keys, list indices)."""
    if isinstance(x, torch.Tensor):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from leaves(v, f"{prefix}.{i}" if prefix else str(i))


def empty_like_tree(x: Any) -> Any:
    """The same structure with every tensor replaced by ``torch.empty_like`` (DCP's target)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x)
    if isinstance(x, dict):
        return type(x)((k, empty_like_tree(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(empty_like_tree(v) for v in x)
    return x


def build_state(name: str, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    info: dict[str, Any] = {"name": name}
    if name == "gpt-adamw":
        state, extra = gpt_state(quick)
        info.update(extra)
    else:
        n, size = (QUICK if quick else FULL)[name]
        state = mixed_state(n, size) if name == "3000-mixed" else uniform_state(n, size)
    ts = [t for _, t in leaves(state)]
    nb = [t.numel() * t.element_size() for t in ts]
    info.update(
        tensors=len(ts),
        bytes=sum(nb),
        min_tensor_bytes=min(nb),
        median_tensor_bytes=med([float(b) for b in nb]),
        max_tensor_bytes=max(nb),
        under_64KiB=sum(b <= 65536 for b in nb),
    )
    return state, info


# -- save methods ---------------------------------------------------------------------------


def _wait_writer_idle(directory: Path, keep_last: int, timeout_s: float = 300.0) -> None:
    """Until at most ``keep_last`` steps are left in ``directory`` and coci's writer thread
    (``coci-persist``) has used no CPU for three polls in a row (its retention is done)."""
    deadline = perf() + timeout_s
    last, quiet = -1.0, 0
    while quiet < 3 and perf() < deadline:
        time.sleep(0.02)
        steps = sum(p.name.startswith("step-") for p in directory.iterdir())
        cpu = thread_cpu().get("coci-persist", 0.0)
        quiet = quiet + 1 if cpu == last and steps <= keep_last else 0
        last = cpu


class Saves:
    """Every save method on one state; ``run(name)`` does one save and returns its metrics."""

    def __init__(self, state: dict[str, Any], root: Path, keep_last: int = 3) -> None:
        self.state, self.root, self.keep_last = state, root, keep_last
        self.tensors = [t for _, t in leaves(state)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.mgr: CheckpointManager | None = None
        self.stager: Any = None
        self.counter = 0
        self.coci_step: int | None = None
        self._views: list[torch.Tensor] | None = None
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        self._views = self._flat = None
        free()

    def run(self, method: str) -> dict[str, Any]:
        out: dict[str, Any] = getattr(self, f"run_{method}")()
        return out

    # the copy limits: buffers allocated and faulted in once, outside the timed region
    def _dst_views(self) -> list[torch.Tensor]:
        if self._views is None:
            buf = torch.zeros(self.nbytes, dtype=torch.uint8)
            views, off = [], 0
            for t in self.tensors:
                n = t.numel() * t.element_size()
                views.append(buf[off : off + n].view(t.dtype).view(t.shape))
                off += n
            self._views = views
        return self._views

    def run_copy(self) -> dict[str, Any]:
        if self._flat is None:
            src = torch.empty(self.nbytes, dtype=torch.uint8)
            off = 0
            for t in self.tensors:  # the same bytes, in one flat buffer
                n = t.numel() * t.element_size()
                src[off : off + n].view(t.dtype).copy_(t.reshape(-1))
                off += n
            self._flat = (src, torch.zeros_like(src))
        src, dst = self._flat
        t0 = perf()
        dst.copy_(src)
        return {"stall_s": perf() - t0, "bytes": self.nbytes}

    def run_copy_foreach(self) -> dict[str, Any]:
        views = self._dst_views()
        t0 = perf()
        torch._foreach_copy_(views, self.tensors)
        return {"stall_s": perf() - t0, "bytes": self.nbytes}

    def run_copy_loop(self) -> dict[str, Any]:
        views = self._dst_views()
        t0 = perf()
        for dst, src in zip(views, self.tensors, strict=True):
            dst.copy_(src)
        return {"stall_s": perf() - t0, "bytes": self.nbytes}

    def _step(self) -> int:
        self.counter += 1
        return self.counter

    def run_coci(self) -> dict[str, Any]:
        if self.mgr is None:
            self.mgr = CheckpointManager(self.root / "coci", keep_last=self.keep_last)
        step = self._step()
        t0 = perf()
        h = self.mgr.save(step, self.state, block=True)
        t1 = perf()
        ev = h.wait()
        t2 = perf()
        self.coci_step = step
        # after the commit the writer thread applies keep_last (reads the manifests, deletes the
        # oldest step): wait for it (untimed) so that it does not run into the next sample
        _wait_writer_idle(self.root / "coci", self.keep_last)
        t3 = perf()
        drop_file_cache(self.root / "coci" / f"step-{step:010d}")
        return {
            "stall_s": t1 - t0,
            "durable_s": ev.time_to_durable_s,
            "waited_s": t2 - t0,
            "engine_stall_s": ev.stall_s,
            "copy_s": ev.copy_s,
            "persist_s": ev.persist_s,
            "bytes": ev.bytes_written,
            "first_save": ev.first_save,
            "retention_s": t3 - t2,
        }

    def run_torch_save(self) -> dict[str, Any]:
        path = self.root / "state.pt"
        rm(path)
        t0 = perf()
        torch.save(self.state, path)
        t1 = perf()
        fsync_path(path)
        fsync_path(path.parent)
        t2 = perf()
        drop_file_cache(path)
        return {"stall_s": t1 - t0, "durable_s": t2 - t0, "bytes": path.stat().st_size}

    def _dcp_dir(self, kind: str) -> Path:
        path = self.root / f"dcp-{kind}"
        rm(path)
        return path

    def run_dcp_save(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        path = self._dcp_dir("save")
        writer = FileSystemWriter(path, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = perf()
            save(self.state, storage_writer=writer, no_dist=True)
            t1 = perf()
        fsync_path(path)
        drop_file_cache(path)
        return {"stall_s": t1 - t0, "durable_s": t1 - t0, "bytes": dir_bytes(path)}

    def run_dcp_async(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import async_save

        if self.stager is None:
            # CPU tensors: pinned memory and non-blocking copies need an accelerator, shared
            # memory only helps a separate upload process; the stager reuses its buffers.
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        path = self._dcp_dir("async")
        writer = FileSystemWriter(path, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = perf()
            fut = async_save(
                self.state, storage_writer=writer, async_stager=self.stager, no_dist=True
            )
            t1 = perf()
            assert isinstance(fut, Future)  # use_async_staging=False: one future
            fut.result()
            t2 = perf()
        fsync_path(path)
        drop_file_cache(path)
        return {"stall_s": t1 - t0, "durable_s": t2 - t0, "bytes": dir_bytes(path)}


# -- restore methods ------------------------------------------------------------------------


class Restores:
    """Reads back what :class:`Saves` wrote last; ``run(name, cold)`` returns its metrics."""

    def __init__(self, state: dict[str, Any], root: Path, coci_step: int | None) -> None:
        self.state, self.root, self.step = state, root, coci_step
        self.mgr = CheckpointManager(root / "coci", keep_last=None)
        self.paths = {
            "coci_restore": root / "coci",
            "torch_load": root / "state.pt",
            "torch_load_mmap": root / "state.pt",
            "dcp_load": root / "dcp-save",
        }

    def available(self, methods: list[str]) -> list[str]:
        return [
            m
            for m in methods
            if self.paths[m].exists() and (m != "coci_restore" or self.step is not None)
        ]

    def close(self) -> None:
        self.mgr.close()

    def check(self, method: str) -> None:
        """Restore once in this process, untimed: the same tensors back."""
        out = _restore(method, self.paths[method], self.mgr, self.state)
        if method == "coci_restore" and (
            self.mgr.last_restore is None or self.mgr.last_restore.step != self.step
        ):
            raise AssertionError(f"restored {self.mgr.last_restore}, not step {self.step}")
        got = dict(leaves(out))
        bad = [k for k, v in leaves(self.state) if k not in got or not torch.equal(got[k], v)]
        if bad:
            raise AssertionError(f"{method}: {len(bad)} tensors differ, e.g. {bad[:3]}")

    def run(self, method: str, cold: bool) -> dict[str, Any]:
        """One timed restore in a new process, as a resume's is (its memory fresh, faulted in
        by the restore), after the files' pages were dropped (cold) or all loaded (warm)."""
        path = self.paths[method]
        if cold:
            drop_file_cache(path)
        else:
            load_file_cache(path)
        spec = {
            "method": method,
            "path": str(path),
            "step": self.step,
            "threads": torch.get_num_threads(),
        }
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.tensor_count_bench",
                "--restore-sample",
                *[json.dumps(spec)],
            ],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if proc.returncode:
            raise RuntimeError(f"{method} restore failed: {proc.stderr[-2000:]}")
        seconds = json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]
        size = path.stat().st_size if path.is_file() else dir_bytes(path)
        return {"seconds": seconds, "bytes": size}


def _restore(method: str, path: Path, mgr: CheckpointManager | None, like: Any) -> Any:
    if method == "coci_restore":
        assert mgr is not None
        return mgr.restore()
    if method == "torch_load":
        return torch.load(path, weights_only=True)
    if method == "torch_load_mmap":
        return _into_memory(torch.load(path, weights_only=True, mmap=True))
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    out = empty_like_tree(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(out, storage_reader=FileSystemReader(path), no_dist=True)
    return out


def _into_memory(x: Any) -> Any:
    """``x`` with every tensor copied out of its file mapping into process memory (what the
    other methods' restores return: a mapped load has read nothing yet)."""
    if isinstance(x, dict):
        return {k: _into_memory(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_into_memory(v) for v in x)
    return x.clone() if isinstance(x, torch.Tensor) else x


def _dcp_like(path: Path) -> dict[str, Any]:
    """Empty tensors of the shapes and dtypes a DCP checkpoint holds, by flattened key."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    return {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }


def restore_sample(spec: dict[str, Any]) -> dict[str, float]:
    """The child of :meth:`Restores.run`: one restore, timed (the modules any method imports
    on its first call imported before)."""
    import torch.distributed.checkpoint.filesystem
    import torch.distributed.checkpoint.state_dict_loader

    import coci_core.engine.restore.load  # noqa: F401

    path = Path(spec["path"])
    torch.set_num_threads(spec["threads"])
    mgr = CheckpointManager(path, keep_last=None) if spec["method"] == "coci_restore" else None
    like = _dcp_like(path) if spec["method"] == "dcp_load" else None
    t0 = perf()
    _restore(spec["method"], path, mgr, like)
    seconds = perf() - t0
    if mgr is not None:
        if mgr.last_restore is None or mgr.last_restore.step != spec["step"]:
            raise AssertionError(f"restored {mgr.last_restore}, not step {spec['step']}")
        mgr.close()
    return {"seconds": seconds}


# -- one state ------------------------------------------------------------------------------


def state_cell(
    name: str, args: argparse.Namespace, scratch: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    root = scratch / name
    root.mkdir(parents=True)
    t0 = perf()
    state, info = build_state(name, args.quick)
    cell: dict[str, Any] = {
        "state": info,
        "build_s": perf() - t0,
        "uptime_before": uptime(),
        "mem_available_gib_before": mem_available_gib(),
    }
    log(
        f"state {name}: {info['tensors']} tensors, {human(info['bytes'])} "
        f"(median tensor {human(info['median_tensor_bytes'])}; built in {cell['build_s']:.1f} s)"
    )
    saves = Saves(state, root, args.keep_last)
    try:
        methods = [m for m in args.methods if m in SAVE_METHODS]
        cell["saves"] = run_rotation(methods, args.rounds, saves.run, log)
        coci_step = saves.coci_step
    finally:
        saves.close()
    restores_wanted = [m for m in args.methods if m in RESTORE_METHODS]
    rc = Restores(state, root, coci_step)
    try:
        rmethods = rc.available(restores_wanted)
        for m in rmethods:
            rc.check(m)
        free()
        res: dict[str, Any] = {m: {"cold": [], "warm": []} for m in rmethods}
        if rmethods:
            log(f"  restore: {rmethods}, {args.rounds} rounds, each cold then warm")
        for rnd in range(args.rounds):
            k = rnd % len(rmethods) if rmethods else 0
            for m in rmethods[k:] + rmethods[:k]:
                for kind in ("cold", "warm"):
                    r = sample(functools.partial(rc.run, m, kind == "cold"), free)
                    r["round"] = rnd
                    res[m][kind].append(r)
                    free()
                    log(f"    round {rnd} {m:<14} {kind} {fmt_sample(r)}")
        cell["restores"] = res
    finally:
        rc.close()
    del state
    free()
    rm(root)
    cell["uptime_after"] = uptime()
    cell["seconds"] = perf() - t0
    return cell


# -- report ---------------------------------------------------------------------------------


def _med(cell: dict[str, Any], method: str, key: str) -> float:
    reps = cell.get("saves", {}).get(method, {}).get("reps", [])
    return med([r[key] for r in reps if key in r])


def _rmed(cell: dict[str, Any], method: str, kind: str) -> float:
    rs = cell.get("restores", {}).get(method, {}).get(kind, [])
    return med([r["seconds"] for r in rs])


def _f(x: float, digits: int = 3) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def _x(r: float) -> str:
    return "-" if r != r else f"{r:.2f}x"


def summary(cell: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The ratios and per-tensor costs of one state (medians), ``base``: the 64x4MiB cell."""
    n = cell["state"]["tensors"]
    copy = _med(cell, "copy", "stall_s")
    stall = _med(cell, "coci", "stall_s")
    out: dict[str, Any] = {
        "coci_stall_over_copy": stall / copy if copy else math.nan,
        "us_per_tensor_stall": (stall - copy) / n * 1e6,
        "us_per_tensor_foreach": (_med(cell, "copy_foreach", "stall_s") - copy) / n * 1e6,
        "us_per_tensor_copy_loop": (_med(cell, "copy_loop", "stall_s") - copy) / n * 1e6,
        "coci_stall_over_dcp_async_stall": stall / _med(cell, "dcp_async", "stall_s"),
    }
    if base is not None and base is not cell:
        out["coci_stall_over_64x4MiB_stall"] = stall / _med(base, "coci", "stall_s")
    for kind in ("warm", "cold"):
        tl = _rmed(cell, "torch_load", kind)
        out[f"coci_restore_over_torch_load_{kind}"] = _rmed(cell, "coci_restore", kind) / tl
        peers = [_rmed(cell, m, kind) for m in RESTORE_METHODS if m != "coci_restore"]
        best = min((p for p in peers if p == p), default=math.nan)
        out[f"coci_restore_over_best_peer_{kind}"] = _rmed(cell, "coci_restore", kind) / best
        out[f"us_per_tensor_restore_{kind}"] = _rmed(cell, "coci_restore", kind) / n * 1e6
    return out


def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    L = [
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']:.1f} GiB RAM, torch "
        f"{m['torch']}, python {m['python']}, disk {m['disk']}",
        f"Command: `{res.get('command', '?')}`; {res['rounds']} rounds; load before: "
        f"`{res.get('uptime_before', '?').split('load average: ')[-1]}`",
        "",
        "Seconds, medians over rounds (stall: the training thread; durable: until on disk).",
        "",
        "| state | tensors | bytes | copy limit | copy foreach | coci stall | coci durable | "
        "torch.save | DCP save | DCP async stall | DCP async durable |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = res["cells"]
    for c in cells:
        st = c["state"]
        L.append(
            f"| {st['name']} | {st['tensors']:,} | {human(st['bytes'])} | "
            f"{_f(_med(c, 'copy', 'stall_s'), 4)} | {_f(_med(c, 'copy_foreach', 'stall_s'), 4)} | "
            f"{_f(_med(c, 'coci', 'stall_s'))} | {_f(_med(c, 'coci', 'durable_s'))} | "
            f"{_f(_med(c, 'torch_save', 'durable_s'))} | {_f(_med(c, 'dcp_save', 'durable_s'))} | "
            f"{_f(_med(c, 'dcp_async', 'stall_s'))} | {_f(_med(c, 'dcp_async', 'durable_s'))} |"
        )
    L += [
        "",
        "| state | coci restore warm | cold | torch.load warm | cold | torch.load mmap warm | "
        "cold | DCP load warm | cold |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        L.append(
            f"| {c['state']['name']} | "
            + " | ".join(
                _f(_rmed(c, mth, kind)) for mth in RESTORE_METHODS for kind in ("warm", "cold")
            )
            + " |"
        )
    base = next((c for c in cells if c["state"]["name"] == "64x4MiB"), None)
    L += [
        "",
        "Ratios in this run, and the per-tensor cost of coci's stall: (coci stall - copy limit) / "
        "tensors; the same for copy_foreach and copy_loop (what batching the copies can give).",
        "",
        "| state | stall / copy | stall / 64x4MiB's | stall / DCP async's | µs/tensor stall | "
        "µs/tensor foreach | µs/tensor copy loop | restore / torch.load warm | cold | "
        "restore / best peer warm | cold | µs/tensor restore warm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        s = summary(c, base)
        L.append(
            f"| {c['state']['name']} | {_x(s['coci_stall_over_copy'])} | "
            f"{_x(s.get('coci_stall_over_64x4MiB_stall', math.nan))} | "
            f"{_x(s['coci_stall_over_dcp_async_stall'])} | "
            f"{_f(s['us_per_tensor_stall'], 1)} | {_f(s['us_per_tensor_foreach'], 1)} | "
            f"{_f(s['us_per_tensor_copy_loop'], 1)} | "
            f"{_x(s['coci_restore_over_torch_load_warm'])} | "
            f"{_x(s['coci_restore_over_torch_load_cold'])} | "
            f"{_x(s['coci_restore_over_best_peer_warm'])} | "
            f"{_x(s['coci_restore_over_best_peer_cold'])} | "
            f"{_f(s['us_per_tensor_restore_warm'], 1)} |"
        )
    firsts = [
        f"{c['state']['name']} {c['saves']['coci']['first']['stall_s']:.3f} s"
        for c in cells
        if c.get("saves", {}).get("coci", {}).get("first")
    ]
    if firsts:
        L += ["", "coci's first (allocating) save stall, not in the medians: " + ", ".join(firsts)]
    return "\n".join(L)


# -- command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--states", default=",".join(STATES), help=f"comma list of {STATES}")
    ap.add_argument(
        "--methods",
        default=",".join(SAVE_METHODS + RESTORE_METHODS),
        help=f"comma list of {SAVE_METHODS + RESTORE_METHODS}",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds; medians over them")
    ap.add_argument("--keep-last", type=int, default=3, help="coci's keep_last (its default: 3)")
    ap.add_argument("--quick", action="store_true", help="small states (a smoke test)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: torch's own); on a machine shared with other "
        "processes, 1 keeps intra-op parallel regions from waiting for a busy core",
    )
    ap.add_argument(
        "--dir", default=None, help="scratch directory on the disk under test (default: temp)"
    )
    ap.add_argument(
        "--out",
        default=str(Path(tempfile.gettempdir()) / "coci-bench-results"),
        help="results directory (default: %(default)s)",
    )
    ap.add_argument(
        "--idle-budget",
        type=float,
        default=300,
        help="total seconds the run may wait for other processes to leave the cores "
        "(disturbed samples are retried within it; 0: never wait)",
    )
    ap.add_argument(
        "--idle-threshold", type=float, default=0.15, help="cores used by others that count as idle"
    )
    ap.add_argument("--report", metavar="JSON", help="print the tables of an earlier run and exit")
    ap.add_argument("--restore-sample", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.restore_sample:
        print(json.dumps(restore_sample(json.loads(args.restore_sample))))
        return {}
    if args.report:
        res: dict[str, Any] = json.loads(Path(args.report).read_text())
        print(report(res))
        return res
    args.states = parse_choices(args.states, STATES, "states")
    args.methods = parse_choices(args.methods, SAVE_METHODS + RESTORE_METHODS, "methods")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    measure.IDLE = Idle(args.idle_budget, args.idle_threshold, log) if args.idle_budget else None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)

    def run(scratch: Path) -> dict[str, Any]:
        out: dict[str, Any] = {
            "machine": machine(disk_of=str(scratch)),
            "rounds": args.rounds,
            "quick": args.quick,
            "args": {k: v for k, v in vars(args).items() if k not in ("dir", "out")},
            "cells": [],
        }
        log(f"machine: {out['machine']}; {uptime()}")
        t0 = perf()
        for name in args.states:
            if measure.IDLE is not None:
                measure.IDLE.wait(60)
            out["cells"].append(state_cell(name, args, scratch, log))
        base = next((c for c in out["cells"] if c["state"]["name"] == "64x4MiB"), None)
        for c in out["cells"]:
            c["summary"] = summary(c, base)
        out["seconds"] = perf() - t0
        out["idle_waited_s"] = measure.IDLE.waited_s if measure.IDLE is not None else 0.0
        return out

    res, path = run_recorded("tensor-count", run, scratch_dir=args.dir, out_dir=args.out)
    print(report(res))
    log(f"results in {path}")
    return res


if __name__ == "__main__":
    main()
