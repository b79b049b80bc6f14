"""Timing, sizes and summary statistics."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

perf = time.perf_counter


def best_of(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """The fastest of ``reps`` calls (seconds) and the last call's result."""
    best, out = float("inf"), None
    for _ in range(reps):
        t = perf()
        out = fn()
        best = min(best, perf() - t)
    return best, out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def stats(xs: list[float]) -> dict[str, float]:
    """n, median, min, max, quartiles and mean of the values that are not None ({} if none)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "p25": q[0],
        "p75": q[2],
        "mean": statistics.fmean(xs),
    }


def fmt_s(st: dict[str, float], scale: float = 1.0, unit: str = "s", digits: int = 3) -> str:
    """``median (min-max)`` of :func:`stats`' summary, or ``-``."""
    if not st:
        return "-"
    med_, lo, hi = (st[k] * scale for k in ("median", "min", "max"))
    return f"{med_:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def parse_choices(s: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma list of names from ``allowed`` (a command-line argument); exits naming the
    unknown ones."""
    out = [x for x in s.split(",") if x]
    bad = [x for x in out if x not in allowed]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {list(allowed)}")
    return out


def parse_size(s: str) -> int:
    """``"100M"``, ``"1G"``, ``"4GB"``, ``"512k"`` (decimal units) or a number of bytes."""
    s = s.strip().upper().removesuffix("B")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def human(n: float) -> str:
    for unit, m in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= m:
            return f"{n / m:.3g} {unit}"
    return f"{n:.0f} B"
