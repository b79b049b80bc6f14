"""What an adapter's user sees of coci's log lines when they configured no logging.

Python shows nothing below WARNING until logging is configured, so coci's plan line and
end-of-run summary would be silent in an ordinary script. Lightning solves the same problem for
its own messages by giving its ``lightning.pytorch`` logger the level INFO and a stderr handler
while the root logger has none; :func:`show_by_default` does that for an adapter's logger, with
the root logger checked at each line rather than once at import: a line is printed by coci's
handler only when no other handler takes it, so that it appears once, whether the user configures
logging before or after importing coci (``logging.basicConfig``, pytest's log capture).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["ConsoleHandler", "show_by_default"]


class ConsoleHandler(logging.Handler):
    """Writes a record to the current ``sys.stderr``, as a bare message, unless another handler
    on the way from the record's logger to the root takes it."""

    def emit(self, record: logging.LogRecord) -> None:
        if self._taken_elsewhere(record):
            return
        try:
            stream = sys.stderr
            text = self.format(record) + "\n"
            bars = getattr(sys.modules.get("tqdm"), "tqdm", None)
            if bars is None:
                stream.write(text)
                stream.flush()
                return
            # a progress bar on the terminal (Lightning's, the demo's): cleared for the line
            # and drawn again below it, so that the line does not run on from the bar
            with bars.external_write_mode(file=stream):
                stream.write(text)
                stream.flush()
        except Exception:
            self.handleError(record)

    def _taken_elsewhere(self, record: logging.LogRecord) -> bool:
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            for handler in current.handlers:
                if handler is not self and record.levelno >= handler.level:
                    return True
            if not current.propagate:
                return False
            current = current.parent
        return False


def show_by_default(name: str) -> logging.Logger:
    """Let logger ``name``'s INFO lines reach the user with no logging configured, as
    Lightning's own do: level INFO unless the user set one, and a :class:`ConsoleHandler`
    (added once)."""
    log = logging.getLogger(name)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not any(isinstance(h, ConsoleHandler) for h in log.handlers):
        log.addHandler(ConsoleHandler())
    return log
