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
