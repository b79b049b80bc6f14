"""Compression through CheckpointManager: every mode round-trips, deltas chain to bases that
retention keeps, a damaged base is detected and restore falls back, lossy error stays within
its recorded bound, and "auto" compresses only where it pays."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, ConfigError, LocalStorage
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.restore.restore import load_checkpoint

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _special(dtype: torch.dtype) -> torch.Tensor:
    t = torch.randn(4096, generator=torch.Generator().manual_seed(1)).to(dtype)
    t[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40]).to(dtype)
    return t


def _states(n: int) -> list[dict[str, Any]]:
    """A state that drifts a little each save (as training does), with a frozen half."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    frozen = torch.randn(512, 256, generator=g)
    states = []
    for i in range(n):
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        states.append(
            {
                "model": {
                    "w": w.clone(),
                    "frozen": frozen,
                    "count": torch.arange(5000) + i,
                    "ids": torch.arange(100_000),  # a frozen integer buffer
                },
                "optim": {"exp_avg": w * 0.1, "exp_avg_sq": (w * w) * 0.01},
                "special": {str(d): _special(d) for d in FLOATS},
                "flags": torch.ones(100, dtype=torch.bool),
                "step": i,
            }
        )
    return states


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool((a.view(torch.uint8) == b.view(torch.uint8)).all())
            if a.numel()
            else a.shape == b.shape
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _save_all(mgr: CheckpointManager, states: Iterable[dict[str, Any]]) -> list[Any]:
    return [mgr.save(i + 1, s).wait() for i, s in enumerate(states)]


@pytest.mark.parametrize("mode", ["lossless", "auto", "none"])
def test_exact_modes_round_trip_every_step_bit_for_bit(tmp_path: Path, mode: str) -> None:
    states = _states(6)
    with CheckpointManager(
        tmp_path, keep_last=None, compression=mode, compression_options={"full_every": 3}
    ) as mgr:
        events = _save_all(mgr, states)
        for i, state in enumerate(states):
            assert _equal(mgr.restore(step=i + 1), state)
        assert mgr.verify() == {i + 1: [] for i in range(6)}
    if mode == "lossless":
        assert all(e.compressed for e in events)
        # deltas (saves 2, 3, 5, 6) against the bases (1, 4)
        assert [
            load_checkpoint(LocalStorage(tmp_path), s).manifest.bases for s in (2, 3, 4, 5)
        ] == [
            (1,),
            (1,),
            (),
            (4,),
        ]
        delta, base = events[1].bytes_written, events[0].bytes_written
        assert delta < 0.6 * base  # the frozen half and the drift compress to little
        assert base < events[0].raw_bytes  # shuffle + zstd alone is smaller than raw
        with CheckpointManager(tmp_path) as mgr:
            ids = manifest_entry(mgr.manifest(2), "/model/ids")
        # chunk-incremental: an unchanged integer buffer costs its chunk hashes only
        assert ids.codec == "coci.chunks/1"
        assert ids.nbytes < 0.01 * ids.raw_nbytes


def test_damaged_base_is_detected_and_restore_falls_back(tmp_path: Path) -> None:
    states = _states(4)
    with CheckpointManager(
        tmp_path, keep_last=None, compression="lossless", compression_options={"full_every": 2}
    ) as mgr:
        _save_all(mgr, states)  # bases 1 and 3; 2 and 4 are their deltas
        assert mgr.manifest(4).bases == (3,)
        data = tmp_path / step_dir_name(3) / "data-r0.bin"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        restored = mgr.restore()
        assert mgr.last_restore is not None
        assert mgr.last_restore.step == 2 and mgr.last_restore.skipped_steps == (4, 3)
        assert _equal(restored, states[1])
        bad = mgr.verify(4)[4]
        assert bad  # step 4's deltas cannot be checked against a damaged base
    import shutil

    shutil.rmtree(tmp_path / step_dir_name(1))
    with CheckpointManager(tmp_path) as mgr, pytest.raises(Exception, match="step 1"):
        mgr.restore(step=2, strict=True)


def test_retention_keeps_every_base_a_kept_checkpoint_needs(tmp_path: Path) -> None:
    states = _states(5)
    with CheckpointManager(
        tmp_path, keep_last=1, compression="lossless", compression_options={"full_every": 4}
    ) as mgr:
        for i, state in enumerate(states[:4]):
            mgr.save(i + 1, state).wait()
        mgr.close()
        assert mgr.steps() == [1, 4]  # 4 is a delta of 1
        assert _equal(mgr.restore(), states[3])
    with CheckpointManager(
        tmp_path, keep_last=1, compression="lossless", compression_options={"full_every": 4}
    ) as mgr:
        mgr.restore()  # continues the run, so its retention covers steps 1 and 4
        mgr.save(5, states[4]).wait()  # a new manager starts with a base
    with CheckpointManager(tmp_path) as reader:
        assert reader.steps() == [5]


