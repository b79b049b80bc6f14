"""The methods the engine benchmark compares: every save method on one state (:class:`SaveCell`)
and every restore method of what they wrote (:class:`RestoreCell`)."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.files import drop_file_cache, free, fsync_path, rm
from benchmarks._lib.timing import perf
from benchmarks.engine.state import CHUNK, PAGE, BenchArena, flat_tensors
from coci_core import CheckpointManager

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
