"""restore(into=...) reads straight into the model's and the optimizer's own tensors."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import mmap
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from benchmarks._lib.files import drop_file_cache

from coci_core import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    LocalStorage,
    StorageError,
)
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.restore import read as restore_module


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(96, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10), torch.nn.LayerNorm(10)
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(8, 96, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _pair(seed: int) -> tuple[torch.nn.Module, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = _model()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every live tensor: parameters, buffers, the optimizer's state (its steps included)."""
    return [
        *model.state_dict().values(),
        *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)),
    ]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _assert_bit_exact(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_bit_exact(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bit_exact(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_in_place_restore_is_bit_exact_into_the_same_tensors(
    tmp_path: Path, compression: str
) -> None:
    """A model and an Adam optimizer that trained on after the save get back the saved values,
    bit for bit, in the very tensors they hold (parameters, buffers, moments, step counts), and
    a step from there matches a step from the saved state. Lossless: step 2 is stored as a
    delta against step 1, so both decoding kinds are read into the live tensors."""
    model, opt = _pair(0)
    _train(model, opt, 3, seed=1)
    with CheckpointManager(tmp_path, compression=compression) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
        _train(model, opt, 2, seed=2)
        mgr.save(2, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
        saved_model = copy.deepcopy(model)
        saved_opt = torch.optim.Adam(saved_model.parameters(), lr=1e-2)
        saved_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        pieces = [p for e in mgr.manifest(2).tensors for p in e.pieces]
    if compression == "lossless":
        assert any(p.params and p.params.get("base") for p in pieces)  # deltas were written
    else:
        assert all(p.params is None for p in pieces)
    _train(model, opt, 2, seed=3)  # the live state moves on
    before = [t.data_ptr() for t in _tensors(model, opt)]
    with CheckpointManager(tmp_path) as mgr:
        state = mgr.restore(into={"model": model, "optim": opt})
        assert mgr.last_restore is not None and mgr.last_restore.step == 2
    assert [t.data_ptr() for t in _tensors(model, opt)] == before
    _assert_bit_exact(model.state_dict(), saved_model.state_dict())
    _assert_bit_exact(opt.state_dict(), saved_opt.state_dict())
    assert state["model"]["0.weight"].data_ptr() == model[0].weight.data_ptr()
    _train(model, opt, 1, seed=4)
    _train(saved_model, saved_opt, 1, seed=4)
    _assert_bit_exact(model.state_dict(), saved_model.state_dict())


def test_a_fresh_optimizer_adopts_the_restored_state(tmp_path: Path) -> None:
    """A new run's optimizer has no state yet: its moments are restored into new tensors,
    which it adopts as they are; the model's parameters are filled in place."""
    model, opt = _pair(0)
    _train(model, opt, 3, seed=1)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
    fresh, fresh_opt = _pair(5)
    params = [p.data_ptr() for p in fresh.parameters()]
    with CheckpointManager(tmp_path) as mgr:
        state = mgr.restore(into={"model": fresh, "optim": fresh_opt})
    assert [p.data_ptr() for p in fresh.parameters()] == params
    _assert_bit_exact(fresh.state_dict(), model.state_dict())
    _assert_bit_exact(fresh_opt.state_dict(), opt.state_dict())
    moments = state["optim"]["state"][0]
    assert fresh_opt.state[fresh[0].weight]["exp_avg"] is moments["exp_avg"]  # adopted, not copied


def test_tensors_that_do_not_fit_are_copied_by_load_state_dict(tmp_path: Path) -> None:
    """A model in another dtype gets the stored values converted (not read in place, which
    would reinterpret the bytes), still into its own tensors."""
    model, _ = _pair(0)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model.state_dict()}).wait()
    wide = _model().double()
    params = [p.data_ptr() for p in wide.parameters()]
    with CheckpointManager(tmp_path) as mgr:
        state = mgr.restore(into={"model": wide})
    assert [p.data_ptr() for p in wide.parameters()] == params
    assert state["model"]["0.weight"].dtype == torch.float32  # its own tensor, not the live one
    for k, v in model.state_dict().items():
        assert torch.equal(wide.state_dict()[k], v.double())


class _Tied(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(64))
        self.b = self.a if tied else torch.nn.Parameter(torch.zeros(64))


def test_tensors_sharing_memory_are_not_filled_in_place(tmp_path: Path) -> None:
    """A model whose two parameters are one tensor, restored from a checkpoint where they
    differed: filling both in place would leave the first key's value silently wrong in the
    returned state; it holds both stored values."""
    untied = _Tied(tied=False)
    with torch.no_grad():
        untied.a.fill_(1.0)
        untied.b.fill_(2.0)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"m": untied.state_dict()}).wait()
    tied = _Tied(tied=True)
    with CheckpointManager(tmp_path) as mgr:
        state = mgr.restore(into={"m": tied})
    assert torch.equal(state["m"]["a"], torch.full((64,), 1.0))
    assert torch.equal(state["m"]["b"], torch.full((64,), 2.0))
    assert torch.equal(tied.a, torch.full((64,), 2.0))  # load_state_dict copied a, then b


