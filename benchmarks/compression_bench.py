#!/usr/bin/env python
"""Compression in the engine on real checkpoint sequences (docs/compression.md).

Run (about 4-8 minutes on a loaded 2-core machine; it only writes under --dir):

    python -m benchmarks.compression_bench --dir bench-tmp/compression

Three training runs make the checkpoint sequences (nothing is downloaded):

- the digits CNN of ``tests/harness/digits.py`` (0.55 M parameters) on scikit-learn's bundled
  digits (train on the first 1400, accuracy on the 397 others), Adam;
- a small GPT-style transformer (4 pre-norm blocks, d=256, 4 heads, vocabulary 256, context 32;
  3.3 M parameters) on synthetic tokens from a sparse Markov chain (each token has 4 possible
  successors), Adam; accuracy = next-token accuracy on held-out sequences;
- a fine-tune of that transformer on another chain with the embeddings and the first two
  blocks frozen (``requires_grad=False``: their weights never change and Adam holds no state
  for them), Adam over the trainable half.

The full state (``model.state_dict()`` and ``optimizer.state_dict()``) is captured after the
steps of each sequence: every step (steps 385-400), every 10 steps (250-400) and every 100 steps
(100-400) of the 400 training steps; every 10 steps (10-160) of the fine-tune. Each sequence is
then saved, state by state, through one ``CheckpointManager`` per mode (none, lossless, lossy,
auto, and lossy with ``lossy_bits=2, lossy_optimizer="quantized"``, the most aggressive
setting), by plain zstd (level 3 of each tensor's bytes, one file,
fsync) and by ``torch.distributed.checkpoint.save`` with and without its ``ZStandard`` stream
extension. For each state the methods run in an order rotated by one, each save waited for
(``save(...).wait()``) before the next, so they see the same load. Then the last step is
restored by each method, checked against the original (bit for bit, or within the recorded
error bound for lossy) and evaluated.

Last, the accuracy target: the protocol of tests/codecs/test_lossy_training.py (400 steps, a
lossy save every 10, a restore every 40: 10 restores) with the test's small CNN and with the
0.55 M digits CNN, for a few settings of the lossy knobs.

Writes benchmarks/results/compression-<time>.json (every save) and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import shutil
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from tests.harness.digits import DigitsCNN, digits_images, digits_split, small_cnn, train_steps

from benchmarks._lib.files import fsync_path, scratch
from benchmarks._lib.machine import uptime
from benchmarks._lib.results import log as _log
from benchmarks._lib.results import results_path, write_json
from coci_core import CheckpointManager

State = dict[str, Any]
Seq = list[tuple[int, State]]

TRAIN_STEPS = 400
FT_STEPS = 160
SCHEDULES = {
    "every1": list(range(385, 401)),
    "every10": list(range(250, 401, 10)),
    "every100": [100, 200, 300, 400],
}
FT_SCHEDULE = list(range(10, FT_STEPS + 1, 10))

# method -> (coci mode, compression_options) for CheckpointManager methods
COCI = {
    "none": ("none", None),
    "lossless": ("lossless", None),
    # lossy defaults: 8 bits, Adam's exp_avg quantized, exp_avg_sq lossless
    "lossy": ("lossy", None),
    # the most aggressive setting: 2 bits, both Adam moments quantized
    "lossy_b2q": ("lossy", {"lossy_bits": 2, "lossy_optimizer": "quantized"}),
    "auto": ("auto", None),
}
OTHER = ("zstd3", "dcp_zstd", "dcp")
B2Q = {"lossy_bits": 2, "lossy_optimizer": "quantized"}
QDELTAS = ("coci.qdelta/1", "coci.qdelta/2", "coci.qdelta-log/1")


def log(msg: str) -> None:
    _log(msg, file=sys.stderr)


# --- models and data --------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """A small decoder-only transformer (learned positions, untied head)."""

    def __init__(
        self, vocab: int = 256, d: int = 256, heads: int = 4, layers: int = 4, context: int = 32
    ) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        mask = torch.triu(torch.full((context, context), float("-inf")), 1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


class MarkovTokens:
    """Token sequences from a sparse first-order Markov chain (4 successors per token)."""

    PROBS = torch.tensor([0.7, 0.2, 0.07, 0.03])

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.succ = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(vocab)])

    def sample(self, n: int, length: int, g: torch.Generator) -> torch.Tensor:
        out = torch.empty(n, length, dtype=torch.int64)
        out[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
        for t in range(1, length):
            choice = torch.multinomial(self.PROBS.expand(n, 4), 1, generator=g).squeeze(1)
            out[:, t] = self.succ[out[:, t - 1], choice]
        return out


def capture(model: torch.nn.Module, opt: torch.optim.Optimizer) -> State:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(opt.state_dict()),
    }


def digits_run(steps: int, wanted: set[int]) -> tuple[dict[int, State], Callable[[State], float]]:
    x, y = digits_images()
    train_x, train_y, test_x, test_y = x[:1400], y[:1400], x[1400:], y[1400:]
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    out: dict[int, State] = {}
    for step in train_steps(model, opt, train_x, train_y, g, steps):
        if step in wanted:
            out[step] = capture(model, opt)

    def accuracy(state: State) -> float:
        m = DigitsCNN()
        m.load_state_dict(state["model"])
        with torch.no_grad():
            return float((m(test_x).argmax(1) == test_y).float().mean())

    return out, accuracy


def gpt_runs(
    steps: int,
    wanted: set[int],
    ft_steps: int,
    ft_wanted: set[int],
    *,
    keep_optimizer: bool = False,
) -> tuple[
    dict[int, State],
    dict[int, State],
    Callable[[State], float],
    Callable[[State], float],
    dict[str, Any],
]:
    vocab, context, batch = 256, 32, 8
    pre, post = MarkovTokens(vocab, 1), MarkovTokens(vocab, 2)
    g = torch.Generator().manual_seed(0)
    held_pre = pre.sample(128, context + 1, torch.Generator().manual_seed(99))
    held_post = post.sample(128, context + 1, torch.Generator().manual_seed(98))
    torch.manual_seed(0)
    model = GPT(vocab=vocab, context=context)

    def loss_of(m: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
        logits = m(seq[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), seq[:, 1:].reshape(-1))

    def train(
        m: torch.nn.Module, opt: torch.optim.Optimizer, chain: MarkovTokens, n: int, want: set[int]
    ) -> dict[int, State]:
        out = {}
        for step in range(1, n + 1):
            loss = loss_of(m, chain.sample(batch, context + 1, g))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step in want:
                out[step] = capture(m, opt)
        return out

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pre_states = train(model, opt, pre, steps, wanted)
    # fine-tune: embeddings and the first half of the blocks frozen
    frozen = [model.tok, model.pos, *model.blocks[: len(model.blocks) // 2]]
    for module in frozen:
        for p in module.parameters():
            p.requires_grad_(False)
    n_frozen = sum(p.numel() for mod in frozen for p in mod.parameters())
    n_all = sum(p.numel() for p in model.parameters())
    if keep_optimizer:
        # layers frozen mid-run, the optimizer kept: Adam skips parameters without gradients,
        # so the frozen half's moments stay in the state, unchanged
        ft_opt = opt
    else:
        ft_opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ft_states = train(model, ft_opt, post, ft_steps, ft_wanted)
    moments = n_all if keep_optimizer else n_all - n_frozen
    info = {
        "params": n_all,
        "frozen_params": n_frozen,
        "frozen_fraction_of_params": n_frozen / n_all,
        "optimizer_kept": keep_optimizer,
        # weights of every parameter + exp_avg and exp_avg_sq of the parameters Adam holds
        "frozen_fraction_of_state": (n_frozen * (3 if keep_optimizer else 1))
        / (n_all + 2 * moments),
    }

    def accuracy_on(held: torch.Tensor) -> Callable[[State], float]:
        def accuracy(state: State) -> float:
            m = GPT(vocab=vocab, context=context)
            m.load_state_dict(state["model"])
            with torch.no_grad():
                pred = m(held[:, :-1]).argmax(-1)
            return float((pred == held[:, 1:]).float().mean())

        return accuracy

    return pre_states, ft_states, accuracy_on(held_pre), accuracy_on(held_post), info


# --- helpers over states ----------------------------------------------------------------


def tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}/{i}")


def raw_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors(state))


def compare(original: State, restored: State) -> tuple[bool, float]:
    """(bit-exact, max |difference| over float tensors)."""
    a, b = dict(tensors(original)), dict(tensors(restored))
    if a.keys() != b.keys():
        raise AssertionError(f"restored keys differ: {sorted(set(a) ^ set(b))[:5]}")
    exact, worst = True, 0.0
    for k, t in a.items():
        u = b[k]
        if t.dtype != u.dtype or t.shape != u.shape:
            raise AssertionError(f"{k}: {t.dtype}{tuple(t.shape)} vs {u.dtype}{tuple(u.shape)}")
        if not torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)):
            exact = False
            if t.is_floating_point():
                worst = max(worst, float((t.double() - u.double()).abs().max()))
    return exact, worst


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


# --- the methods that are not coci --------------------------------------------------------


def zstd_save(directory: Path, step: int, state: State) -> dict[str, Any]:
    """Plain zstd: level 3 of each tensor's bytes, one data file + an index, fsync'ed."""
    started = time.perf_counter()
    cctx = zstandard.ZstdCompressor(level=3)
    path = directory / f"step-{step}"
    path.mkdir(parents=True)
    index, encode_s = [], 0.0
    with open(path / "data.zst", "wb") as f:
        for key, t in tensors(state):
            t0 = time.perf_counter()
            blob = cctx.compress(_u8(t))
            encode_s += time.perf_counter() - t0
            f.write(blob)
            index.append((key, str(t.dtype), tuple(t.shape), len(blob)))
        f.flush()
        os.fsync(f.fileno())
    skeleton = _skeleton(state)
    with open(path / "index.pkl", "wb") as f:
        f.write(pickle.dumps((index, skeleton)))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)
    ttd = time.perf_counter() - started
    written = sum(p.stat().st_size for p in path.iterdir())
    return {"time_to_durable_s": ttd, "bytes_written": written, "encode_s": encode_s}


def _skeleton(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def zstd_load(directory: Path, step: int) -> State:
    path = directory / f"step-{step}"
    index, skeleton = pickle.loads((path / "index.pkl").read_bytes())
    dctx = zstandard.ZstdDecompressor()
    values = {}
    with open(path / "data.zst", "rb") as f:
        for key, dtype, shape, n in index:
            dt = getattr(torch, dtype.split(".")[1])
            numel = int(np.prod(shape)) if shape else 1
            t = torch.empty(numel, dtype=dt)
            raw = dctx.decompress(f.read(n), max_output_size=numel * t.element_size())
            t.view(torch.uint8).numpy()[:] = np.frombuffer(raw, np.uint8)
            values[key] = t.reshape(shape)

    def fill(obj: Any, p: str) -> Any:
        if obj is None and p in values:
            return values[p]
        if isinstance(obj, dict):
            return {k: fill(v, f"{p}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(v, f"{p}/{i}") for i, v in enumerate(obj))
        return obj

    return fill(skeleton, "")


def dcp_save(directory: Path, step: int, state: State, zstd: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    path = directory / f"step-{step}"
    started = time.perf_counter()
    writer = FileSystemWriter(path, _extensions=[ZStandard()] if zstd else None)
    dcp.save(state, storage_writer=writer)
    ttd = time.perf_counter() - started
    written = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return {"time_to_durable_s": ttd, "bytes_written": written}


def dcp_load(directory: Path, step: int, template: State) -> State:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    target = copy.deepcopy(template)
    for _, t in tensors(target):
        t.zero_()
    dcp.load(target, storage_reader=FileSystemReader(directory / f"step-{step}"))
    return target


# --- coci -----------------------------------------------------------------------------------


class Timed:
    """Times the writer thread's encoder (private attributes: benchmark only)."""

    def __init__(self, mgr: CheckpointManager) -> None:
        self.encode_s = 0.0
        self.begin_s = 0.0
        enc = mgr._encoder
        encode, begin = enc.encode, enc.begin

        def timed_encode(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return encode(*a, **k)
            finally:
                self.encode_s += time.perf_counter() - t

        def timed_begin(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return begin(*a, **k)
            finally:
                self.begin_s += time.perf_counter() - t

        enc.encode = timed_encode  # type: ignore[method-assign]
        enc.begin = timed_begin  # type: ignore[method-assign]

    def take(self) -> tuple[float, float]:
        out = (self.encode_s, self.begin_s)
        self.encode_s = self.begin_s = 0.0
        return out


def manifest_info(mgr: CheckpointManager, step: int) -> dict[str, Any]:
    m = mgr.manifest(step)
    codec_raw: Counter[str] = Counter()
    codec_stored: Counter[str] = Counter()
    bits: Counter[str] = Counter()
    max_err = max_rel = 0.0
    for entry in m.tensors:
        for p in entry.pieces:
            params = p.params or {"codec": "coci.raw/1"}
            codec = str(params["codec"])
            if codec == "coci.chunks/1":
                inner = params.get("inner", {}).get("codec", "?")
                codec = f"chunks[{'zstd' if inner == 'coci.zstd/1' else 'raw'}]"
            codec_raw[codec] += p.length
            codec_stored[codec] += p.nbytes
            if "max_abs_error" in params:
                max_err = max(max_err, float(params["max_abs_error"]))
                bits[str(params["bits"])] += p.length
            if "max_rel_error" in params:
                max_rel = max(max_rel, float(params["max_rel_error"]))
    return {
        "codec_raw": dict(codec_raw),
        "codec_stored": dict(codec_stored),
        "bits_raw": dict(bits),
        "max_abs_error": max_err,
        "max_rel_error": max_rel,
        "bases": list(m.bases),
    }


def replay(
    name: str, seq: Seq, accuracy: Callable[[State], float], root: Path, methods: list[str]
) -> dict[str, Any]:
    base = root / name
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    mgrs, timers = {}, {}
    for m in methods:
        if m in COCI:
            mode, opts = COCI[m]
            mgrs[m] = CheckpointManager(
                base / m, compression=mode, compression_options=opts, keep_last=3
            )
            timers[m] = Timed(mgrs[m])
        else:
            (base / m).mkdir()
    saves: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    raws = [raw_bytes(state) for _, state in seq]
    up_before = uptime()
    for i, (step, state) in enumerate(seq):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        for m in order:
            rec: dict[str, Any] = {"step": step, "raw_state_bytes": raws[i]}
            if m in COCI:
                ev = mgrs[m].save(step, state).wait()
                enc_s, begin_s = timers[m].take()
                rec.update(
                    time_to_durable_s=ev.time_to_durable_s,
                    persist_s=ev.persist_s,
                    copy_s=ev.copy_s,
                    bytes_written=ev.bytes_written,
                    raw_bytes=ev.raw_bytes,
                    compressed=ev.compressed,
                    encode_s=enc_s,
                    begin_s=begin_s,
                    **manifest_info(mgrs[m], step),
                )
            elif m == "zstd3":
                rec.update(zstd_save(base / m, step, state), raw_bytes=raws[i])
            else:
                rec.update(dcp_save(base / m, step, state, zstd=m == "dcp_zstd"), raw_bytes=raws[i])
                old = sorted(base.joinpath(m).iterdir(), key=lambda p: int(p.name[5:]))[:-3]
                for p in old:
                    shutil.rmtree(p)
            saves[m].append(rec)
        if "zstd3" in methods:
            old = sorted(base.joinpath("zstd3").iterdir(), key=lambda p: int(p.name[5:]))[:-3]
            for p in old:
                shutil.rmtree(p)
    last_step, last_state = seq[-1]
    exact_acc = accuracy(last_state)
    restores: dict[str, dict[str, Any]] = {}
    for m in methods:
        t = time.perf_counter()
        if m in COCI:
            restored = mgrs[m].restore(step=last_step)
        elif m == "zstd3":
            restored = zstd_load(base / m, last_step)
        else:
            restored = dcp_load(base / m, last_step, last_state)
        seconds = time.perf_counter() - t
        exact, diff = compare(last_state, restored)
        restores[m] = {
            "seconds": seconds,
            "exact": exact,
            "max_abs_diff": diff,
            "accuracy": exact_acc if exact else accuracy(restored),
        }
        if m in COCI and not exact:
            bound = saves[m][-1]["max_abs_error"]
            restores[m]["within_recorded_bound"] = diff <= bound
    for mgr in mgrs.values():
        mgr.close()
    shutil.rmtree(base, ignore_errors=True)
    return {
        "name": name,
        "steps": [s for s, _ in seq],
        "raw_state_bytes": raws,
        "exact_accuracy": exact_acc,
        "saves": saves,
        "restores": restores,
        "uptime_before": up_before,
        "uptime_after": uptime(),
    }


def summarize(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for m, recs in run["saves"].items():
        steady = recs[1:]
        raw_all = sum(r["raw_bytes"] for r in recs)
        raw_st = sum(r["raw_bytes"] for r in steady)
        w_all = sum(r["bytes_written"] for r in recs)
        w_st = sum(r["bytes_written"] for r in steady)
        ttd = [r["time_to_durable_s"] for r in steady]
        row: dict[str, Any] = {
            "ratio_steady": raw_st / w_st,
            "ratio_all": raw_all / w_all,
            "written_fraction_steady": w_st / raw_st,
            "ttd_median_ms": 1e3 * statistics.median(ttd),
            "ttd_mean_ms": 1e3 * statistics.fmean(ttd),
            "ttd_first_ms": 1e3 * recs[0]["time_to_durable_s"],
        }
        enc = sum(r.get("encode_s", 0.0) for r in steady)
        if m not in ("none", "dcp", "dcp_zstd") and enc > 0:
            row["encode_mbps"] = raw_st / enc / 1e6
        if m == "auto":
            row["probe_ms_per_save"] = 1e3 * statistics.fmean(r["begin_s"] for r in steady)
            row["compressed_saves"] = sum(bool(r["compressed"]) for r in recs)
        if "codec_raw" in recs[0]:
            mix: Counter[str] = Counter()
            for r in steady:
                mix.update(r["codec_raw"])
            total = sum(mix.values())
            row["codec_mix_steady"] = {k: round(v / total, 3) for k, v in mix.most_common()}
            row["max_abs_error"] = max(r["max_abs_error"] for r in recs)
        rest = run["restores"][m]
        row["restore_s"] = rest["seconds"]
        row["restore_mbps"] = run["raw_state_bytes"][-1] / rest["seconds"] / 1e6
        row["restore_exact"] = rest["exact"]
        row["restore_accuracy"] = rest["accuracy"]
        row["restore_max_abs_diff"] = rest["max_abs_diff"]
        if "within_recorded_bound" in rest:
            row["within_recorded_bound"] = rest["within_recorded_bound"]
        out[m] = row
    return out


# --- 10 lossy restores (tests/codecs/test_lossy_training.py's protocol) ---------------------


class _Flat(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = DigitsCNN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(-1, 1, 8, 8))


def lossy_restores(
    model_name: str,
    directory: Path | None,
    options: dict[str, Any] | None,
    steps: int = 400,
    save_every: int = 10,
    restore_every: int = 40,
) -> dict[str, Any]:
    train_x, train_y, test_x, test_y = digits_split()
    torch.manual_seed(0)
    model = small_cnn() if model_name == "test_cnn" else _Flat()
    optim = torch.optim.Adam(model.parameters(), lr=2e-3)
    mgr = None
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        mgr = CheckpointManager(
            directory, compression="lossy", keep_last=2, compression_options=options
        )
    saves, restores, restore_s = [], 0, 0.0
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, len(train_x), (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
        optim.zero_grad()
        loss.backward()
        optim.step()
        if mgr is not None and step % save_every == 0:
            ev = mgr.save(step, {"model": model.state_dict(), "optim": optim.state_dict()}).wait()
            info = manifest_info(mgr, step)
            saves.append(
                {
                    "step": step,
                    "bytes_written": ev.bytes_written,
                    "raw_bytes": ev.raw_bytes,
                    "time_to_durable_s": ev.time_to_durable_s,
                    "lossy": any(c in info["codec_raw"] for c in QDELTAS),
                    **info,
                }
            )
        if mgr is not None and step % restore_every == 0:
            t = time.perf_counter()
            mgr.restore(into={"model": model, "optim": optim})
            restore_s += time.perf_counter() - t
            restores += 1
    if mgr is not None:
        mgr.close()
        shutil.rmtree(directory, ignore_errors=True)  # type: ignore[arg-type]
    with torch.no_grad():
        acc = float((model(test_x).argmax(1) == test_y).float().mean())
    out: dict[str, Any] = {
        "model": model_name,
        "options": options,
        "accuracy": acc,
        "restores": restores,
        "saves": saves,
    }
    if saves:
        lossy = [s for s in saves if s["lossy"]]
        q_raw = sum(s["codec_raw"].get(c, 0) for s in saves for c in QDELTAS)
        q_stored = sum(s["codec_stored"].get(c, 0) for s in saves for c in QDELTAS)
        out.update(
            raw_state_bytes=saves[0]["raw_bytes"],
            lossy_saves=len(lossy),
            ratio_lossy_saves=sum(s["raw_bytes"] for s in lossy)
            / sum(s["bytes_written"] for s in lossy),
            ratio_qdelta_pieces=q_raw / q_stored if q_stored else None,
            qdelta_fraction_of_raw=q_raw / sum(s["raw_bytes"] for s in lossy),
            ratio_all_saves=sum(s["raw_bytes"] for s in saves)
            / sum(s["bytes_written"] for s in saves),
            manifest_bytes_per_save=statistics.median(
                s["bytes_written"] - sum(s["codec_stored"].values()) for s in saves
            ),
            max_abs_error=max(s["max_abs_error"] for s in saves),
            max_rel_error=max(s["max_rel_error"] for s in saves),
            bits=dict(sum((Counter(s["bits_raw"]) for s in saves), Counter())),
            restore_s_mean=restore_s / max(1, restores),
        )
    return out


# --- report -------------------------------------------------------------------------------


def _f(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def tables(res: dict[str, Any]) -> str:
    lines = []
    for run in res["replays"]:
        summ = run["summary"]
        mb = run["raw_state_bytes"][-1] / 1e6
        lines.append(
            f"\n### {run['name']}: {len(run['steps'])} saves (steps {run['steps'][0]}-"
            f"{run['steps'][-1]}), {mb:.1f} MB per state; accuracy of the last state "
            f"{run['exact_accuracy']:.4f}\n"
        )
        lines.append(
            "| method | ratio steady | ratio incl. first | written / raw | median TTD ms | "
            "mean TTD ms | encode MB/s | restore s | restore MB/s | exact | max err bound | "
            "accuracy after restore |"
        )
        lines.append("|" + "---|" * 12)
        for m, r in summ.items():
            err = r.get("max_abs_error")
            lines.append(
                f"| {m} | {r['ratio_steady']:.2f} | {r['ratio_all']:.2f} | "
                f"{100 * r['written_fraction_steady']:.0f}% | {r['ttd_median_ms']:.0f} | "
                f"{r['ttd_mean_ms']:.0f} | {_f(r.get('encode_mbps'), '.0f')} | "
                f"{r['restore_s']:.3f} | {r['restore_mbps']:.0f} | "
                f"{'yes' if r['restore_exact'] else 'no'} | "
                f"{_f(err, '.2e') if err else '-'} | {r['restore_accuracy']:.4f} |"
            )
        mix = {m: r.get("codec_mix_steady") for m, r in summ.items() if r.get("codec_mix_steady")}
        lines.append(
            "\nCodec mix (share of raw bytes, steady state): "
            + "; ".join(
                f"{m}: " + ", ".join(f"{k} {v:.0%}" for k, v in mx.items()) for m, mx in mix.items()
            )
        )
        if "auto" in summ:
            a = summ["auto"]
            lines.append(
                f"auto: {a['compressed_saves']} of {len(run['steps'])} saves compressed; "
                f"probe + decision {a['probe_ms_per_save']:.1f} ms per save on average."
            )
        lines.append(f"uptime before/after: `{run['uptime_before']}` / `{run['uptime_after']}`")
    lines.append("\n### 10 lossy restores (tests/codecs/test_lossy_training.py's protocol)\n")
    lines.append(
        "| model | options | raw state KB | accuracy | vs. no restores (points) | restores | "
        "lossy saves | ratio of lossy saves | qdelta pieces ratio | ratio all saves | "
        "max err bound | bits (share of qdelta bytes) |"
    )
    lines.append("|" + "---|" * 12)
    for r in res["lossy_restores"]["runs"]:
        ref = res["lossy_restores"]["reference"][r["model"]]
        bits = r.get("bits", {})
        tot = sum(bits.values()) or 1
        lines.append(
            f"| {r['model']} | {json.dumps(r['options'] or {})} | "
            f"{r['raw_state_bytes'] / 1e3:.0f} | {r['accuracy']:.4f} | "
            f"{100 * (r['accuracy'] - ref):+.2f} | {r['restores']} | {r['lossy_saves']} | "
            f"{r['ratio_lossy_saves']:.1f} | {_f(r['ratio_qdelta_pieces'], '.1f')} | "
            f"{r['ratio_all_saves']:.1f} | {r['max_abs_error']:.2e} | "
            + ", ".join(f"{b}: {v / tot:.0%}" for b, v in sorted(bits.items()))
            + " |"
        )
    lines.append(
        "\nReference (no restores): "
        + ", ".join(f"{k} {v:.4f}" for k, v in res["lossy_restores"]["reference"].items())
        + f"; uptime before/after: `{res['lossy_restores']['uptime_before']}` / "
        f"`{res['lossy_restores']['uptime_after']}`"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--quick", action="store_true", help="a smoke run (few steps)")
    ap.add_argument("--methods", default=",".join([*COCI, *OTHER]))
    args = ap.parse_args()
    args.dir = scratch(args.dir, "compression")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two threads on a shared 2-core machine run ~20x slower
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    scheds = dict(SCHEDULES)
    train_steps, ft_sched = TRAIN_STEPS, FT_SCHEDULE
    if args.quick:
        scheds = {"every1": [21, 22, 23, 24], "every10": [10, 20, 30], "every100": [10, 30]}
        train_steps, ft_sched = 30, [5, 10, 15]
    started = time.time()
    res: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "nproc": os.cpu_count(),
        "uptime_start": uptime(),
        "schedules": scheds,
        "fine_tune_schedule": ft_sched,
        "methods": methods,
    }
    wanted = set().union(*scheds.values())
    log(f"training digits CNN ({uptime()})")
    t = time.perf_counter()
    d_states, d_acc = digits_run(train_steps, wanted)
    res["digits_train_s"] = time.perf_counter() - t
    log(f"training transformer + fine-tune ({uptime()})")
    t = time.perf_counter()
    g_states, ft_states, g_acc, ft_acc, ft_info = gpt_runs(
        train_steps, wanted, ft_sched[-1], set(ft_sched)
    )
    res["gpt_train_s"] = time.perf_counter() - t
    res["fine_tune"] = ft_info
    res["uptime_after_training"] = uptime()
    log(f"trained ({res['digits_train_s']:.0f} s + {res['gpt_train_s']:.0f} s); {ft_info}")
    sequences = []
    for model, states, acc in (("digits", d_states, d_acc), ("gpt", g_states, g_acc)):
        for sname, steps in scheds.items():
            sequences.append((f"{model}-{sname}", [(s, states[s]) for s in steps], acc))
    sequences.append(
        ("gpt-finetune-half-frozen-every10", [(s, ft_states[s]) for s in ft_sched], ft_acc)
    )
    res["replays"] = []
    for name, seq, acc in sequences:
        log(f"replay {name} ({uptime()})")
        run = replay(name, seq, acc, root, methods)
        run["summary"] = summarize(run)
        res["replays"].append(run)
    del d_states, g_states, ft_states, sequences
    log(f"10 lossy restores ({uptime()})")
    lr: dict[str, Any] = {"uptime_before": uptime(), "reference": {}, "runs": []}
    configs = [
        ("test_cnn", None),  # defaults: 8 bits, exp_avg_sq lossless
        ("test_cnn", B2Q),
        ("test_cnn", {**B2Q, "full_every": 40, "max_lossy_generations": 40}),
        ("digits_cnn", None),
        ("digits_cnn", {"lossy_bits": 2}),  # 2 bits, exp_avg_sq still lossless
        ("digits_cnn", B2Q),
    ]
    if args.quick:
        configs = configs[:2]
    steps = 40 if args.quick else 400
    for model in sorted({c[0] for c in configs}):
        lr["reference"][model] = lossy_restores(model, None, None, steps=steps)["accuracy"]
    for model, opts in configs:
        r = lossy_restores(model, root / "lossy-restores", opts, steps=steps)
        log(
            f"  {model} {opts}: accuracy {r['accuracy']:.4f} "
            f"(reference {lr['reference'][model]:.4f}), ratio of lossy saves "
            f"{r.get('ratio_lossy_saves', 0):.1f}"
        )
        lr["runs"].append(r)
    lr["uptime_after"] = uptime()
    res["lossy_restores"] = lr
    res["uptime_end"] = uptime()
    res["seconds"] = time.time() - started
    path = results_path("compression", args.out)
    write_json(path, res)
    print(tables(res))
    log(f"done in {res['seconds'] / 60:.1f} min; results in {path}")


if __name__ == "__main__":
    main()
