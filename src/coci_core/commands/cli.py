"""The ``coci`` command line: ls, verify, export, import, report, demo, plan and simulate (the
last two from the planner).

Exit codes: 0 done; 1 the checkpoints have a problem (none committed, damage found, a failed
save); 2 the command line or its input is unusable (a missing directory or file, a file that
is not a checkpoint or is damaged, a file import refuses because loading it would run code, a
step that is not there, a step import would overwrite without ``--force``); 141 the reader of
the output went away (``coci report DIR | head``), quietly. Errors are one line on stderr, never
a traceback.

Building the parser imports nothing heavy (no torch, numpy, scipy): each subcommand imports
what it needs when it runs, so ``coci --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from coci_core.commands.inputs import (
    ADAPTER_EXPORTS,
    BadInput,
    check_export_target,
    check_plot_target,
    checkpoint_dir,
    no_checkpoints,
    remote_dir,
)

__all__ = ["build_parser", "main"]


def __getattr__(name: str) -> Any:
    # coci_core.commands.cli.read_foreign, as before, without importing torch with the module
    if name == "read_foreign":
        from coci_core.interop.foreign import read_foreign

        return read_foreign
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are a one-line :class:`BadInput` (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{self.prog}: {message} (see {self.prog} --help)")


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {text!r}") from None
    if not 0 <= step <= (1 << 63) - 1:  # a checkpoint's steps (MAX_STEP); no torch import here
        raise argparse.ArgumentTypeError(f"a step is an integer in [0, 2**63-1]: {text!r:.60}")
    return step


def _checkpoint_ref(text: str) -> int | str:
    """A step number, or a step directory's name (``step-0000000004-v1``: a checkpoint saved
    beside another run's of the same step)."""
    from coci_core.engine.format.manifest import parse_step_version

    if text.startswith("step-"):
        if parse_step_version(text) is None:
            raise argparse.ArgumentTypeError(f"not a step directory's name: {text!r}")
        return text
    return _step(text)


def _ls(args: argparse.Namespace) -> int:
    from coci_core.engine.restore.restore import committed_dirs, resume_step
    from coci_core.errors import CorruptCheckpointError, NoCheckpointError

    storage = checkpoint_dir(args.dir)
    remote = remote_dir(args)
    tiers = [("local", storage)] + ([("remote", remote)] if remote is not None else [])
    listed = [(tier, tier_storage, committed_dirs(tier_storage)) for tier, tier_storage in tiers]
    if not any(steps for _, _, steps in listed):
        print(f"coci: {no_checkpoints([s for _, s in tiers])}", file=sys.stderr)
        return 1
    # the step a resume takes, decided as restore decides it (the newer ones found damaged)
    damaged: dict[tuple[str, int, int], str] = {}

    def note(candidate: Any, error: CorruptCheckpointError) -> None:
        damaged[(candidate.tier, candidate.step, candidate.info.version)] = _one_line(error)

    resume: tuple[str, int, int] | None = None
    try:
        point = resume_step(storage, remote=remote, on_damaged=note)
        resume = (point.tier, point.step, point.candidate.info.version)
    except (NoCheckpointError, CorruptCheckpointError):
        pass
    tier_column = f"{'tier':<6}  " if remote is not None else ""
    print(
        f"{tier_column}{'step':>10}  {'size':>12}  {'ratio':>6}  {'tensors':>7}  "
        f"{'created':<19}  {'run':<8}  codec"
    )
    for tier, tier_storage, steps in listed:
        prefix = f"{tier:<6}  " if remote is not None else ""
        for step, version in steps:
            key = (tier, step, version)
            row = _ls_row(tier_storage, step, version, damaged.get(key), key == resume)
            if row is not None:
                print(prefix + row)
    if resume is None:
        print("no intact checkpoint: a resume fails (see coci verify)")
        return 1
    return 0


