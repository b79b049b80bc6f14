"""Child processes for tests: start one (``python -m tests.<package>._<name>_child ...`` or a
``-c`` script) with this checkout on its path, read its output, wait for it with a timeout, and
SIGKILL it (a crash, a node failure) or kill whatever is left when the test ends.

A child prints marker lines (``READY``, ``PAUSED``, ``RESULT <json>``) that the test reads;
children that wait to be killed block reading their stdin, which :class:`Child` keeps open.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]


def child_env(
    extra: Mapping[str, str] | None = None, *, drop_prefixes: Sequence[str] = ()
) -> dict[str, str]:
    """This process's environment without the variables starting with ``drop_prefixes``, with
    ``extra``, and with PYTHONPATH naming this checkout's ``src/`` and root (so that the child
    imports the code under test and ``tests``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop_prefixes))}
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return env


def rank_env(
    rank: int, world: int, port: int, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """:func:`child_env` for rank ``rank`` of ``world`` processes meeting on ``port``, one
    OpenMP thread each."""
    ranks = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    return child_env({**ranks, **(extra or {})})


def module(name: str, *args: str) -> list[str]:
    """The command that runs module ``name`` with ``args`` in this interpreter."""
    return [sys.executable, "-m", name, *args]


def script(code: str, *args: str) -> list[str]:
    """The command that runs ``code`` (``python -c``) with ``args`` in this interpreter."""
    return [sys.executable, "-c", code, *args]


def run(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` from the repository root to its end, its output captured as text
    (``env`` defaults to :func:`child_env`). The exit status is the caller's to check.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s`` (it is killed then).
    """
    return subprocess.run(
        list(command),
        cwd=ROOT,
        env=dict(env) if env is not None else child_env(),
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A running child with a text pipe to its stdin; its stdout goes to a pipe (the default)
    and its stderr nowhere (inherited), else each where ``stdout``/``stderr`` say: ``"pipe"``,
    a file, ``subprocess.DEVNULL`` or ``None`` (inherited). Used as a context manager,
    whatever still runs at the end is killed and reaped."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: IO[Any] | int | str | None = "pipe",
        stderr: IO[Any] | int | str | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=dict(env) if env is not None else child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if stdout == "pipe" else stdout,
            stderr=subprocess.PIPE if stderr == "pipe" else stderr,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lines(self) -> Iterator[str]:
        """Its stdout, line by line, until it closes."""
        assert self.proc.stdout is not None
        yield from self.proc.stdout

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def kill(self) -> None:
        """SIGKILL it (as a crash would end it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout_s: float | None = None) -> int:
        """Its exit status (``-signal.SIGKILL`` once killed)."""
        return self.proc.wait(timeout=timeout_s)

    def communicate(self, input: str | None = None, timeout_s: float = 120) -> tuple[str, str]:
        """Send ``input``, close its stdin, and read the rest of its output to its end:
        (stdout, stderr; "" for what is not a pipe)."""
        out, err = self.proc.communicate(input, timeout=timeout_s)
        return out or "", err or ""

    def close(self) -> None:
        """Kill it if it still runs, reap it, and close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
