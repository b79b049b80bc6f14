"""show_by_default: an adapter's INFO lines reach stderr when no handler of the user's takes
them, and only then (never twice)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from coci_core.training.console import ConsoleHandler, show_by_default


@pytest.fixture
def isolated() -> Iterator[logging.Logger]:
    """A logger cut off from the root (pytest's capture handlers live there), as if logging
    were not configured. The test itself cuts it off (``propagate = False``): pytest gives a
    logger that does not propagate when a test's call starts capture handlers of its own."""
    top = logging.getLogger("coci_console_test")
    try:
        yield top
    finally:
        top.handlers.clear()
        top.propagate = True
        top.setLevel(logging.NOTSET)
        logging.getLogger("coci_console_test.module").handlers.clear()


def test_printed_when_nothing_else_takes_it(
    isolated: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    isolated.propagate = False  # in the test's call: see the fixture
    shown = show_by_default(isolated.name)
    assert shown is isolated and shown.level == logging.INFO
    show_by_default(isolated.name)  # a second import adds no second handler
    assert sum(isinstance(h, ConsoleHandler) for h in isolated.handlers) == 1
    child = logging.getLogger(f"{isolated.name}.module")
    child.info("coci: plan line")
    child.debug("coci: not at INFO")
    assert capsys.readouterr().err == "coci: plan line\n"


def test_left_to_the_users_handler(
    isolated: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    isolated.propagate = False  # in the test's call: see the fixture
    show_by_default(isolated.name)
    users = io.StringIO()
    handler = logging.StreamHandler(users)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    child = logging.getLogger(f"{isolated.name}.module")
    child.addHandler(handler)
    child.info("coci: plan line")
    assert capsys.readouterr().err == ""
    assert users.getvalue() == "INFO:coci_console_test.module:coci: plan line\n"


def test_a_level_the_user_set_is_kept(isolated: logging.Logger) -> None:
    isolated.setLevel(logging.WARNING)
    show_by_default(isolated.name)
    assert isolated.level == logging.WARNING


def test_a_line_under_a_progress_bar_starts_on_its_own(
    isolated: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tqdm bar on the terminal (Lightning's, the demo's), the bar is cleared for the line
    and drawn again after it: the line does not run on from the bar's text."""
    from tqdm import tqdm

    terminal = io.StringIO()
    monkeypatch.setattr("sys.stderr", terminal)
    isolated.propagate = False
    show_by_default(isolated.name)
    with tqdm(total=10, desc="training", file=terminal, mininterval=0) as bar:
        bar.update(3)
        isolated.info("coci: plan line")
        bar.update(1)
    (segment,) = [s for s in terminal.getvalue().split("\n") if "coci: plan line" in s]
    assert segment.split("\r")[-1] == "coci: plan line"
    assert "4/10" in terminal.getvalue()  # drawn again after the line