def test_lossy_error_stays_within_its_recorded_bound_and_bases_are_forced(tmp_path: Path) -> None:
    states = _states(7)
    with CheckpointManager(
        tmp_path,
        keep_last=None,
        compression="lossy",
        compression_options={"full_every": 100, "max_lossy_generations": 3},
    ) as mgr:
        _save_all(mgr, states)
        for i, state in enumerate(states):
            manifest = mgr.manifest(i + 1)
            restored = mgr.restore(step=i + 1)
            w = manifest_entry(manifest, "/model/w")
            generations = {p.params.get("generation") for p in w.pieces if p.params}
            if i in (0, 4):  # lossless bases: the first save, and after 3 lossy generations
                assert all(
                    not str(p.params["codec"]).startswith("coci.qdelta")
                    for p in w.pieces
                    if p.params
                )
                assert _equal(restored, state)
                continue
            assert generations == {i if i < 4 else i - 4}
            bound = max(float(p.params["max_abs_error"]) for p in w.pieces)
            err = (restored["model"]["w"] - state["model"]["w"]).abs().max().item()
            assert 0 < err <= bound
            # integers and booleans are never lossy; Adam's second moment is quantized in the
            # log domain (by default): within its recorded relative bound, never 0
            assert _equal(restored["model"]["count"], state["model"]["count"])
            assert not _equal(restored["optim"]["exp_avg"], state["optim"]["exp_avg"])
            v, v_restored = state["optim"]["exp_avg_sq"], restored["optim"]["exp_avg_sq"]
            sq = manifest_entry(manifest, "/optim/exp_avg_sq")
            assert {p.params["codec"] for p in sq.pieces} == {"coci.qdelta-log/1"}
            rel_bound = max(float(p.params["max_rel_error"]) for p in sq.pieces)
            rel = ((v_restored.double() - v.double()).abs() / v.double()).max().item()
            assert 0 < rel <= rel_bound < 0.01
            assert bool((v_restored > 0).all()) and bool((v > 0).all())
        w3 = manifest_entry(mgr.manifest(3), "/model/w")
        assert w3.raw_nbytes / w3.nbytes > 3.5  # 8 bits and a few exact outliers per block


def manifest_entry(manifest: Any, key: str) -> Any:
    return next(t for t in manifest.tensors if t.key == key)


class _SlowStorage(LocalStorage):
    """Local files written at about ``mbps`` MB/s: an object store, as far as timing goes."""

    def __init__(self, root: Path, mbps: float) -> None:
        super().__init__(root, direct_io=False)
        self.mbps = mbps

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        started = time.perf_counter()
        n = super().write_file(path, chunks, aligned=aligned)
        time.sleep(max(0.0, n / (self.mbps * 1e6) - (time.perf_counter() - started)))
        return n


def test_auto_compresses_on_slow_storage_and_not_on_fast_disk(tmp_path: Path) -> None:
    # float32 values with bfloat16 precision: zstd halves them, as it does real weights' planes
    g = torch.Generator().manual_seed(2)
    states = [{"w": torch.randn(1 << 19, generator=g).bfloat16().float()} for _ in range(3)]
    with CheckpointManager(
        _SlowStorage(tmp_path / "slow", mbps=5),  # slow enough that zstd pays on a busy CPU
        compression="auto",
        compression_options={"auto_min_bytes": 1 << 20},
    ) as mgr:
        slow = _save_all(mgr, states)
    assert [e.compressed for e in slow] == [False, True, True]  # the first save measures
    # by default, saves under 16 MiB are latency, not bandwidth: never compressed by "auto"
    with CheckpointManager(_SlowStorage(tmp_path / "small", mbps=20)) as mgr:
        small = _save_all(mgr, states)
    assert not any(e.compressed for e in small)
    noise = [{"x": torch.randn(1 << 20)} for _ in range(3)]  # incompressible, on a fast disk
    with CheckpointManager(tmp_path / "fast", compression="auto") as mgr:
        fast = _save_all(mgr, noise)
    assert not any(e.compressed for e in fast)
    # on a fast disk "auto" writes raw from the arena, as "none" does
    files = sorted((tmp_path / "fast").glob("step-*/data-r0.bin"))
    assert [os.path.getsize(f) for f in files] == [4 << 20] * 3