def _data_file(root: Path, step: int) -> Path:
    return root / step_dir_name(step) / "data-r0.bin"


def _read_ahead(monkeypatch: pytest.MonkeyPatch, min_bytes: int) -> None:
    """Arrays from ``min_bytes`` on read by two threads ahead of the restore, on any machine."""
    monkeypatch.setattr(restore_module, "READ_AHEAD_MIN_BYTES", min_bytes)
    monkeypatch.setattr(restore_module, "READ_AHEAD_THREADS", 2)
    monkeypatch.setattr(restore_module, "usable_cores", lambda: 2)


@pytest.mark.parametrize(
    ("chunk", "overlap", "ahead"),
    [(None, False, False), (4096, False, False), (4096, True, False), (4096, True, True)],
)
def test_a_damaged_step_is_never_restored_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None, overlap: bool, ahead: bool
) -> None:
    """A flipped byte in the newest step's biggest array (read into the live tensors: whole,
    or in chunks checksummed after each read or on the helper thread, or by the threads that
    read arrays ahead): the restore falls back to the previous step and every tensor holds its
    values bit for bit; with ``strict`` it raises."""
    if chunk is not None:
        monkeypatch.setattr(restore_module, "READ_CHUNK_BYTES", chunk)
        monkeypatch.setattr(restore_module, "CHUNKED_MIN_BYTES", 1)
        monkeypatch.setattr(restore_module, "OVERLAP_CHECKSUMS", overlap)
    if ahead:
        _read_ahead(monkeypatch, 1)
    model, opt = _pair(0)
    _train(model, opt, 2, seed=1)
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
        good_model = copy.deepcopy(model.state_dict())
        good_opt = copy.deepcopy(opt.state_dict())
        _train(model, opt, 2, seed=2)
        mgr.save(2, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
        biggest = max(mgr.manifest(2).tensors, key=lambda e: e.raw_nbytes)
    piece = biggest.pieces[0]
    assert piece.length > 4 * 4096  # read in several chunks when chunk is set
    _flip_byte(_data_file(tmp_path, 2), piece.offset + piece.length - 3)
    _train(model, opt, 1, seed=3)
    with CheckpointManager(tmp_path, strict=True) as mgr, pytest.raises(CorruptCheckpointError):
        mgr.restore(into={"model": model, "optim": opt})
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(into={"model": model, "optim": opt})
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.skipped_steps) == (1, (2,))
    _assert_bit_exact(model.state_dict(), good_model)
    _assert_bit_exact(opt.state_dict(), good_opt)