def _ls_row(storage: Any, step: int, version: int, damage: str | None, resumes: bool) -> str | None:
    """The line of ``step`` (its directory of ``version``) in ``coci ls``, or None when it was
    removed meanwhile. A checkpoint saved beside another run's of the same step shows its
    version: ``4-v1`` (the directory ``step-0000000004-v1``)."""
    from coci_core.engine.format.manifest import MANIFEST_NAME, step_dir_name
    from coci_core.engine.restore.restore import read_manifest
    from coci_core.errors import CorruptCheckpointError, NoCheckpointError

    shown = str(step) if version == 0 else f"{step}-v{version}"
    try:
        m = read_manifest(storage, step, version)
    except NoCheckpointError:
        return None  # removed (by retention) since it was listed
    except CorruptCheckpointError as e:
        if not storage.exists(f"{step_dir_name(step, version)}/{MANIFEST_NAME}"):
            return None  # removed while it was being read: gone, not damaged
        return f"{shown:>10}  damaged manifest: {_one_line(e)}"
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
    # the tensors' bytes over their stored pieces: a raw checkpoint is 1.00x (its files also
    # hold padding and non-tensor objects, which no codec touches)
    raw, stored = sum(t.raw_nbytes for t in m.tensors), sum(t.nbytes for t in m.tensors)
    ratio = f"{raw / stored:.2f}x" if stored else "-"
    created = _time(m.created_unix)
    # its files: the data and the manifest (the bytes its save wrote, as coci report and the
    # end-of-training line count them)
    try:
        size = m.nbytes + (storage.size(f"{step_dir_name(step, version)}/{MANIFEST_NAME}") or 0)
    except OSError:  # a StorageError too: removed meanwhile, its data is most of it
        size = m.nbytes
    bases = f"  (delta of {', '.join(map(str, m.bases))})" if m.bases else ""
    mark = "  <- a resume takes this one" if resumes else ""
    if damage is not None:
        mark = f"  damaged, a resume skips it: {damage}"
    return (
        f"{shown:>10}  {_size(size):>12}  {ratio:>6}  {len(m.tensors):>7}  {created}  "
        f"{m.run[:8]:<8}  {codecs}{bases}{mark}"
    )


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
    from coci_core.engine.restore.restore import committed_dirs

    storage = checkpoint_dir(args.dir)
    remote = remote_dir(args)
    tiers = [("", storage)] + ([("remote ", remote)] if remote is not None else [])
    if args.step is not None and remote is not None:
        # the tier that holds the step (both, when both do)
        held = [(tier, s) for tier, s in tiers if _holds(args.step, committed_dirs(s))]
        tiers = held or tiers[:1]  # neither: the local tier says it is missing
    found, damaged = 0, 0
    for tier, tier_storage in tiers:
        tier_found, tier_damaged = _verify_tier(tier_storage, args.step, tier)
        found += tier_found
        damaged += tier_damaged
    if not found:
        print(f"coci: {no_checkpoints([s for _, s in tiers])}", file=sys.stderr)
        return 1
    return 1 if damaged else 0


def _with_steps(error: Exception, dirs: list[tuple[int, int]]) -> str:
    """``error``'s message, with the newest steps the directory does hold."""
    shown = ", ".join(map(str, sorted({s for s, _ in dirs})[-10:])) or "none"
    return f"{error} (its steps: {shown})"


def _check_step_held(
    ref: int | str | None,
    storage: Any,
    dirs: list[tuple[int, int]],
    remote_dirs: list[tuple[int, int]] | None = None,
) -> None:
    """A ``--step`` that neither tier holds is a wrong input (exit code 2), said with the
    local directory's newest steps; a directory with no checkpoint is left to the command."""
    from coci_core.engine.format.manifest import step_dir_name

    every = [*dirs, *(remote_dirs or [])]
    refs = {r for s, v in every for r in (s, step_dir_name(s, v))}
    if ref is not None and every and ref not in refs:
        shown = ", ".join(map(str, sorted({s for s, _ in dirs})[-10:])) or "none"
        raise BadInput(f"step {ref} is not committed in {storage.url} (its steps: {shown})")


