"""Moved to :mod:`coci_core.commands.simulate`; ``python -m coci_core.planner.cli`` keeps
working."""

import sys

from coci_core.commands.simulate import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
