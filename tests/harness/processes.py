"""Child processes for tests: start one (``python -m tests.<package>._<name>_child ...`` or a
``-c`` script) with this checkout on its path, read its output, wait for it with a timeout, and
SIGKILL it (a crash, a node failure) or kill whatever is left when the test ends.

A child prints marker lines (``READY``, ``PAUSED``, ``AT <step>``, ``RESULT <json>``) that the
test reads; children that wait to be killed block reading their stdin, which :class:`Child`
keeps open. A child that starts processes of its own (Lightning's DDP, torchrun) is killed with
them: ``kill_scope="group"`` or ``"tree"``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

from tests.harness import zygote

ROOT = Path(__file__).resolve().parents[2]

KillScope = Literal["process", "group", "tree"]


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
    cwd: str | os.PathLike[str] = ROOT,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in ``cwd`` (the repository root) to its end, its output captured as
    text (``env`` defaults to :func:`child_env`). The exit status is the caller's to check,
    unless ``check``.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s`` (it is killed then).
        subprocess.CalledProcessError: ``check`` and it exited with a status other than 0.
    """
    env = dict(env) if env is not None else child_env()
    forker = zygote.for_command(command, env, child_env())
    if forker is None:
        return subprocess.run(
            list(command),
            cwd=cwd,
            env=env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=check,
        )
    proc = zygote.Forked(
        command,
        forker,
        env=env,
        cwd=str(cwd),
        stdin=subprocess.PIPE if input is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=False,
    )
    try:
        out, err = proc.communicate(input, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(list(command), proc.wait(), out or "", err or "")
    if check:
        done.check_returncode()
    return done


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now, chosen at random below the kernel's
    range of ephemeral ports: a port of that range (what binding port 0 gives) can be taken
    as the local port of any connection made before the child binds it (a rank's store failed
    with EADDRINUSE so, while another test's ranks connected)."""
    low = _ephemeral_ports_start()
    if low - 1024 >= 4096:
        pick = random.SystemRandom()
        for _ in range(100):
            port = pick.randrange(max(1024, low - 12288), low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, whatever session each is in (torchrun starts its
    workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


class Child:
    """A running child with a text pipe to its stdin; its stdout goes to a pipe (the default)
    and its stderr nowhere (inherited), else each where ``stdout``/``stderr`` say: ``"pipe"``,
    a file, ``subprocess.DEVNULL`` or ``None`` (inherited). It runs in ``cwd`` (the repository
    root). Used as a context manager, whatever still runs at the end is killed and reaped.

    ``kill_scope`` says what :meth:`kill` ends: ``"process"`` the child alone; ``"group"`` its
    process group (it starts in a session of its own, and the processes it starts share it);
    ``"tree"`` it and every process below it at once (it starts in a session of its own too),
    as a node failure would."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: IO[Any] | int | str | None = "pipe",
        stderr: IO[Any] | int | str | None = None,
        cwd: str | os.PathLike[str] = ROOT,
        kill_scope: KillScope = "process",
    ) -> None:
        self.kill_scope = kill_scope
        env = dict(env) if env is not None else child_env()
        out = subprocess.PIPE if stdout == "pipe" else stdout
        err = subprocess.PIPE if stderr == "pipe" else stderr
        assert not isinstance(out, str) and not isinstance(err, str)
        forker = zygote.for_command(command, env, child_env())
        self.proc: subprocess.Popen[str] | zygote.Forked
        if forker is None:
            self.proc = subprocess.Popen(
                list(command),
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=kill_scope != "process",
            )
        else:
            self.proc = zygote.Forked(
                command,
                forker,
                env=env,
                cwd=str(cwd),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=kill_scope != "process",
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

    def send(self, text: str) -> None:
        """Write ``text`` to its stdin (and flush it)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL it, or what ``kill_scope`` names (as a crash would end it)."""
        if self.proc.poll() is not None:
            return
        if self.kill_scope == "group":
            os.killpg(self.proc.pid, signal.SIGKILL)
        elif self.kill_scope == "tree":
            for pid in descendants(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        else:
            self.proc.send_signal(signal.SIGKILL)

    def kill_at(self, mark: str, before_kill: Callable[[], object] | None = None) -> int:
        """Read its stdout; at a line starting with ``mark``, call ``before_kill`` and
        :meth:`kill` it; read on to the end of its output. Its exit status."""
        for line in self.lines():
            if line.startswith(mark):
                if before_kill is not None:
                    before_kill()
                self.kill()
        return self.wait()

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
            self.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a broken pipe: closed all the same
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
