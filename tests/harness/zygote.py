"""Children forked from a process that has already imported torch (or Lightning).

Most of a test child's start is importing torch (1-2 s) and Lightning (4-6 s more). Each test
worker starts one *zygote* per kind the first time a child of that kind is asked for: a plain
``python`` that imports the kind's modules once and then, on request, forks. The forked process
sets its session, standard streams, working directory, environment, ``sys.path`` and ``sys.argv``
as ``python -m <module> <args>`` would, runs the module as ``__main__`` and exits as that
interpreter would (atexit handlers, non-daemon threads, buffered output). It is a real process of
its own: signals, ``kill -9``, process groups and exit statuses are those of the child itself.

Only ``python -m <module>`` commands run by this interpreter with this checkout's ``PYTHONPATH``
are forked, each from a zygote started with the same variables that Python or torch read while
importing (``OMP_NUM_THREADS`` is applied with ``torch.set_num_threads`` instead; up to four
zygotes of each kind; ``python -m tests.harness.ranks N <module> ...``, which forks the module's
processes in turn, from a zygote of the module's kind). Anything else, and everything when
``COCI_TEST_FORK=0``, starts a fresh interpreter. :class:`Forked` is the part of
``subprocess.Popen``'s interface the harness uses.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

# The modules each kind imports before it forks. Lightning adds a handler to its logger when it
# is imported into a process whose logging is not configured yet, so only children that import
# it before configuring logging may use that kind.
# The transformers kind imports the Trainer and GPT-2 (6 s) with the two variables that
# tests/transformers/run.py sets before it imports them.
# What children import lazily is imported too: torch._dynamo (1.3 s of CPU), which torch's
# optimizers import when the first is made, and scikit-learn's data sets (1.5 s), which the
# digits are loaded with.
_LAZY = ("torch._dynamo", "sklearn.datasets")
KINDS = {
    "torch": ("torch", *_LAZY),
    "lightning": ("torch", "lightning.pytorch", *_LAZY),
    "transformers": (
        "torch",
        "transformers.trainer",
        "transformers.models.gpt2.modeling_gpt2",
        *_LAZY,
    ),
}
LIGHTNING_CHILDREN = frozenset(
    {
        "tests.lightning._child",
        "tests.lightning._ddp_child",
        "tests.lightning._model_parallel_child",
        "tests.lightning._resume_kill_child",
        "tests.lightning._fsdp1_child",
        "tests.preemption._lightning_child",
        "tests.telemetry._lightning_run",
    }
)
TRANSFORMERS_CHILDREN = frozenset({"tests.transformers.run"})
# ``python -m tests.harness.ranks N MODULE ...`` forks MODULE's processes: its kind is MODULE's
RANKS = "tests.harness.ranks"
_KIND_ENV = {"transformers": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}}
# Variables read while Python, torch or transformers start (or whose value a forked child could
# not change). Lightning's (PL_GLOBAL_SEED, set by seed_everything) are read when used.
_IMPORT_TIME = (
    *("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP", "LD_", "TORCH", "PYTORCH", "CUDA", "HF_"),
    "TRANSFORMERS",
)
_APPLIED = frozenset({"OMP_NUM_THREADS"})
_MAX_MESSAGE = 1 << 20


def enabled() -> bool:
    return os.environ.get("COCI_TEST_FORK", "1") != "0"


def kind_of(module: str) -> str:
    """The zygote kind for a child that runs ``module``."""
    if module in LIGHTNING_CHILDREN:
        return "lightning"
    return "transformers" if module in TRANSFORMERS_CHILDREN else "torch"


def import_time(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of ``env`` that Python or torch read while importing (a forked child
    gets those of its zygote, so a zygote serves only children with the same ones)."""
    return tuple(
        sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME) and k not in _APPLIED)
    )


def for_command(
    command: Sequence[str], env: Mapping[str, str], checkout_env: Mapping[str, str]
) -> Zygote | None:
    """The zygote that forks ``command`` run with ``env``, started with ``env`` if this worker
    has none of that kind for ``env``'s import-time variables; None when it needs a fresh
    interpreter: another interpreter, not ``-m``, another ``PYTHONPATH`` than this checkout's
    (``checkout_env``), or too many zygotes already."""
    if not enabled() or len(command) < 3 or command[0] != sys.executable or command[1] != "-m":
        return None
    if env.get("PYTHONPATH") != checkout_env.get("PYTHONPATH"):
        return None
    name = command[4] if command[2] == RANKS and len(command) > 4 else command[2]
    key = (kind_of(name), import_time(env))
    with _zygotes_lock:
        z = _zygotes.get(key)
        if z is None or not z.alive():
            if z is None and sum(k[0] == key[0] for k in _zygotes) >= _MAX_ZYGOTES:
                return None
            z = _zygotes[key] = Zygote(key[0], env)
        return z


# -- the zygote ------------------------------------------------------------------------------


def serve(sock_fd: int, kind: str) -> None:
    """The zygote's loop: import ``kind``'s modules, then fork a child per request and report
    each child's exit status, until the test process closes the socket."""
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    site_path = [p for p in sys.path[1:] if p not in own]  # the stdlib and site-packages
    for key, value in _KIND_ENV.get(kind, {}).items():
        os.environ.setdefault(key, value)
    for name in KINDS[kind]:
        __import__(name)
    import torch

    # what is imported is shared with every child: frozen, so that no child's collections (at
    # its exit above all) touch those objects and copy the memory they share
    gc.freeze()

    threads = torch.get_num_threads()  # a fresh interpreter's, the zygote has no OMP_NUM_THREADS
    sock = socket.socket(fileno=sock_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except InterruptedError:
            continue
        if not data:
            return
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            sock.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            _become(request, fds, site_path, threads)  # runs the child and exits; never returns
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, {"started": pid})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode())