class _Recording(LocalStorage):
    """Local storage that records which thread read each chunk."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.readers: list[str] = []

    def read_chunks(
        self, path: str, offset: int, out: memoryview, chunk_bytes: int
    ) -> Iterator[memoryview]:
        self.readers.append(threading.current_thread().name)
        yield from super().read_chunks(path, offset, out, chunk_bytes)


@pytest.mark.parametrize("into", [False, True])
def test_large_arrays_are_read_ahead_by_threads_and_handed_out_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: bool
) -> None:
    """Arrays from READ_AHEAD_MIN_BYTES on are read by the read-ahead threads, each with its
    own checksum, the small ones by the restore itself: every tensor comes back bit for bit,
    in place or new, and the files opened for the restore are closed after it."""
    _read_ahead(monkeypatch, 16 << 10)
    monkeypatch.setattr(restore_module, "CHUNKED_MIN_BYTES", 1)
    monkeypatch.setattr(restore_module, "REGION_PIECE_BYTES", 1024)
    gen = torch.Generator().manual_seed(0)
    params = {f"big{i}": torch.randn(8192 + i, generator=gen) for i in range(12)}
    params |= {f"small{i}": torch.randn(16, generator=gen) for i in range(5)}
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in params.items()})
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, {"m": model.state_dict()}).wait()
    storage = _Recording(tmp_path)
    target = torch.nn.ParameterDict(
        {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in params.items()}
    )
    with CheckpointManager(storage) as mgr:
        got = mgr.restore(into={"m": target}) if into else mgr.restore()
    _assert_bit_exact(got["m"], model.state_dict())
    if into:
        _assert_bit_exact(target.state_dict(), model.state_dict())
    ahead = [name for name in storage.readers if name.startswith("coci-restore-read")]
    assert len(ahead) == 12, storage.readers
    assert storage._read_fds == {} and storage._read_sessions == 0  # the session ended


class _Counting(LocalStorage):
    """Local storage that counts the chunked reads in flight and finished (a slow disk)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.finished = 0

    def read_chunks(
        self, path: str, offset: int, out: memoryview, chunk_bytes: int
    ) -> Iterator[memoryview]:
        with self.lock:
            self.in_flight += 1
        try:
            time.sleep(0.02)  # the disk's pace, not a synchronisation
            yield from super().read_chunks(path, offset, out, chunk_bytes)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.finished += 1


def test_a_restore_left_early_leaves_no_read_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arrays read ahead by threads write into the caller's tensors: once the caller
    closes the restore's generator (as the load does on any error), no read is still going
    on and none starts later; the arrays not started are never read."""
    _read_ahead(monkeypatch, 16 << 10)
    monkeypatch.setattr(restore_module, "CHUNKED_MIN_BYTES", 1)
    monkeypatch.setattr(restore_module, "REGION_PIECE_BYTES", 1024)
    gen = torch.Generator().manual_seed(0)
    state = {f"big{i}": torch.randn(8192, generator=gen) for i in range(40)}
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, state).wait()
        manifest = mgr.manifest(1)
    storage = _Counting(tmp_path)
    reader = restore_module.ArrayReader(storage)
    entries = list(manifest.tensors)
    outs = {i: torch.zeros(e.raw_nbytes, dtype=torch.uint8) for i, e in enumerate(entries)}
    fetched = reader.fetch_all(manifest, entries, outs)
    first = next(fetched)
    assert first is outs[0]
    fetched.close()
    with storage.lock:
        assert storage.in_flight == 0
        done = storage.finished
    assert done < len(entries)  # the queued ones were cancelled
    snapshot = {i: t.clone() for i, t in outs.items()}
    time.sleep(0.1)  # any read still going on would finish within this
    assert storage.finished == done
    assert all(torch.equal(outs[i], snapshot[i]) for i in outs)
    assert storage._read_fds == {}


class _Lenient(torch.nn.Module):
    """A module that loads whatever keys it is given (``strict=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(torch.zeros(4096))
        self.second = torch.nn.Parameter(torch.zeros(4096))

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return super().load_state_dict(state_dict, strict=False, assign=assign)


def test_a_fallback_that_leaves_an_overwritten_tensor_unset_raises(tmp_path: Path) -> None:
    """The damaged newest step was read into ``second`` before its damage was found; the
    older step has no value for it, so ``load_state_dict`` would leave it holding the damaged
    step's bytes: the restore raises instead of returning that state."""
    m = _Lenient()
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, {"m": {"first": torch.ones(4096)}}).wait()
        mgr.save(2, {"m": {"second": torch.full((4096,), 2.0), "first": torch.ones(4096)}}).wait()
        last = mgr.manifest(2).tensors[-1]
    assert last.key == "/m/first"
    _flip_byte(_data_file(tmp_path, 2), last.pieces[0].offset + 5)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CheckpointError, match="/m/second"):
        mgr.restore(into={"m": m})
    assert torch.equal(m.second, torch.full((4096,), 2.0))  # what the message warns about


