"""The test harness's children: forked from a zygote or started fresh, each behaves as
``python -m <module>`` would (argv, cwd, environment, streams, exit statuses, signals)."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest

from tests.harness.processes import ROOT, Child, child_env, module, rank_env, run
from tests.harness.results import result_rows

CHILD = "tests._harness_child"


def _result(stdout: str) -> dict[str, object]:
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    out: dict[str, object] = json.loads(line[len("RESULT ") :])
    return out


@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "fresh"])
def test_a_child_starts_as_python_dash_m_would(
    fork: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COCI_TEST_FORK", fork)
    env = child_env({"COCI_HARNESS_PROBE": "seen", "OMP_NUM_THREADS": "1"})
    done = run(module(CHILD, "report", "x y"), env=env, input="from stdin", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = _result(done.stdout)
    assert got["forked"] is (fork == "1")
    assert got["argv"][1:] == ["report", "x y"]  # type: ignore[index]
    assert got["argv"][0].endswith("_harness_child.py")  # type: ignore[index]
    assert got["main_spec"] == CHILD
    assert got["cwd"] == str(tmp_path) == got["path0"]
    assert got["env"] == "seen"
    assert got["threads"] == 1
    assert got["stdin"] == "from stdin"
    assert done.stderr.strip().endswith("to stderr")
    assert done.stdout.rstrip().endswith("ATEXIT")  # atexit handlers ran, output flushed


@pytest.mark.parametrize("seed", ["123", "456"])
def test_an_import_time_variable_is_as_in_a_fresh_interpreter(
    seed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child whose PYTHONHASHSEED (read as Python starts) is set is forked from a zygote
    started with it: its hashes are a fresh interpreter's."""
    env = child_env({"PYTHONHASHSEED": seed})
    forked = _result(run(module(CHILD, "report"), env=env, input="").stdout)
    monkeypatch.setenv("COCI_TEST_FORK", "0")
    fresh = _result(run(module(CHILD, "report"), env=env, input="").stdout)
    assert forked["forked"] is True and fresh["forked"] is False
    assert forked["hash"] == fresh["hash"]


def test_a_child_without_omp_num_threads_has_a_fresh_interpreters_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OMP_NUM_THREADS is applied per child: a child after one that set it has the default
    thread count (a zygote first asked for one thread once handed it to every later child, and
    a benchmark's reference run then differed in its last bits from its own fresh child's)."""
    one = run(module(CHILD, "report"), env=child_env({"OMP_NUM_THREADS": "1"}), input="")
    after = _result(run(module(CHILD, "report"), input="").stdout)
    monkeypatch.setenv("COCI_TEST_FORK", "0")
    fresh = _result(run(module(CHILD, "report"), input="").stdout)
    assert _result(one.stdout)["threads"] == 1
    assert after["forked"] is True and fresh["forked"] is False
    assert after["threads"] == fresh["threads"] == os.cpu_count()


def test_another_pythonpath_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    assert _result(run(module(CHILD, "report"), env=env, input="").stdout)["forked"] is False
    assert _result(run(module(CHILD, "report"), input="").stdout)["forked"] is True


def test_exit_statuses_errors_and_threads() -> None:
    raised = run(module(CHILD, "raise"))
    assert raised.returncode == 1
    assert "ValueError: the child's own error" in raised.stderr
    assert run(module(CHILD, "exit", "7")).returncode == 7
    thread = run(module(CHILD, "thread"))
    assert thread.returncode == 0
    assert thread.stdout.splitlines() == ["THREAD", "ATEXIT"]  # joined before atexit


@pytest.mark.parametrize("scope", ["process", "group"])
def test_a_killed_child_reports_the_signal(scope: str) -> None:
    with Child(module(CHILD, "wait"), kill_scope=scope) as child:  # type: ignore[arg-type]
        assert child.readline() == "READY\n"
        if scope == "group":
            assert os.getpgid(child.pid) == child.pid  # a session of its own
        child.kill()
        assert child.wait(30) == -signal.SIGKILL
    with Child(module(CHILD, "wait")) as child:
        assert child.readline() == "READY\n"
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
    with Child(module(CHILD, "wait")) as child:
        assert child.readline() == "READY\n"
        assert child.communicate("") == ("ATEXIT\n", "")


def test_ranks_runs_the_processes_of_a_run_and_one_that_fails_ends_it() -> None:
    """``python -m tests.harness.ranks N MODULE ...``: N processes (forked), each with its rank's
    variables, each running MODULE as ``python -m`` would; when one fails, the others are
    killed and the run ends with its status (as under torchrun)."""
    done = run(module("tests.harness.ranks", "2", CHILD, "report", "x"), input="")
    assert done.returncode == 0, done.stderr
    rows = result_rows(done.stdout)
    assert sorted((r["rank"], r["world"]) for r in rows) == [("0", "2"), ("1", "2")]
    assert all(r["argv"][1:] == ["report", "x"] and r["main_spec"] == CHILD for r in rows)
    assert done.stdout.count("ATEXIT") == 2
    failed = run(module("tests.harness.ranks", "2", CHILD, "fail", "1", "3"), timeout_s=60)
    assert failed.returncode == 3


def test_the_root_is_the_default_directory() -> None:
    got = _result(run(module(CHILD, "report"), input="").stdout)
    assert got["cwd"] == str(ROOT)


def test_a_lost_dns_answer_is_retried_after_1_s_in_pytest_and_its_ranks() -> None:
    """Each TCPStore connection asks DNS for ::ffff:127.0.0.1's name (see conftest.py): a lost
    answer cost glibc's default 5 s, at random, in every multi-rank test."""
    assert "timeout:1" in os.environ["RES_OPTIONS"].split()
    assert rank_env(1, 2, 29500)["RES_OPTIONS"] == os.environ["RES_OPTIONS"]


def test_an_s3_server_whose_port_was_taken_meanwhile_is_started_on_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port chosen free and taken before weed binds it (by another process, or by weed's
    own outgoing connections) made weed exit with "address already in use", and the test
    that wanted the server errored (seen once in CI): the server is started again on other
    ports."""
    import socket

    from tests.harness import s3

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen = s3._free_ports
    calls: list[list[int]] = []

    def first_with_a_taken_port(n: int) -> list[int]:
        ports = chosen(n)
        if not calls:
            ports[4] = taken.getsockname()[1]  # the filer's, as in CI
        calls.append(ports)
        return ports

    monkeypatch.setattr(s3, "_free_ports", first_with_a_taken_port)
    try:
        server = s3.start_s3_server(tmp_path / "seaweedfs")
    finally:
        taken.close()
    try:
        assert len(calls) == 2
        assert "address already in use" in (tmp_path / "seaweedfs" / "weed-0.log").read_text()
        assert s3._answers(server.endpoint)
    finally:
        server.stop()


def test_a_free_port_is_below_the_ephemeral_range_and_free() -> None:
    """The ports the ranks' stores listen on are taken outside the range the kernel gives
    connections their local ports from, so that no connection takes one before its store
    binds it; each can be bound."""
    from tests.harness.processes import _ephemeral_ports_start, free_port

    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < _ephemeral_ports_start() for p in ports), ports
    assert len(ports) > 1  # chosen at random: two test processes rarely pick the same one
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