def _become(request: dict[str, Any], fds: list[int], site_path: list[str], threads: int) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    env: dict[str, str] = request["env"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *own, *site_path]
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(write_through=True)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", threads)))
    import runpy

    module, *args = request["argv"]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # out of serve(): the interpreter ends as `python -m` would


# -- the test process's side -------------------------------------------------------------------


class Zygote:
    """A running zygote of one kind, and the exit statuses it has reported."""

    def __init__(self, kind: str, env: Mapping[str, str]) -> None:
        self.kind = kind
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = (
            "import sys; from tests.harness.zygote import serve; "
            "serve(int(sys.argv[1]), sys.argv[2])"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), kind],
            # started without the applied variables, so that its threads are a fresh
            # interpreter's default, and each child sets its own
            env={k: v for k, v in self.env.items() if k not in _APPLIED},
            cwd=str(_root()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.exited: dict[int, int] = {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, session: bool, fds: list[int]
    ) -> int:
        request = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd,
            "session": session,
        }
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            while True:
                message = self._read(None)
                if message is None:
                    raise RuntimeError(f"the {self.kind} zygote ended (status {self.proc.poll()})")
                if "started" in message:
                    return int(message["started"])

    def status(self, pid: int, timeout_s: float | None) -> int | None:
        """``pid``'s exit status once reported, waiting up to ``timeout_s`` (None: forever).
        The lock is held only to read, so that other threads can fork meanwhile."""
        deadline = None if timeout_s is None else _now() + timeout_s
        while True:
            with self.lock:
                while self._read(0.0) is not None:
                    pass
                if pid in self.exited:
                    return self.exited[pid]
            left = 0.2 if deadline is None else min(0.2, deadline - _now())
            if left <= 0:
                return None
            select.select([self.sock], [], [], left)

    def _read(self, timeout_s: float | None) -> dict[str, Any] | None:
        """One message (recording exit statuses), or None when none came in ``timeout_s``."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        if not ready:
            return None
        data = self.sock.recv(_MAX_MESSAGE)
        if not data:
            raise RuntimeError(f"the {self.kind} zygote ended (status {self.proc.poll()})")
        message: dict[str, Any] = json.loads(data)
        if "exited" in message:
            self.exited[int(message["exited"])] = int(message["code"])
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _now() -> float:
    import time

    return time.monotonic()


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_zygotes: dict[tuple[str, tuple[tuple[str, str], ...]], Zygote] = {}
_zygotes_lock = threading.Lock()
_MAX_ZYGOTES = 4  # of one kind; each holds torch (and maybe more) in memory


def close_all() -> None:
    """End this worker's zygotes (at its exit)."""
    with _zygotes_lock:
        for z in _zygotes.values():
            z.close()
        _zygotes.clear()


atexit.register(close_all)


_Stream = IO[Any] | int | None


class Forked:
    """A child forked by a zygote, with the part of ``subprocess.Popen``'s interface (text
    mode) that the harness uses."""

    def __init__(
        self,
        command: Sequence[str],
        zygote: Zygote,
        *,
        env: Mapping[str, str],
        cwd: str,
        stdin: _Stream,
        stdout: _Stream,
        stderr: _Stream,
        start_new_session: bool,
    ) -> None:
        self.args = list(command)
        self.returncode: int | None = None
        self._zygote = zygote
        mine: list[tuple[int, str]] = []  # (our end, mode) of each pipe, in stream order
        theirs: list[int] = []
        opened: list[int] = []
        for number, (spec, mode) in enumerate(((stdin, "w"), (stdout, "r"), (stderr, "r"))):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                ours, child = (w, r) if mode == "w" else (r, w)
                mine.append((ours, mode))
                theirs.append(child)
                opened.append(child)
                continue
            mine.append((-1, mode))
            if spec is None:
                theirs.append(number)
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                opened.append(fd)
            elif isinstance(spec, int):
                theirs.append(spec)
            else:
                theirs.append(spec.fileno())
        try:
            self.pid = zygote.fork(command[2:], env, cwd, start_new_session, theirs)
        finally:
            for fd in opened:
                os.close(fd)
        encoding = locale.getpreferredencoding(False)
        streams: list[IO[str] | None] = [
            None
            if fd < 0
            # as Popen's text pipes: stdin written through, so that closing it never flushes
            else io.TextIOWrapper(open(fd, mode + "b"), encoding=encoding, write_through=True)  # noqa: SIM115
            if mode == "w"
            else open(fd, mode, encoding=encoding)  # noqa: SIM115
            for fd, mode in mine
        ]
        self.stdin, self.stdout, self.stderr = streams

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(
        self, input: str | None = None, timeout: float | None = None
    ) -> tuple[str | None, str | None]:
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
            except BrokenPipeError:
                pass  # it ended without reading it all, as Popen allows
            finally:
                with contextlib.suppress(BrokenPipeError):
                    self.stdin.close()
        results: dict[int, str] = {}

        def drain(index: int, stream: IO[str]) -> None:
            results[index] = stream.read()
            stream.close()

        readers = [
            threading.Thread(target=drain, args=(i, s), daemon=True)
            for i, s in ((1, self.stdout), (2, self.stderr))
            if s is not None
        ]
        for t in readers:
            t.start()
        deadline = None if timeout is None else _now() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - _now()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - _now()))
        return (
            results.get(1) if self.stdout is not None else None,
            results.get(2) if self.stderr is not None else None,
        )