def _holds(ref: int | str, dirs: list[tuple[int, int]]) -> bool:
    """Whether committed step directories ``dirs`` hold ``ref`` (a step or a directory's name)."""
    from coci_core.engine.format.manifest import step_dir_name

    return any(ref in (s, step_dir_name(s, v)) for s, v in dirs)


def _verify_tier(storage: Any, ref: int | str | None, tier: str) -> tuple[int, int]:
    """Verify ``ref`` (None: every committed checkpoint) in one tier, a line each (prefixed
    with ``tier``, "" for the local one); the checkpoints verified and those found damaged."""
    from coci_core.engine.restore.restore import (
        StepInfo,
        checkpoint_storage,
        committed_dirs,
        find_checkpoint,
        step_infos,
        verify_checkpoint,
    )
    from coci_core.errors import CorruptCheckpointError, NoCheckpointError

    dirs = committed_dirs(storage)
    if ref is not None:
        try:
            chosen = [find_checkpoint(storage, ref)]
        except NoCheckpointError as e:
            raise BadInput(_with_steps(e, dirs)) from e
    else:
        chosen = [StepInfo(s, "", 0.0, intact=True, version=v) for s, v in dirs]
    # each run's versioned directories (the bases of its deltas), read only when there are any
    infos = step_infos(storage) if any(v for _, v in dirs) else []
    runs = {(i.step, i.version): i for i in infos}
    damaged = 0
    for info in chosen:
        step = info.step
        label = tier + (f"step {step}" if info.version == 0 else info.name)
        where = checkpoint_storage(storage, runs.get((step, info.version), info), infos)
        reasons: list[str] = []

        def report(key: str, why: str, step: int = step, reasons: list[str] = reasons) -> None:
            # the reason names the step and the key again: say each once
            why = why.removeprefix(f"step {step}: ").replace(f" in {key!r}", "")
            reasons.append(f"  damaged {key}: {why}")

        try:
            bad = verify_checkpoint(where, step, on_bad=report)
        except NoCheckpointError as e:
            if ref is not None:
                raise BadInput(_with_steps(e, dirs)) from e
            # listed here and then removed (retention): gone, not damaged
            print(f"{label}: removed while verifying (not damaged)")
            continue
        except CorruptCheckpointError as e:
            print(f"{label}: {e}")
            damaged += 1
            continue
        for line in reasons:
            print(line)
        print(f"{label}: {'ok' if not bad else f'{len(bad)} damaged'}")
        damaged += bool(bad)
    return len(chosen), damaged


