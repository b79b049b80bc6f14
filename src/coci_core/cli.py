"""The ``coci`` command line: ls, verify, export, import, report, demo (and plan, simulate from
the planner)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coci_core.errors import CociError, CorruptCheckpointError, NoCheckpointError
from coci_core.foreign import read_foreign  # also coci_core.cli.read_foreign, as before
from coci_core.manifest import MANIFEST_NAME, step_dir_name
from coci_core.restore import committed_steps, load_checkpoint, read_manifest, verify_checkpoint
from coci_core.storage import open_storage

__all__ = ["main"]


def _ls(args: argparse.Namespace) -> int:
    storage = open_storage(args.dir)
    steps = committed_steps(storage)
    if not steps:
        print(f"no committed checkpoints in {storage.url}")
        return 1
    print(f"{'step':>10}  {'size':>12}  {'ratio':>6}  {'tensors':>7}  {'created':<19}  codec")
    for step in steps:
        try:
            m = read_manifest(storage, step)
        except NoCheckpointError:
            continue  # removed (by retention) since it was listed
        except CorruptCheckpointError as e:
            if not storage.exists(f"{step_dir_name(step)}/{MANIFEST_NAME}"):
                continue  # removed while it was being read: gone, not damaged
            print(f"{step:>10}  damaged manifest: {e}")
            continue
        codecs = (
            ",".join(
                sorted(
                    {
                        str(p.params["codec"]) if p.params else t.codec
                        for t in m.tensors
                        for p in t.pieces
                    }
                )
            )
            or "-"
        )
        raw = sum(t.raw_nbytes for t in m.tensors)
        ratio = f"{raw / m.nbytes:.2f}x" if m.nbytes else "-"
        created = _time(m.created_unix)
        bases = f"  (delta of {', '.join(map(str, m.bases))})" if m.bases else ""
        print(
            f"{step:>10}  {_size(m.nbytes):>12}  {ratio:>6}  {len(m.tensors):>7}  {created}  "
            f"{codecs}{bases}"
        )
    return 0


def _time(unix: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))
    except (OverflowError, OSError, ValueError):
        return f"{'?':<19}"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def _verify(args: argparse.Namespace) -> int:
    storage = open_storage(args.dir)
    steps = [args.step] if args.step is not None else committed_steps(storage)
    if not steps:
        print(f"no committed checkpoints in {storage.url}")
        return 1
    damaged = 0
    for step in steps:
        reasons: list[str] = []

        def report(key: str, why: str, reasons: list[str] = reasons) -> None:
            reasons.append(f"  damaged: {key}: {why}")

        try:
            bad = verify_checkpoint(storage, step, on_bad=report)
        except NoCheckpointError as e:
            # A step listed here and then removed (retention) is gone, not damaged; a step
            # asked for by --step that is not there is an error.
            gone = "removed while verifying (not damaged)"
            print(f"step {step}: {gone if args.step is None else e}")
            damaged += args.step is not None
            continue
        except CorruptCheckpointError as e:
            print(f"step {step}: {e}")
            damaged += 1
            continue
        for line in reasons:
            print(line)
        print(f"step {step}: {'ok' if not bad else f'{len(bad)} damaged: ' + ', '.join(bad)}")
        damaged += bool(bad)
    return 1 if damaged else 0


def _export(args: argparse.Namespace) -> int:
    import torch

    storage = open_storage(args.dir)
    step = args.step if args.step is not None else max(committed_steps(storage), default=None)
    if step is None:
        raise NoCheckpointError(f"no committed checkpoints in {storage.url}")
    state = load_checkpoint(storage, step, rank=args.rank).state
    out = Path(args.out)
    fmt = args.format
    if fmt == "auto":
        fmt = "safetensors" if out.suffix == ".safetensors" else "torch"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        tensors, rest = _split_for_safetensors(state)
        save_file(
            tensors, str(out), metadata={"coci_step": str(step), "coci_rest": json.dumps(rest)}
        )
        print(f"exported step {step}: {len(tensors)} tensors to {out} (safetensors)")
    elif fmt == "dcp":
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(state, checkpoint_id=str(out), no_dist=True)
        print(f"exported step {step} to {out} (torch.distributed.checkpoint)")
    else:
        torch.save(state, out)
        print(f"exported step {step} to {out} (torch.save)")
    return 0


def _import(args: argparse.Namespace) -> int:
    from coci_core.manager import CheckpointManager

    state = read_foreign(Path(args.src))
    with CheckpointManager(args.dir, keep_last=None) as mgr:
        mgr.save(args.step, state).wait()
    print(f"imported {args.src} into {args.dir} as step {args.step}")
    return 0


def _split_for_safetensors(state: Any) -> tuple[dict[str, Any], Any]:
    import torch

    tensors: dict[str, Any] = {}

    def walk(value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[key] = value.contiguous()
            return {"tensor": key}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{key}.{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return repr(value)

    rest = walk(state, "")
    return tensors, rest


def _report(args: argparse.Namespace) -> int:
    from coci_core.report import render, summarize

    try:
        summary = summarize(args.dir)
    except FileNotFoundError as e:
        print(f"coci: {e}", file=sys.stderr)
        return 1
    tb = Path(args.dir) / "tensorboard"
    print(render(summary, tensorboard_dir=args.tensorboard or (str(tb) if tb.is_dir() else None)))
    return 0


def _demo(args: argparse.Namespace) -> int:
    if not args.engine:
        try:
            from coci_lightning.demo import run as lightning_demo
        except ImportError:
            print(
                "coci demo: Lightning is not installed (pip install 'coci[demo]'); "
                "running the engine-only demo"
            )
        else:
            return lightning_demo(args)
    from coci_core.demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``coci`` argument parser."""
    parser = argparse.ArgumentParser(prog="coci", description="coci checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list committed checkpoints")
    p.add_argument("dir")
    p.set_defaults(func=_ls)
    p = sub.add_parser("verify", help="check every checksum (exit 1 on damage)")
    p.add_argument("dir")
    p.add_argument("--step", type=int)
    p.set_defaults(func=_verify)
    p = sub.add_parser(
        "export", help="write a step as a torch.save file, a .safetensors file or a DCP directory"
    )
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p.add_argument(
        "--format",
        choices=("auto", "torch", "safetensors", "dcp"),
        default="auto",
        help="auto: safetensors for a .safetensors name, else torch.save",
    )
    p.add_argument(
        "--rank", type=int, default=0, help="whose per-rank state (random states) to include"
    )
    p.set_defaults(func=_export)
    p = sub.add_parser(
        "import", help="save a torch.save / .safetensors file or a DCP directory as a coci step"
    )
    p.add_argument("src")
    p.add_argument("dir")
    p.add_argument("--step", type=int, required=True)
    p.set_defaults(func=_import)
    p = sub.add_parser("report", help="what a run's checkpoints cost, planned vs actual")
    p.add_argument("dir")
    p.add_argument("--tensorboard", help="the TensorBoard log directory to point to")
    p.set_defaults(func=_report)
    p = sub.add_parser("demo", help="kill a training run mid-persist and resume it exactly")
    p.add_argument(
        "--engine",
        action="store_true",
        help="the engine-only demo (no Lightning): kill inside a persist",
    )
    p.add_argument("--dir", help="run directory (default: a new temporary one)")
    p.add_argument("--total-steps", type=int, help="training steps")
    p.add_argument("--kill-step", type=int, help="the step at which the run is killed")
    p.add_argument("--save-every", type=int, default=25, help="(engine demo) save interval")
    p.add_argument("--seed", type=int, help="seed of the random kill step")
    p.set_defaults(func=_demo)
    try:
        from coci_core.planner.cli import (  # type: ignore[import-not-found,unused-ignore]
            add_subcommands,
        )
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``coci``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CociError as e:
        print(f"coci: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
