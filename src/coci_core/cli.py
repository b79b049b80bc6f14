"""Moved to :mod:`coci_core.commands.cli`; ``python -m coci_core.cli`` keeps working."""

import sys

from coci_core.commands.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