def _export(args: argparse.Namespace) -> int:
    from coci_core.engine.restore.restore import committed_dirs, restore_newest
    from coci_core.errors import CociError, NoCheckpointError
    from coci_core.interop.exchange import export_state, require_safetensors

    storage = checkpoint_dir(args.dir)
    remote = remote_dir(args)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise BadInput(f"{args.out}: the directory {out.parent} does not exist")
    if args.rank < 0:
        raise BadInput(f"--rank must be 0 or more, got {args.rank}")
    fmt = args.format
    check_export_target(out, fmt)
    if args.weights_only and fmt not in ("auto", "torch", "safetensors"):
        raise BadInput(
            f"--weights-only writes a .safetensors or torch.save file, not --format {fmt}"
        )
    if fmt in ADAPTER_EXPORTS:  # an adapter's own layout, written by the adapter
        if remote is not None:
            raise BadInput(f"--format {fmt} reads the local directory only: leave out --remote")
        exporter = adapter_exporter(fmt)
        if exporter is None:
            raise BadInput(
                f"--format {fmt} is written by coci_{fmt}, which is not installed "
                f"(pip install 'coci[{fmt}]')"
            )
        from coci_core.errors import ConfigError

        _check_step_held(args.step, storage, committed_dirs(storage))
        try:
            print(exporter(args.dir, out, args.step))
        except ConfigError as e:  # not this adapter's checkpoint: the input is wrong
            raise BadInput(str(e)) from e
        return 0
    if fmt == "auto":
        fmt = "safetensors" if out.suffix == ".safetensors" else "torch"
    if fmt == "safetensors":
        try:  # before anything is read: a missing package is one line naming the install
            require_safetensors(f"writing {args.out}")
        except CociError as e:
            raise BadInput(str(e)) from e
    dirs = committed_dirs(storage)
    remote_dirs = committed_dirs(remote) if remote is not None else []
    if not dirs and not remote_dirs:
        raise NoCheckpointError(no_checkpoints([storage] if remote is None else [storage, remote]))
    _check_step_held(args.step, storage, dirs, remote_dirs)
    # without --step: the step a resume takes (past damaged newer ones), as restore picks it
    loaded, _ = restore_newest(storage, args.step, rank=args.rank, remote=remote)
    if not loaded.rank_state_restored and not args.weights_only:  # weights are not per rank
        raise BadInput(
            f"--rank {args.rank}: step {loaded.step} holds no per-rank state of that rank (it "
            "was written by fewer ranks); give one of its ranks"
        )
    if args.weights_only:
        from coci_core.interop.weights import export_weights

        print(export_weights(loaded.state, out, fmt, loaded.step))
        return 0
    print(export_state(loaded.state, out, fmt, loaded.step))
    return 0


