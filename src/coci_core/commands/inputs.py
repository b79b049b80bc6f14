"""What the ``coci`` subcommands check of their input before they read anything: the
directories given, where an export or a plot is written. A failed check is :class:`BadInput`
(one line on stderr, exit code 2)."""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from typing import Any

from coci_core.interop.swap import EXPORT_MARKS, not_an_earlier_export

__all__ = [
    "ADAPTER_EXPORTS",
    "PLOT_FORMATS",
    "BadInput",
    "check_export_target",
    "check_plot_target",
    "checkpoint_dir",
    "no_checkpoints",
    "open_storage",
    "remote_dir",
]

ADAPTER_EXPORTS = ("transformers",)  # the formats an adapter writes (`--format` choices)


class BadInput(Exception):
    """The command line or its input is unusable: one line on stderr, exit code 2."""


def open_storage(target: str) -> Any:
    """:func:`coci_core.storage.open_storage`, imported when a subcommand runs."""
    from coci_core.storage import open_storage as open_

    return open_(target)


def checkpoint_dir(target: str) -> Any:
    """The storage of an existing checkpoint directory (a local one must exist)."""
    from coci_core.errors import ConfigError
    from coci_core.storage import is_url

    if not target.strip():
        raise BadInput("the directory is empty: give a checkpoint directory or URL")
    if not is_url(target):
        path = Path(target)
        if not path.exists():
            raise BadInput(f"{target}: the directory does not exist")
        if not path.is_dir():
            raise BadInput(f"{target}: not a directory")
    try:
        return open_storage(target)
    except ConfigError as e:  # an unknown URL scheme, ...
        raise BadInput(f"{target}: {e}") from e


def no_checkpoints(storages: list[Any]) -> str:
    """ "no committed checkpoints in DIR", and where they may be instead: DIR is one step's
    directory, or a folder below it holds checkpoints (an adapter's ``coci`` folder)."""
    from coci_core.engine.format.manifest import parse_step_version

    said = f"no committed checkpoints in {' or '.join(str(s.url) for s in storages)}"
    root = storages[0].local_root()
    if root is None:
        return said
    path = Path(root)
    if parse_step_version(path.name) is not None:
        return (
            f"{said}: {path.name} is one checkpoint; give the directory holding it, {path.parent}"
        )
    try:
        with os.scandir(path) as listing:
            entries = list(itertools.islice(listing, _LOOKED_AT))
        children = sorted(Path(e.path) for e in entries if e.is_dir())
        for child in sorted(children, key=lambda c: c.name != "coci"):  # coci's default first
            with os.scandir(child) as inner:
                names = [e.name for e in itertools.islice(inner, _LOOKED_AT)]
            if any(parse_step_version(n) is not None for n in names):
                return f"{said}; did you mean {child}? (it holds checkpoints)"
    except OSError:
        pass
    return said


# the most folders (and entries of each) looked at for a hint
_LOOKED_AT = 200


def remote_dir(args: argparse.Namespace) -> Any:
    """The storage of ``--remote`` (a second tier; a local one must exist), or None."""
    if args.remote is None:
        return None
    try:
        return checkpoint_dir(args.remote)
    except BadInput as e:
        raise BadInput(f"--remote {e}") from None


PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def check_plot_target(out: Path) -> None:
    """``--plot``: a file whose suffix names an image format, in a directory that exists."""
    if out.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise BadInput(
            f"--plot {out}: the file's suffix names its format, one of "
            f"{', '.join('.' + f for f in PLOT_FORMATS)}"
        )
    if out.is_dir() or not out.parent.is_dir():
        raise BadInput(f"--plot {out}: give a file in a directory that exists")


def check_export_target(out: Path, fmt: str) -> None:
    """Refuse an OUT that the export would replace but is not what it writes: the file is
    written beside OUT and renamed over it, which would replace a device, a FIFO or a link."""
    if out.is_symlink():
        raise BadInput(f"{out} is a symbolic link: give the path it points to")
    if not out.exists():
        return
    directory = fmt in ("dcp", *ADAPTER_EXPORTS)
    if directory and not out.is_dir():
        raise BadInput(f"{out} exists and is not a directory: --format {fmt} writes a directory")
    why = not_an_earlier_export(out, fmt) if fmt in EXPORT_MARKS else None
    if why is not None:  # the export replaces OUT whole: never a directory of other files
        raise BadInput(
            f"{why}: --format {fmt} replaces the directory whole; give a new or empty one"
        )
    if not directory and not out.is_file():
        raise BadInput(
            f"{out} exists and is not a regular file: coci export writes a file and would "
            "replace it"
        )