def test_auto_stores_raw_where_decoding_would_slow_the_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On storage slow enough that compression shortens the write, a decoder slower than the
    storage's reads makes "auto" store raw: the resume would wait longer for the decode than
    the write saved. The same run with the real decoder compresses."""
    from coci_core.engine.save import compress

    g = torch.Generator().manual_seed(2)
    states = [{"w": torch.randn(1 << 19, generator=g).bfloat16().float()} for _ in range(3)]
    real = compress.decode_lossless

    def slow_decode(stored: Any, params: Any, out: Any) -> None:
        started = time.perf_counter()
        real(stored, params, out)
        # a decoder at 2 MB/s: slower than the 5 MB/s storage reads the raw bytes
        time.sleep(max(0.0, len(out) / 2e6 - (time.perf_counter() - started)))

    opts = {"auto_min_bytes": 1 << 20}
    with CheckpointManager(
        _SlowStorage(tmp_path / "fast-decode", mbps=5), compression_options=opts
    ) as mgr:
        assert [e.compressed for e in _save_all(mgr, states)] == [False, True, True]
    monkeypatch.setattr(compress, "decode_lossless", slow_decode)
    with CheckpointManager(
        _SlowStorage(tmp_path / "slow-decode", mbps=5), compression_options=opts
    ) as mgr:
        assert not any(e.compressed for e in _save_all(mgr, states))


def test_bad_compression_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'compression' must be one of"):
        CheckpointManager(tmp_path, compression="zstd")
    with pytest.raises(ConfigError, match="'auto_min_bytes' must be an integer >= 0"):
        CheckpointManager(tmp_path, compression_options={"auto_min_bytes": -1})
    with pytest.raises(ConfigError, match="'full_every' must be an integer >= 1"):
        CheckpointManager(tmp_path, compression="lossless", compression_options={"full_every": 0})
    with pytest.raises(ConfigError, match="'lossy_bits' must be 8, 4, 2 or 'auto'"):
        CheckpointManager(tmp_path, compression="lossy", compression_options={"lossy_bits": 3})
    with pytest.raises(ConfigError, match="'lossy_optimizer' must be one of"):
        CheckpointManager(
            tmp_path, compression="lossy", compression_options={"lossy_optimizer": "log"}
        )
    for bad in (-1, 65, 2.0, True):
        with pytest.raises(ConfigError, match="'lossy_outliers' must be None or an integer"):
            CheckpointManager(
                tmp_path, compression="lossy", compression_options={"lossy_outliers": bad}
            )


@pytest.mark.parametrize(
    ("optimizer", "codec"),
    [("log_second_moment", "coci.qdelta-log/1"), ("quantized", "coci.qdelta/2")],
)
def test_two_bit_second_moment_stays_positive_only_in_the_log_domain(
    tmp_path: Path, optimizer: str, codec: str
) -> None:
    """Adam's second moment at 2 bits: linear quantization turns small positive values into 0
    (Adam's next step m / (sqrt(v) + eps) then explodes); the log domain never does."""
    g = torch.Generator().manual_seed(3)
    # gradient scales over 8 orders of magnitude, as in a real network; Adam's update of v
    scale = 10.0 ** (-5 + 4 * torch.rand(1 << 16, generator=g))
    v = torch.zeros(1 << 16, dtype=torch.float64)
    options = {"lossy_bits": 2, "lossy_optimizer": optimizer}
    with CheckpointManager(
        tmp_path, keep_last=None, compression="lossy", compression_options=options
    ) as mgr:
        for step in range(1, 6):
            if step == 3:  # half the units die (their gradients become 0): their v decays
                scale = scale * (torch.rand(scale.shape, generator=g) < 0.5)
            for _ in range(10):
                grad = scale * torch.randn(v.shape, generator=g, dtype=torch.float64)
                v = 0.9 * v + 0.1 * grad**2
            state = {"optim": {"exp_avg_sq": v.float()}}
            mgr.save(step, state).wait()
        restored = mgr.restore(step=5)["optim"]["exp_avg_sq"]
        pieces = manifest_entry(mgr.manifest(5), "/optim/exp_avg_sq").pieces
    assert {p.params["codec"] for p in pieces} == {codec}
    collapsed = int(((restored <= 0) & (state["optim"]["exp_avg_sq"] > 0)).sum())
    if optimizer == "log_second_moment":
        assert collapsed == 0
        rel = (restored.double() - v.float().double()).abs() / v.float().double()
        assert rel.max().item() <= max(float(p.params["max_rel_error"]) for p in pieces) < 0.2
    else:
        assert collapsed > 1000  # the failure mode the log domain avoids


def test_retention_keeps_the_base_of_new_deltas_below_older_steps(tmp_path: Path) -> None:
    """A directory that already holds higher steps (an older run's): the new run's base is
    kept for its deltas although it is not among the newest steps by number."""
    states = _states(3)
    with CheckpointManager(tmp_path, keep_last=None) as old:
        for step in (10, 11, 12):
            old.save(step, states[0]).wait()
    with CheckpointManager(tmp_path, keep_last=3, compression="lossless") as mgr:
        for step, state in zip((1, 2, 3), states, strict=True):
            assert mgr.save(step, state).wait().outcome == "committed"
        assert 1 in mgr.steps()
        assert _equal(mgr.restore(step=3), states[2])
