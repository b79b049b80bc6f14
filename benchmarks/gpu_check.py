"""The CUDA path, checked and measured in one run (at most a few minutes).

Checks on the device what the CPU suite checks:

- ``inplace``: a model and AdamW saved with ``block=False`` (the training step right after the
  save changes every tensor) and restored in place, bit-exact, into the same tensors;
- ``kill_resume``: a child process training and saving every step is killed with SIGKILL
  mid-run; the latest committed step restores bit-exact and training resumed from it ends
  bit-identical to a run that was never killed;
- ``fsdp2``: a ``fully_shard`` model and its AdamW on a one-process group (nccl on CUDA, gloo on
  CPU) saved from ``get_state_dict`` and loaded back with ``set_state_dict``, bit-exact.

Measures the stall (seconds in ``save()``) against the device-to-host copy limit of the same
bytes (one copy of every tensor into one pinned buffer) and against the blocking time of DCP's
``async_save``. Targets: ``save(block=True)`` <= 1.3x the copy limit; ``save(block=False)`` at
least 2x below DCP ``async_save``. Targets are reported, not enforced; failed checks exit 1.

``--device cpu`` runs the same checks on CPU (smaller sizes) so that the script's logic is tested
without a GPU. Without CUDA, the default ``--device cuda`` exits 2 with a one-line message.

    python -m benchmarks.gpu_check [--device cuda|cpu] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from coci_core import CheckpointManager, InPlaceTargets, RankGroup

STALL_TARGET = 1.3  # save(block=True) at most this many times the copy limit
DCP_TARGET = 2.0  # save(block=False) at least this many times below DCP async_save
KILL_AFTER_STEP = 4  # the child is killed once it reports this step saved
TRAIN_STEPS = 8
CHILD_TIMEOUT_S = 120.0
NO_CUDA_MESSAGE = (
    "gpu_check: CUDA is not available (torch {version}); this check needs a CUDA GPU "
    "(use --device cpu to run its logic on CPU)"
)


def _sizes(device: str, quick: bool) -> dict[str, int]:
    """Model width and the bytes of the stall measurement (per tensor and in all)."""
    if device == "cuda":
        return {"width": 1024, "tensors": 32, "tensor_mib": 64 if not quick else 16, "reps": 5}
    return {"width": 128, "tensors": 8, "tensor_mib": 4 if not quick else 1, "reps": 3}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _model(width: int, device: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),
        torch.nn.GELU(),
        torch.nn.LayerNorm(2 * width),
        torch.nn.Linear(2 * width, width),
    ).to(device)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, width: int) -> None:
    """One step whose batch depends only on ``step`` (identical in every process)."""
    device = next(model.parameters()).device
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(step)).to(device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _pair(width: int, device: str, seed: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    model = _model(width, device, seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _cpu_copy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _cpu_copy(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_cpu_copy(v) for v in state)
    return copy.deepcopy(state)


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two states differ, bit for bit (tensors compared on CPU as bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        x, y = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        return [] if same else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}/{i}")
        ]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _live_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        *model.state_dict().values(),
        *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)),
    ]


def check_inplace(device: str, width: int, root: Path) -> dict[str, Any]:
    """block=False save, the next step changes every tensor, in-place restore bit-exact."""
    model, opt = _pair(width, device, seed=0)
    for step in range(3):
        _train(model, opt, step, width)
    saved = _cpu_copy(_state(model, opt))
    with CheckpointManager(root / "inplace", compression="none") as mgr:
        handle = mgr.save(3, _state(model, opt), block=False)
        _train(model, opt, 3, width)  # no before_update(): the optimizer waits for the copy
        handle.wait()
        _train(model, opt, 4, width)
        before = [t.data_ptr() for t in _live_tensors(model, opt)]
        mgr.restore(into={"model": model, "optim": opt})
    diffs = _differences(_cpu_copy(_state(model, opt)), saved)
    in_place = [t.data_ptr() for t in _live_tensors(model, opt)] == before
    on_device = all(t.device.type == device for t in _live_tensors(model, opt))
    return {
        "ok": not diffs and in_place and on_device,
        "bit_exact": not diffs,
        "same_tensors": in_place,
        "on_device": on_device,
        "differences": diffs[:5],
    }


def child_train(directory: str, device: str, width: int) -> None:
    """The process killed by ``check_kill_resume``: trains and saves every step (block=False)."""
    model, opt = _pair(width, device, seed=0)
    with CheckpointManager(directory, compression="none", keep_last=2) as mgr:
        for step in range(1, TRAIN_STEPS + 1):
            _train(model, opt, step, width)
            handle = mgr.save(step, _state(model, opt), block=False)
            if step == KILL_AFTER_STEP - 1:
                handle.wait()  # at least this step is committed before the kill
            print(f"SAVED {step}", flush=True)
            time.sleep(0.05)
    print("DONE", flush=True)


def _reference(device: str, width: int) -> list[dict[str, Any]]:
    """The state after each step of a run that is never killed (index 0: the initial state)."""
    model, opt = _pair(width, device, seed=0)
    states = [_cpu_copy(_state(model, opt))]
    for step in range(1, TRAIN_STEPS + 1):
        _train(model, opt, step, width)
        states.append(_cpu_copy(_state(model, opt)))
    return states


def check_kill_resume(device: str, width: int, root: Path) -> dict[str, Any]:
    """SIGKILL the training child after step KILL_AFTER_STEP; resume bit-exact."""
    directory = root / "killed"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", str(directory)]
    cmd += ["--device", device, "--width", str(width)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen: list[str] = []
    watchdog = threading.Timer(CHILD_TIMEOUT_S, proc.kill)  # a child that hangs silently
    watchdog.start()
    for line in proc.stdout:
        seen.append(line.strip())
        if line.strip() == f"SAVED {KILL_AFTER_STEP}":
            break
    watchdog.cancel()
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    if f"SAVED {KILL_AFTER_STEP}" not in seen:
        return {"ok": False, "error": f"child never reached step {KILL_AFTER_STEP}: {err[-800:]}"}
    reference = _reference(device, width)
    model, opt = _pair(width, device, seed=1)  # another initialisation: all must be restored
    with CheckpointManager(directory) as mgr:
        mgr.restore(into={"model": model, "optim": opt})
        event = mgr.last_restore
        step = event.step if event is not None else -1
    restored_diffs = _differences(_cpu_copy(_state(model, opt)), reference[step])
    for s in range(step + 1, TRAIN_STEPS + 1):
        _train(model, opt, s, width)
    final_diffs = _differences(_cpu_copy(_state(model, opt)), reference[TRAIN_STEPS])
    return {
        "ok": proc.returncode == -signal.SIGKILL
        and step >= KILL_AFTER_STEP - 1
        and not restored_diffs
        and not final_diffs,
        "returncode": proc.returncode,
        "restored_step": step,
        "restored_bit_exact": not restored_diffs,
        "resumed_bit_exact": not final_diffs,
        "differences": (restored_diffs + final_diffs)[:5],
    }


def check_fsdp2(device: str, width: int, root: Path) -> dict[str, Any]:
    """An FSDP2 model + AdamW on a one-process mesh: saved, restored in place into another
    model's sharded state on the device, bit-exact, and the next step alike."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
        model = _model(width, device, seed)
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(model, opt, options=options)
        return _cpu_copy({"model": msd, "optim": osd})

    mesh = init_device_mesh(device, (1,))
    model, opt = sharded(seed=0)
    for step in range(3):
        _train(model, opt, step, width)
    msd, osd = get_state_dict(model, opt)
    placements = sorted({str(getattr(t, "placements", None)) for t in msd.values()})
    saved = full(model, opt)
    with CheckpointManager(
        root / "fsdp2", compression="none", group=RankGroup.from_torch_distributed()
    ) as mgr:
        mgr.save(3, {"model": msd, "optim": osd}, block=False).wait()
        # restored in place into the live sharded state of another model, on the device
        other, other_opt = sharded(seed=1)
        other_msd, other_osd = get_state_dict(other, other_opt)
        restored = mgr.restore(targets=InPlaceTargets({"model": other_msd, "optim": other_osd}))
        in_place = all(restored["model"][k] is v for k, v in other_msd.items())
    set_state_dict(
        other,
        other_opt,
        model_state_dict=restored["model"],
        optim_state_dict=restored["optim"],
    )
    diffs = _differences(full(other, other_opt), saved)
    _train(model, opt, 3, width)
    _train(other, other_opt, 3, width)
    step_diffs = _differences(full(other, other_opt), full(model, opt))
    return {
        "ok": not diffs and not step_diffs and in_place,
        "placements": placements,
        "restored_in_place": in_place,
        "bit_exact": not diffs,
        "next_step_bit_exact": not step_diffs,
        "differences": (diffs + step_diffs)[:5],
    }


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_stall(device: str, sizes: dict[str, int], root: Path) -> dict[str, Any]:
    """Seconds in save() against one D2H copy into pinned memory and DCP async_save."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    numel = sizes["tensor_mib"] * (1 << 20) // 4
    state = {f"w{i}": torch.randn(numel, device=device) for i in range(sizes["tensors"])}
    total = sum(t.numel() * t.element_size() for t in state.values())
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=device == "cuda")

    def copy_once() -> None:
        offset = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            pinned[offset : offset + n].view(t.dtype).copy_(t, non_blocking=True)
            offset += n
        _sync(device)

    def bump() -> None:
        for t in state.values():
            t.add_(1.0)  # a training step: every tensor is new
        _sync(device)

    reps = sizes["reps"]
    copy_s = [_timed(copy_once, device) for _ in range(reps + 1)][1:]
    coci: dict[str, list[float]] = {"block": [], "nonblock": [], "durable": []}
    with CheckpointManager(root / "stall", compression="none", keep_last=1) as mgr:
        for i in range(2 * reps + 2):
            bump()
            block = i % 2 == 0
            t0 = time.perf_counter()
            handle = mgr.save(i, state, block=block)
            stall = time.perf_counter() - t0
            handle.wait()
            if i >= 2:  # the first save of each kind allocates its buffers
                coci["block" if block else "nonblock"].append(stall)
                coci["durable"].append(time.perf_counter() - t0)
    dcp_s: list[float] = []
    for i in range(reps + 1):
        bump()
        t0 = time.perf_counter()
        pending = async_save(state, checkpoint_id=str(root / f"dcp-{i}"))
        blocking = time.perf_counter() - t0
        if isinstance(pending, AsyncSaveResponse):
            pending.upload_completion.result()
        else:
            pending.result()
        shutil.rmtree(root / f"dcp-{i}")
        if i:
            dcp_s.append(blocking)
    copy_limit = statistics.median(copy_s)
    block_s, nonblock_s = statistics.median(coci["block"]), statistics.median(coci["nonblock"])
    dcp_async = statistics.median(dcp_s)
    return {
        "bytes": total,
        "tensors": len(state),
        "reps": reps,
        "copy_limit_s": copy_limit,
        "copy_gb_s": total / copy_limit / 1e9,
        "coci_save_block_s": block_s,
        "coci_save_nonblock_s": nonblock_s,
        "coci_durable_s": statistics.median(coci["durable"]),
        "dcp_async_blocking_s": dcp_async,
        "block_vs_copy": block_s / copy_limit,
        "dcp_vs_nonblock": dcp_async / nonblock_s,
        "target_block_vs_copy_met": block_s <= STALL_TARGET * copy_limit,
        "target_dcp_vs_nonblock_met": dcp_async >= DCP_TARGET * nonblock_s,
    }


def _attempt(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` timed; an exception is reported as a failed result (the rest still run)."""
    t0 = time.perf_counter()
    try:
        res = {"ok": True, **fn(*args)}
    except Exception as e:
        tail = traceback.format_exc().strip().splitlines()[-6:]
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": tail}
    return {**res, "seconds": round(time.perf_counter() - t0, 2)}


