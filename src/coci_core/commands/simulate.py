"""``python -m coci_core.commands.simulate``: the ``coci plan`` and ``coci simulate``
subcommands on their own (defined in :mod:`coci_core.commands.plan`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from coci_core.commands.plan import (
    OBJECTIVE_NAMES,
    POLICY_NAMES,
    add_subcommands,
    run_plan,
    run_simulate,
)

__all__ = ["OBJECTIVE_NAMES", "POLICY_NAMES", "add_subcommands", "main", "run_plan", "run_simulate"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m coci_core.commands.simulate``."""
    parser = argparse.ArgumentParser(prog="coci", description="coci checkpoint planner")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
