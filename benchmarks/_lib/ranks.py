"""Running a benchmark's ranks: ``world`` processes of one module on this machine (gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository: ``-m`` finds ``benchmarks``


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(module: str, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``python -m module --rank-config <cfg>`` as ``world`` ranks; every rank's samples
    (each prints ``SAMPLES <json list>``), in rank order.

    Raises:
        SystemExit: a rank exited with a status other than 0.
    """
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--rank-config", json.dumps(cfg)],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            },
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for r in range(world)
    ]
    samples: list[dict[str, Any]] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"a rank failed with {proc.returncode}")
        for line in out.splitlines():
            if line.startswith("SAMPLES "):
                samples += json.loads(line[len("SAMPLES ") :])
    return samples