@contextmanager
def _one_process_group(device: str) -> Iterator[None]:
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def report(res: dict[str, Any]) -> str:
    """The checks and the figures as a plain table."""
    lines = [f"gpu_check on {res['machine'].get('gpu', res['machine']['device'])}", ""]
    lines += ["| check | result | detail |", "|---|---|---|"]
    for name, check in res["checks"].items():
        hidden = ("ok", "differences", "traceback")
        detail = ", ".join(f"{k}={v}" for k, v in check.items() if k not in hidden)
        lines.append(f"| {name} | {'PASS' if check['ok'] else 'FAIL'} | {detail} |")
    s = res["stall"]
    if not s["ok"]:
        lines += ["", f"stall: NOT MEASURED: {s['error']}"]
    else:
        lines += ["", f"stall, {s['bytes'] / 2**20:.0f} MiB in {s['tensors']} tensors:", ""]
        lines += ["| measure | seconds | x copy limit |", "|---|---|---|"]
        for label, key in (
            ("D2H copy into pinned (limit)", "copy_limit_s"),
            ("coci save(block=True)", "coci_save_block_s"),
            ("coci save(block=False)", "coci_save_nonblock_s"),
            ("coci save to durable", "coci_durable_s"),
            ("DCP async_save blocking", "dcp_async_blocking_s"),
        ):
            lines.append(f"| {label} | {s[key]:.4f} | {s[key] / s['copy_limit_s']:.2f} |")
        lines += [
            "",
            f"target save(block=True) <= {STALL_TARGET}x copy limit: "
            f"{'met' if s['target_block_vs_copy_met'] else 'MISSED'} ({s['block_vs_copy']:.2f}x)",
            f"target save(block=False) >= {DCP_TARGET}x below DCP async_save: "
            f"{'met' if s['target_dcp_vs_nonblock_met'] else 'MISSED'} "
            f"({s['dcp_vs_nonblock']:.1f}x)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="smaller stall measurement")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON (default: temp)")
    ap.add_argument("--scratch", type=Path, default=None, help="folder for the checkpoints")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE.format(version=torch.__version__), file=sys.stderr)
        return 2
    sizes = _sizes(args.device, args.quick)
    if args.device == "cuda":  # the killed child and the reference run must compute alike
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.child is not None:
        child_train(args.child, args.device, args.width or sizes["width"])
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    checks: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-scratch-", dir=args.scratch) as scratch:
        root = Path(scratch)
        width = sizes["width"]
        checks["inplace"] = _attempt(check_inplace, args.device, width, root)
        checks["kill_resume"] = _attempt(check_kill_resume, args.device, width, root)
        with ExitStack() as group:
            try:
                group.enter_context(_one_process_group(args.device))
            except Exception as e:  # reported by the FSDP2 check; DCP may still run without it
                checks["fsdp2"] = {"ok": False, "error": f"process group: {type(e).__name__}: {e}"}
            else:
                checks["fsdp2"] = _attempt(check_fsdp2, args.device, width, root)
            stall = _attempt(measure_stall, args.device, sizes, root)
    res = {
        "machine": _machine(args.device),
        "quick": args.quick,
        "seconds": time.perf_counter() - started,
        "checks": checks,
        "stall": stall,
        "ok": all(c["ok"] for c in checks.values()) and stall["ok"],
    }
    path = out / f"gpu-check-{args.device}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=2, default=str))
    print(report(res))
    print(f"\nJSON: {path}")
    print("gpu_check: all checks passed" if res["ok"] else "gpu_check: CHECKS FAILED")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
