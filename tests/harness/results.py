"""Reading the ``RESULT <json>`` lines that child processes print."""

from __future__ import annotations

import json
from typing import Any

MARK = "RESULT {"


def result_rows(stdout: str) -> list[dict[str, Any]]:
    """Every ``RESULT <json>`` object in ``stdout``, wherever it starts and whatever follows it
    (several processes share one pipe: another's output may land on the same line)."""
    decoder = json.JSONDecoder()
    rows = []
    at = stdout.find(MARK)
    while at >= 0:
        row, end = decoder.raw_decode(stdout, at + len(MARK) - 1)
        rows.append(row)
        at = stdout.find(MARK, end)
    return rows