def _import(args: argparse.Namespace) -> int:
    from coci_core.engine.manager import CheckpointManager
    from coci_core.errors import CociError
    from coci_core.interop.foreign import read_foreign_with_step

    try:
        state, recorded = read_foreign_with_step(Path(args.src))
    except CociError as e:
        # missing, not a checkpoint, damaged, or refused because loading it would run code
        # from the file (UnsafeCheckpointError): not something to import
        raise BadInput(str(e)) from e
    step = args.step if args.step is not None else recorded if recorded is not None else 0
    with CheckpointManager(args.dir, keep_last=None, allow_torch_save=args.allow_torch_save) as mgr:
        mgr.claim()  # held before the check: of two imports of one step, one is refused
        if step in mgr.steps() and not args.force:
            raise BadInput(f"step {step} already exists in {args.dir}: pass --force to replace it")
        mgr.save(step, state, overwrite=bool(args.force)).wait()
    print(f"imported {args.src} into {args.dir} as step {step}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from coci_core.telemetry.report import render, summarize
    from coci_core.telemetry.timeline import tensorboard_log_dir

    checkpoint_dir(args.dir)
    if args.plot:
        check_plot_target(Path(args.plot))
    try:
        summary = summarize(args.dir)
    except FileNotFoundError as e:
        print(f"coci: {e}", file=sys.stderr)
        return 1
    tb = None if "://" in args.dir else Path(args.dir) / "tensorboard"
    tb_dir = str(tb) if tb is not None and tb.is_dir() else tensorboard_log_dir(args.dir)
    print(render(summary, tensorboard_dir=args.tensorboard or tb_dir))
    if args.plot:
        from coci_core.telemetry.plot import plot_timeline
        from coci_core.telemetry.timeline import from_summary

        plot_timeline(from_summary(summary, args.dir), args.plot)
        print(f"timeline drawn to {args.plot}")
    return 0


DEMO_ENTRY_POINTS = "coci.demos"  # adapters register their demo here (pyproject.toml)
EXPORT_ENTRY_POINTS = "coci.exports"  # adapters register their export format here


def adapter_exporter(fmt: str) -> Callable[[str, Path, int | None], str] | None:
    """The exporter an adapter registered for ``fmt`` (entry point group ``coci.exports``):
    ``(directory, out, step) -> summary``; None when that adapter is not installed."""
    from importlib.metadata import entry_points

    for entry in entry_points(group=EXPORT_ENTRY_POINTS, name=fmt):
        try:
            exporter: Callable[[str, Path, int | None], str] = entry.load()
        except ImportError:
            return None
        return exporter
    return None


def _demo(args: argparse.Namespace) -> int:
    if not args.engine:
        from importlib.metadata import entry_points

        for entry in entry_points(group=DEMO_ENTRY_POINTS, name="lightning"):
            try:
                adapter_demo = entry.load()
            except ImportError:
                print(
                    "coci demo: Lightning is not installed (pip install 'coci[demo]'); "
                    "running the engine-only demo"
                )
            else:
                return int(adapter_demo(args))
    from coci_core.commands.demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``coci`` argument parser (imports nothing heavy)."""
    parser = _Parser(
        prog="coci",
        description="coci checkpoints: list, verify, export, import, report, demo, plan, simulate",
        epilog="exit codes: 0 done, 1 a checkpoint problem, 2 bad command line or input",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dir_help = "the checkpoint directory (a path or an fsspec URL)"
    remote_help = (
        "a remote tier of DIR (a path or an fsspec URL, as CheckpointManager's remote=): "
        "its steps count too"
    )
    p = sub.add_parser(
        "ls",
        help="list committed checkpoints",
        description="List the committed checkpoints of DIR (and of its remote tier): step, size, "
        "compression ratio, tensors, when, which run, codec; marks the one a resume takes.",
    )
    p.add_argument("dir", metavar="DIR", help=dir_help)
    p.add_argument("--remote", metavar="URL", help=remote_help)
    p.set_defaults(func=_ls)
    p = sub.add_parser(
        "verify",
        help="check every checksum (exit 1 on damage)",
        description="Read every committed checkpoint of DIR (and of its remote tier) and check "
        "each piece's checksum; one line per checkpoint, one per damaged tensor. Exit 1 on "
        "damage.",
    )
    p.add_argument("dir", metavar="DIR", help=dir_help)
    p.add_argument(
        "--remote",
        metavar="URL",
        help="a remote tier of DIR (a path or an fsspec URL, as CheckpointManager's remote=): "
        "its checkpoints are verified too",
    )
    p.add_argument(
        "--step",
        type=_checkpoint_ref,
        help="verify only this step (its newest checkpoint) or step directory (default: all)",
    )
    p.set_defaults(func=_verify)
    p = sub.add_parser(
        "export",
        help="write a step as a torch.save file, a .safetensors file or a DCP directory",
        description="Write a step as a torch.save file (loads with plain torch.load), a "
        ".safetensors file or a torch.distributed.checkpoint directory; each keeps a note "
        "with which `coci import` rebuilds the exact state.",
    )
    p.add_argument("dir", metavar="DIR", help=dir_help)
    p.add_argument("out", metavar="OUT", help="the file (or DCP directory) to write")
    p.add_argument(
        "--step",
        type=_checkpoint_ref,
        help="a step (its newest checkpoint) or a step directory's name; default: the step a "
        "resume takes (the newest intact one of the newest run)",
    )
    p.add_argument("--remote", metavar="URL", help=remote_help)
    p.add_argument(
        "--format",
        choices=("auto", "torch", "safetensors", "dcp", *ADAPTER_EXPORTS),
        default="auto",
        help="auto: safetensors for a .safetensors name, else torch.save; transformers: a "
        "CociCallback step as the Trainer's checkpoint-N directory (OUT)",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=0,
        help="whose per-rank state (random states) to include (default: 0)",
    )
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="write the model's weights alone, keyed as its state_dict() (a LightningModule's, "
        "the state's 'model', Accelerate's one model): model.load_state_dict(load_file(OUT)) "
        "reads it; no note, so `coci import` cannot resume from it",
    )
    p.set_defaults(func=_export)
    p = sub.add_parser(
        "import",
        help="save a torch.save / .safetensors file or a DCP directory as a coci step",
        description="Save a torch.save file, a .safetensors file or a "
        "torch.distributed.checkpoint directory into DIR as a coci step (a file `coci export` "
        "wrote comes back as the exact state it held).",
    )
    p.add_argument(
        "src", metavar="SRC", help="a torch.save file, a .safetensors file or a DCP directory"
    )
    p.add_argument("dir", metavar="DIR", help="the checkpoint directory to save into")
    p.add_argument(
        "--step",
        type=_step,
        help="the step to save it as (default: the step `coci export` recorded in SRC, else 0)",
    )
    p.add_argument("--force", action="store_true", help="replace the step if DIR has it")
    p.add_argument(
        "--allow-torch-save",
        action="store_true",
        help="keep values coci cannot store as data (sets, custom classes torch.load "
        "allows) as torch.save'd leaves, read back with weights_only=True",
    )
    p.set_defaults(func=_import)
    p = sub.add_parser(
        "report",
        help="what a run's checkpoints cost, planned vs actual",
        description="What a run's checkpoints cost, from the telemetry its adapter wrote: the "
        "plan, the saves taken, stalls, failures, lost work, restores.",
    )
    p.add_argument(
        "dir",
        metavar="DIR",
        help="a run's checkpoint directory with telemetry (a path or an fsspec URL)",
    )
    p.add_argument("--tensorboard", help="the TensorBoard log directory to point to")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw the run's timeline (TensorBoard's coci tab) with matplotlib",
    )
    p.set_defaults(func=_report)
    p = sub.add_parser(
        "demo",
        help="kill a small training run and resume it bit-identically",
        description="Train a small model with Lightning and CociCheckpoint, kill the process "
        "(SIGKILL) at a step, resume it and check that the resumed run matches an uninterrupted "
        "one bit for bit; then report what the checkpoints cost. --engine: the engine alone "
        "(no Lightning), killed in the middle of a save.",
    )
    p.add_argument(
        "--engine",
        action="store_true",
        help="the engine-only demo (no Lightning): kill inside a persist",
    )
    p.add_argument("--dir", help="run directory (default: a new temporary one)")
    p.add_argument("--total-steps", type=int, help="training steps")
    p.add_argument(
        "--kill-step",
        type=int,
        help="the step at which the run is killed (or just after its first committed "
        "checkpoint, if none is by then)",
    )
    p.add_argument("--save-every", type=int, default=25, help="(engine demo) save interval")
    p.add_argument("--seed", type=int, help="seed of the random kill step")
    p.set_defaults(func=_demo)
    from coci_core.commands.plan import add_subcommands

    add_subcommands(sub)
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


#: the exit code of a command whose reader went away (``coci report | head``): a shell's for a
#: process killed by SIGPIPE (128 + 13)
BROKEN_PIPE_EXIT = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``coci``; returns the exit code (0 done, 1 a checkpoint problem, 2 bad input; 141
    when the reader of its output went away, as ``head`` does, quietly)."""
    try:
        try:
            return _main(argv)
        finally:  # its --help's SystemExit too: flush here, where a closed pipe can be caught
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented way: whatever is left to flush goes to devnull, so that the
        # interpreter's own flush at exit prints no "Exception ignored ... BrokenPipeError"
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_EXIT


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except BadInput as e:
        print(_one_line(e), file=sys.stderr)
        return 2
    from coci_core.errors import CociError

    try:
        return int(args.func(args))
    except BadInput as e:
        print(f"coci: {_one_line(e)}", file=sys.stderr)
        return 2
    except CociError as e:
        print(f"coci: {_one_line(e)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # the reader went away: main says nothing
    except OSError as e:  # the disk, permissions: not a bug in coci
        print(f"coci: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
