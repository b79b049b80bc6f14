"""Developer sessions: lint, typecheck, tests. Torch is pinned to the CPU build on this machine."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the packages."""
    session.install(TORCH, "-e", ".[dev]")
    session.run("mypy")
    session.run("mypy", "--check-untyped-defs", "tests", "noxfile.py")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite."""
    session.install(TORCH, "-e", ".[dev]")
    session.run("python", "-m", "pytest", *session.posargs)
