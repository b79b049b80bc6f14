"""A real TensorBoard server and a headless Chromium, for the coci tab's tests and docs.

:func:`killed_and_resumed_run` trains ``coci demo``'s Lightning run, kills it with SIGKILL and
resumes it (two processes), :func:`shared_killed_and_resumed_run` once for all the session's
test processes; :func:`start_tensorboard` serves a log directory on a free loopback
port (stopped by its PID); :func:`open_browser` drives Debian's chromium through the system's
chromedriver (never selenium-manager, which would download one); :func:`open_coci_tab` opens
the tab and waits until it has drawn.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from tests.harness.processes import free_port

START_TIMEOUT_S = 90.0


def killed_and_resumed_run(root: Path, total: int = 200, kill: int = 120) -> tuple[Path, int]:
    """``root/run``: the demo's Lightning run, killed with SIGKILL at step ``kill`` (as ``coci
    demo`` does: or just after its first committed checkpoint, when none is by then) and
    resumed to ``total`` in a new process; returns the log directory ``coci demo`` prints and
    the step the run was killed at."""
    from coci_lightning.demo import _train, _train_killed

    run = root / "run"
    code, killed = _train_killed(run, total, root / "killed.json", kill)
    if code != -signal.SIGKILL or killed is None:
        raise AssertionError(f"the demo run exited with {code} instead of being killed")
    if _train(run, total, root / "resumed.json") != 0:
        raise AssertionError("the resumed demo run failed")
    return run, killed


def shared_killed_and_resumed_run(
    tmp_path_factory: pytest.TempPathFactory, into: Path, total: int = 200, kill: int = 120
) -> tuple[Path, int]:
    """:func:`killed_and_resumed_run`'s ``into/run``, trained once for every test process of
    the session (pytest-xdist's workers share the base temporary directory's parent) and
    copied, so that a test's TensorBoard reads a run of its own."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / (
        f"coci-demo-run-{total}-{kill}"
    )
    with FileLock(f"{shared}.lock"):
        done = shared / "killed.txt"
        if not done.is_file():
            shutil.rmtree(shared, ignore_errors=True)
            _, killed = killed_and_resumed_run(shared, total, kill)
            done.write_text(str(killed))
    shutil.copytree(shared / "run", into / "run")
    return into / "run", int(done.read_text())


def plugin_registered() -> bool:
    """Whether the installed coci registers TensorBoard's coci tab (its entry point)."""
    return any(e.name == "coci" for e in entry_points(group="tensorboard_plugins"))


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


@dataclass
class TensorBoard:
    """A running ``tensorboard`` process."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def get_json(self, route: str) -> Any:
        return json.loads(_get(self.url + route))

    def get(self, route: str) -> bytes:
        return _get(self.url + route)

    def stop(self) -> None:
        """Terminate the server by its PID (SIGKILL if it does not stop in 10 s)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_tensorboard(logdir: Path, log: Path) -> TensorBoard:
    """Serve ``logdir`` on a free loopback port; returns once the coci tab is listed."""
    if not plugin_registered():
        raise RuntimeError(
            "the coci TensorBoard plugin is not registered: install the package "
            "(pip install -e '.[dev]') so that its tensorboard_plugins entry point exists"
        )
    port = free_port()
    out = open(log, "wb")  # noqa: SIM115 - the server writes to it until stopped
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    server = TensorBoard(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited with {proc.returncode}:\n{log.read_text()}")
        with contextlib.suppress(OSError, ValueError):
            if server.get_json("/data/plugins_listing").get("coci", {}).get("enabled"):
                return server
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"tensorboard did not list the coci tab:\n{log.read_text()}")
        time.sleep(0.2)  # polling the server, with a deadline


def browser_available() -> bool:
    """Whether Selenium, chromium and chromedriver are all installed."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return _chromium() is not None and shutil.which("chromedriver") is not None


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def open_browser(width: int = 1400, height: int = 1250) -> Iterator[Any]:
    """A headless Chromium (Selenium WebDriver), quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    options.binary_location = _chromium() or "chromium"
    service = Service(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


def open_coci_tab(driver: Any, url: str, timeout: float = 30.0) -> None:
    """Open TensorBoard's coci tab and switch into its frame once the timeline is drawn."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "/#coci")
    wait = WebDriverWait(driver, timeout)
    frame = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "iframe"))[0]
    driver.switch_to.frame(frame)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "svg[data-chart=timeline]"))
