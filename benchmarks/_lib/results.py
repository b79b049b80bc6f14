"""Result files (``benchmarks/results/<name>-<time>.json``, not in git) and timestamped logs."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

RESULTS = Path(__file__).resolve().parent.parent / "results"


def stamp() -> str:
    """The UTC time as in result file names: ``20260101T120000Z``."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def results_path(name: str, out_dir: str | Path | None = None) -> Path:
    """``<out_dir or benchmarks/results>/<name>-<time>.json``, its directory created."""
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}-{stamp()}.json"


def write_json(path: Path, res: Any) -> None:
    path.write_text(json.dumps(res, indent=1, default=str))


def command() -> str:
    """This run's command line, as a user would type it (no paths of this machine)."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None else "python " + Path(sys.argv[0]).name
    return " ".join([program, *sys.argv[1:]])


def log(msg: str, file: TextIO | None = None) -> None:
    """``[HH:MM:SS] msg``, flushed (to stdout unless ``file``)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=file or sys.stdout, flush=True)


def run_recorded(
    name: str,
    run: Callable[[Path], dict[str, Any]],
    *,
    scratch_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
) -> tuple[dict[str, Any], Path]:
    """``run(scratch)`` in a temporary directory (under ``scratch_dir``), its result recorded
    with the command and the machine's load before it in ``<out_dir>/<name>-<time>.json``;
    the result and that path."""
    from benchmarks._lib.machine import uptime

    load = uptime()
    with tempfile.TemporaryDirectory(prefix=f"coci-{name}-", dir=scratch_dir) as tmp:
        result = run(Path(tmp))
    result.update(command=command(), uptime_before=load)
    path = results_path(name, out_dir)
    write_json(path, result)
    return result, path