@pytest.mark.parametrize("overlap", [True, False])
def test_chunked_reads_give_the_whole_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """A piece read in chunks, checksummed on the helper thread (or after each read), gives
    the bytes and the crc32c of one read: from an unaligned offset to the file's unaligned
    end, and in the middle; a file too short is an error."""
    monkeypatch.setattr(restore_module, "READ_CHUNK_BYTES", 4096)
    monkeypatch.setattr(restore_module, "OVERLAP_CHECKSUMS", overlap)
    monkeypatch.setattr(restore_module, "CHUNKED_MIN_BYTES", 1)
    data = torch.randint(0, 256, (3 * 4096 + 1000 + 77,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "f").write_bytes(data)
    storage = LocalStorage(tmp_path)
    for start, stop in ((77, len(data)), (4000, 4000 + 2 * 4096 + 5), (0, 100)):
        out = bytearray(stop - start)
        crc = restore_module.read_checked(storage, "f", start, memoryview(out))
        assert bytes(out) == data[start:stop]
        assert crc == crc32c.crc32c(data[start:stop])
    with pytest.raises(StorageError, match="shorter"):
        restore_module.read_checked(storage, "f", 77, memoryview(bytearray(len(data))))


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore of a private mapping,
    whose pages are the file's until written)."""
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            done = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), size, vec)
            assert done == 0, ctypes.get_errno()
        finally:
            del start
    return sum(v & 1 for v in vec)


def test_a_chunked_read_leaves_the_page_cache_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large piece read from local storage does not stay in the page cache (a plain read
    does), in a read session neither (nor what the kernel read ahead of it): a restore does not
    evict what training keeps cached; and within a session a file that was wholly cached
    before (just written, or read by another process) stays cached."""
    monkeypatch.setattr(restore_module, "READ_CHUNK_BYTES", 1 << 20)  # several chunks
    data = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8).numpy().tobytes()
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    storage = LocalStorage(tmp_path)
    pages = len(data) // mmap.PAGESIZE

    def chunked(session: bool) -> None:
        out = bytearray(len(data))
        with storage.read_session() if session else contextlib.nullcontext():
            crc = restore_module.read_checked(storage, "f", 0, memoryview(out))
        assert crc == crc32c.crc32c(data) and bytes(out) == data

    for session in (False, True):
        drop_file_cache(path)
        assert _cached_pages(path) == 0
        chunked(session)
        assert _cached_pages(path) == 0
    storage.read_into("f", 0, memoryview(bytearray(len(data))))
    assert _cached_pages(path) == pages  # the control: a plain read
    chunked(True)
    assert _cached_pages(path) == pages  # cached before the session: kept


def _read_crc(root: str, n: int) -> int:
    out = bytearray(n)
    return restore_module.read_checked(LocalStorage(root), "f", 0, memoryview(out))


def test_a_forked_child_reads_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process forked after a chunked read (the parent's checksum thread started) reads in
    chunks too: it starts a checksum thread of its own instead of waiting for the parent's."""
    monkeypatch.setattr(restore_module, "READ_CHUNK_BYTES", 4096)
    monkeypatch.setattr(restore_module, "CHUNKED_MIN_BYTES", 1)
    monkeypatch.setattr(restore_module, "OVERLAP_CHECKSUMS", True)
    data = torch.randint(0, 256, (5 * 4096,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "f").write_bytes(data)
    assert _read_crc(str(tmp_path), len(data)) == crc32c.crc32c(data)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_read_crc, (str(tmp_path), len(data))).get(60) == crc32c.crc32c(
            data
        )


class _Flipping(LocalStorage):
    """Local storage whose reads flip the first byte they return (a faulty device)."""

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        super().read_into(path, offset, out)
        view = out.cast("B")
        view[0] ^= 1


def test_a_storage_that_overrides_read_into_is_read_through_it(tmp_path: Path) -> None:
    """A LocalStorage subclass's own read_into reads every piece, large ones too (not the
    chunked reader that bypasses it): its damage is found."""
    big = torch.randn(1 << 19)  # 2 MiB: read in chunks from plain local storage
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, {"w": big}).wait()
    with CheckpointManager(LocalStorage(tmp_path)) as mgr:
        assert torch.equal(mgr.restore()["w"], big)
    with (
        CheckpointManager(_Flipping(tmp_path)) as mgr,
        pytest.raises(CorruptCheckpointError, match="checksum"),
    ):
        mgr.restore(step=1)
