"""The loss-curve model: a fitted curve of loss against step, and the value of progress.

The fit runs on binned means (log-spaced bins of the step index), after the losses are mapped
affinely onto [0, 1], so that neither the loss scale nor an added constant can change it; the
residuals are taken in log space with a floor (``log(y + 0.1)``). Two shapes compete,
``L_inf + A·(1 + k/k0)^(-alpha)`` and ``L_inf + A·e^(-k/kappa)``, and the lower residual wins.
A loss never observed below 0 is taken to be non-negative: the fitted loss (what is reported
and drawn, and what the loss is compared with to find a regime change) is never below 0, even
where a fitted floor ``L_inf`` below 0 is extrapolated ahead of the observations. The value of
progress depends on the curve's shape only, so an offset added to the loss leaves it unchanged.
A curve is *trusted* only when it beats a flat line by a chi-square of at least 16 against
the noise of the binned means (or, for noise-free data, has R^2 >= 0.6); an untrusted curve
has flat value (so the plan falls back to Daly). A regime change (a learning-rate drop)
splits the curve into pieces fitted separately; the jump between pieces is not value.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import least_squares

from coci_core.errors import ConfigError

__all__ = ["CurvePiece", "LossCurve", "curve_from_callable", "fit_loss_curve", "value_density"]

FloatArray = npt.NDArray[np.float64]

_EPS = 0.1  # floor of the log residuals, in units of the (normalised) loss range
MIN_POINTS = 32
MIN_BINS = 8
MIN_R2 = 0.6  # used only when the data show no noise at all
MIN_CHI2 = 16.0  # the fit must beat a flat line by this much chi-square (p < 1e-3)


@dataclass(frozen=True, kw_only=True)
class CurvePiece:
    """One fitted piece, valid from ``start_step`` (normalised loss units)."""

    start_step: int
    kind: str  # "power" or "exp"
    params: tuple[float, ...]

    def predict(self, steps: npt.ArrayLike) -> FloatArray:
        """Fitted (normalised) loss at ``steps``."""
        k = np.asarray(steps, dtype=np.float64) - self.start_step
        if self.kind == "power":
            floor, amp, k0, alpha = self.params
            return np.asarray(floor + amp * (1.0 + np.maximum(k, 0.0) / k0) ** (-alpha))
        floor, amp, kappa = self.params
        return np.asarray(floor + amp * np.exp(-np.maximum(k, 0.0) / kappa))

    def to_dict(self) -> dict[str, object]:
        """JSON-compatible description."""
        return {"start_step": self.start_step, "kind": self.kind, "params": list(self.params)}


@dataclass(frozen=True, kw_only=True)
class LossCurve:
    """A loss curve as the planner sees it.

    Attributes:
        trusted: whether the value density is used (False means flat value, i.e. Daly).
        pieces: fitted pieces in step order (empty when exact or untrusted).
        r2: fit quality of the binned means (1 for an exact curve).
        reason: why the curve is (not) trusted, for ``explain``.
        scale: the loss range used to normalise (to report the fitted value in loss units).
        offset: the loss offset used to normalise.
        exact: per-step loss values of a user-given exact curve, with ``exact_start``.
        lower: the lowest value the loss can take (0 for a loss never observed below 0), in
            the caller's units; ``predict`` never goes below it. None: no known bound.
    """

    trusted: bool
    pieces: tuple[CurvePiece, ...] = ()
    r2: float = 0.0
    reason: str = ""
    scale: float = 1.0
    offset: float = 0.0
    exact: FloatArray | None = None
    exact_start: int = 0
    lower: float | None = None

    def predict(self, steps: npt.ArrayLike) -> FloatArray:
        """Fitted loss, in the caller's units, at ``steps`` (NaN when untrusted)."""
        k = np.asarray(steps, dtype=np.float64)
        if self.exact is not None:
            idx = np.clip(k.astype(np.int64) - self.exact_start, 0, len(self.exact) - 1)
            return np.asarray(self.exact[idx])
        if not self.pieces:
            return np.full(k.shape, np.nan)
        fitted = self.offset + self.scale * self._normalised(k)
        return fitted if self.lower is None else np.maximum(fitted, self.lower)

    def _normalised(self, k: FloatArray) -> FloatArray:
        starts = np.array([p.start_step for p in self.pieces])
        which = np.clip(np.searchsorted(starts, k, side="right") - 1, 0, len(self.pieces) - 1)
        out = np.empty(k.shape)
        for j, piece in enumerate(self.pieces):
            mask = which == j
            out[mask] = piece.predict(k[mask])
        return out

    def drops(self, start_step: int, end_step: int) -> FloatArray:
        """Per-step loss drop ``L(k) - L(k+1)`` for k in [start, end), jumps excluded."""
        k = np.arange(start_step, end_step + 1, dtype=np.float64)
        if self.exact is not None:
            vals = self.predict(k)
            return np.maximum(vals[:-1] - vals[1:], 0.0)
        if not self.pieces or not self.trusted:
            return np.ones(end_step - start_step)
        starts = np.array([p.start_step for p in self.pieces])
        which = np.clip(np.searchsorted(starts, k[:-1], side="right") - 1, 0, len(self.pieces) - 1)
        out = np.empty(end_step - start_step)
        for j, piece in enumerate(self.pieces):
            mask = which == j
            kk = k[:-1][mask]
            out[mask] = piece.predict(kk) - piece.predict(kk + 1.0)
        return np.maximum(out, 0.0)

    def to_dict(self) -> dict[str, object]:
        """JSON-compatible description (exact curves are summarised, not stored)."""
        return {
            "trusted": self.trusted,
            "pieces": [p.to_dict() for p in self.pieces],
            "r2": self.r2,
            "reason": self.reason,
            "scale": self.scale,
            "offset": self.offset,
            "exact": self.exact is not None,
            "lower": self.lower,
        }


def curve_from_dict(state: dict[str, object]) -> LossCurve:
    """Rebuild a fitted curve from :meth:`LossCurve.to_dict` (exact curves are not stored)."""
    raw = state.get("pieces", [])
    lower = state.get("lower")
    pieces = tuple(
        CurvePiece(
            start_step=int(p["start_step"]),
            kind=str(p["kind"]),
            params=tuple(float(x) for x in p["params"]),
        )
        for p in (raw if isinstance(raw, list) else [])
    )
    return LossCurve(
        trusted=bool(state.get("trusted", False)) and bool(pieces),
        pieces=pieces,
        r2=float(state.get("r2", 0.0)),  # type: ignore[arg-type]
        reason=str(state.get("reason", "")),
        scale=float(state.get("scale", 1.0)),  # type: ignore[arg-type]
        offset=float(state.get("offset", 0.0)),  # type: ignore[arg-type]
        lower=None if lower is None else float(lower),  # type: ignore[arg-type]
    )


FLAT = LossCurve(trusted=False, reason="no loss curve")


def value_density(curve: LossCurve, start_step: int, end_step: int) -> FloatArray:
    """Normalised value of progress per step over the horizon: mean 1, or ones if flat.

    ``v(k) = (L(k) - L(k+1)) · K / sum drops``: invariant to the loss scale and offset.
    """
    n = end_step - start_step
    if not curve.trusted:
        return np.ones(n)
    drops = curve.drops(start_step, end_step)
    total = float(drops.sum())
    if not math.isfinite(total) or total <= 0:
        return np.ones(n)
    return np.asarray(drops * (n / total))


def curve_from_callable(fn: Callable[[int], float], start_step: int, end_step: int) -> LossCurve:
    """An exact curve from a callable; a noisy or rising one is fitted like observations."""
    ks = np.arange(start_step, end_step + 1)
    try:
        vals = np.asarray(fn(ks), dtype=np.float64)  # type: ignore[arg-type]
        if vals.shape != ks.shape:
            raise TypeError
    except Exception:
        vals = np.array([float(fn(int(k))) for k in ks], dtype=np.float64)
    if not np.all(np.isfinite(vals)):
        raise ConfigError("'loss' returned NaN or infinite values")
    diffs = vals[:-1] - vals[1:]
    drop = float(vals[0] - vals[-1])
    variation = float(np.abs(diffs).sum())
    if drop <= 0 and variation == 0:
        return LossCurve(trusted=False, reason="flat loss")
    if drop > 0 and variation <= 1.05 * drop:
        return LossCurve(
            trusted=True, r2=1.0, reason="exact curve", exact=vals, exact_start=start_step
        )
    return fit_loss_curve(ks, vals)


def _bin(steps: FloatArray, losses: FloatArray, max_bins: int) -> tuple[FloatArray, ...]:
    """Log-spaced bins of the step index, merged until each holds enough values."""
    lo, hi = float(steps.min()), float(steps.max())
    edges = lo + np.unique(np.geomspace(1.0, hi - lo + 2.0, max_bins + 1) - 1.0)
    idx = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, len(edges) - 2)
    counts = np.bincount(idx, minlength=len(edges) - 1)
    need = max(3, steps.size // (3 * max_bins))
    group = np.empty(len(counts), dtype=np.int64)
    g, acc = 0, 0
    for j, c in enumerate(counts):
        group[j] = g
        acc += int(c)
        if acc >= need:
            g, acc = g + 1, 0
    if acc and g > 0:
        group[group == g] = g - 1  # a short last group joins the one before
    idx = group[idx]
    n = int(idx.max()) + 1
    c = np.bincount(idx, minlength=n).astype(np.float64)
    keep = c > 0
    sx = np.bincount(idx, weights=steps, minlength=n)[keep]
    sy = np.bincount(idx, weights=losses, minlength=n)[keep]
    syy = np.bincount(idx, weights=losses * losses, minlength=n)[keep]
    c = c[keep]
    mean = sy / c
    var = np.maximum(syy / c - mean * mean, 0.0)
    return sx / c, mean, c, var


def _fit_piece(x: FloatArray, y: FloatArray, start: int) -> tuple[CurvePiece, float] | None:
    """Fit both shapes to normalised binned means; return the better piece and its SSE."""
    k = x - start
    span = max(float(k.max()), 1.0)
    target = np.log(np.maximum(y, -_EPS / 2) + _EPS)
    best: tuple[CurvePiece, float] | None = None

    def power(p: FloatArray) -> FloatArray:
        f, a, lk0, al = p
        return np.asarray(
            np.log(np.maximum(f + a * (1 + k / math.exp(lk0)) ** (-al), -_EPS + 1e-9) + _EPS)
            - target
        )

    def expo(p: FloatArray) -> FloatArray:
        f, a, lkap = p
        return np.asarray(
            np.log(np.maximum(f + a * np.exp(-k / math.exp(lkap)), -_EPS + 1e-9) + _EPS) - target
        )

    trials: list[
        tuple[str, Callable[[FloatArray], FloatArray], list[float], tuple[list[float], list[float]]]
    ] = []
    for frac, alpha in ((0.02, 0.5), (0.2, 1.5)):
        trials.append(
            (
                "power",
                power,
                [0.0, 1.0, math.log(span * frac), alpha],
                ([-1.0, 1e-6, math.log(1e-3), 0.01], [1.0, 1e3, math.log(span * 1e3), 5.0]),
            )
        )
    for frac in (0.3,):
        trials.append(
            (
                "exp",
                expo,
                [0.0, 1.0, math.log(span * frac)],
                ([-1.0, 1e-6, math.log(1e-3)], [1.0, 1e3, math.log(span * 1e3)]),
            )
        )
    for kind, fun, p0, bounds in trials:
        try:
            res = least_squares(fun, np.array(p0), bounds=bounds, max_nfev=100)
        except (ValueError, FloatingPointError):
            continue
        sse = float(np.sum(res.fun**2))
        if not math.isfinite(sse):
            continue
        params = [float(v) for v in res.x]
        params[2] = math.exp(params[2])
        piece = CurvePiece(start_step=start, kind=kind, params=tuple(params))
        if best is None or sse < best[1] - 1e-12:
            best = (piece, sse)
    return best


def fit_loss_curve(
    steps: npt.ArrayLike,
    losses: npt.ArrayLike,
    *,
    breakpoints: Sequence[int] = (),
    detect_regimes: bool = True,
    max_bins: int = 48,
) -> LossCurve:
    """Fit a loss curve to observations (see the module docstring).

    Args:
        steps: step index of each observation.
        losses: loss of each observation; must be finite (filter NaN/inf first).
        breakpoints: known regime changes (e.g. learning-rate drops), as steps.
        detect_regimes: also look for one unannounced regime change.
        max_bins: number of log-spaced bins per piece.

    Raises:
        ConfigError: if the arrays differ in length or hold NaN/inf.
    """
    x = np.asarray(steps, dtype=np.float64).ravel()
    y = np.asarray(losses, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ConfigError(f"'loss' steps and losses differ in length: {x.size} != {y.size}")
    if not np.all(np.isfinite(y)) or not np.all(np.isfinite(x)):
        raise ConfigError("'loss' must not contain NaN or infinite values")
    if x.size < MIN_POINTS:
        return LossCurve(trusted=False, reason=f"only {x.size} loss values (< {MIN_POINTS})")
    order = np.argsort(x, kind="stable")
    x, raw = x[order], y[order]
    # map the raw values onto [0, 1] first, so that huge losses cannot overflow the sums
    with np.errstate(all="ignore"):
        raw_lo = float(raw.min())
        raw_span = float(raw.max()) - raw_lo
    if not math.isfinite(raw_span) or raw_span <= 0:
        return LossCurve(trusted=False, reason="a flat loss, or values out of range")
    y = (raw - raw_lo) / raw_span
    bx, by, _, _ = _bin(x, y, max_bins)
    offset, scale = float(by.min()), float(by.max() - by.min())
    if len(bx) < MIN_BINS or scale <= 0:
        return LossCurve(trusted=False, reason="too few distinct bins or a flat loss")
    cuts = sorted({int(b) for b in breakpoints if x[0] < b <= x[-1]})
    curve = _fit_pieces(x, y, offset, scale, cuts, max_bins)
    if detect_regimes and not cuts and curve.trusted:
        split = _detect_regime(x, y, offset, scale, curve, max_bins)
        if split is not None:
            curve = split
    # back to the caller's loss units
    return dataclasses.replace(
        curve,
        offset=raw_lo + raw_span * curve.offset,
        scale=raw_span * curve.scale,
        lower=0.0 if raw_lo >= 0 else None,  # a loss never seen below 0 cannot go there
    )


def _fit_pieces(
    x: FloatArray, y: FloatArray, offset: float, scale: float, cuts: list[int], max_bins: int
) -> LossCurve:
    bounds = [int(x[0]), *cuts, int(x[-1]) + 1]
    pieces: list[CurvePiece] = []
    sse_total = sst_total = 0.0
    reasons: list[str] = []
    for lo, hi in itertools.pairwise(bounds):
        mask = (x >= lo) & (x < hi)
        if mask.sum() < MIN_POINTS:
            return LossCurve(trusted=False, reason=f"piece from step {lo} has too few values")
        bx, by, bc, bv = _bin(x[mask], y[mask], max_bins)
        if len(bx) < MIN_BINS:
            return LossCurve(trusted=False, reason=f"piece from step {lo} has too few bins")
        yn = (by - offset) / scale
        fit = _fit_piece(bx, yn, lo)
        if fit is None:
            return LossCurve(trusted=False, reason="the fit did not converge")
        piece, sse = fit
        target = np.log(np.maximum(yn, -_EPS / 2) + _EPS)
        sst = float(np.sum((target - target.mean()) ** 2))
        pred = piece.predict(bx)
        drop = float(pred[0] - piece.predict(np.array([bx[-1]]))[0])
        # significance against the noise: pooled within-bin variance, chi-square of flat vs fit
        multi = bc >= 2
        sigma2 = float(np.sum((bv * bc)[multi]) / max(float(np.sum(bc[multi])), 1.0)) / scale**2
        r2 = 1.0 - sse / sst if sst > 0 else 0.0
        if drop <= 0:
            reasons.append("the fitted loss does not fall")
        elif sigma2 > 0:
            flat_mean = float(np.sum(bc * yn) / np.sum(bc))
            gain = float(np.sum(bc * (yn - flat_mean) ** 2) - np.sum(bc * (yn - pred) ** 2))
            if gain / sigma2 < MIN_CHI2:
                reasons.append(f"fit beats a flat line by chi^2 {gain / sigma2:.1f} < {MIN_CHI2:g}")
        elif r2 < MIN_R2:
            reasons.append(f"R^2 {r2:.2f} < {MIN_R2}")
        pieces.append(piece)
        sse_total += sse
        sst_total += sst
    r2 = 1.0 - sse_total / sst_total if sst_total > 0 else 0.0
    trusted = not reasons
    return LossCurve(
        trusted=trusted,
        pieces=tuple(pieces),
        r2=r2,
        reason="fitted " + "+".join(p.kind for p in pieces) if trusted else "; ".join(reasons),
        scale=scale,
        offset=offset,
    )


def _detect_regime(
    x: FloatArray, y: FloatArray, offset: float, scale: float, curve: LossCurve, max_bins: int
) -> LossCurve | None:
    """Try one split at the largest sudden drop; keep it if the residual falls by 2x or more.

    The residual is compared between neighbouring occupied bins of 64 equal widths; with too
    few of them to tell a jump from the noise, no split is tried.
    """
    edges = np.linspace(x[0], x[-1] + 1, 65)
    idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, 63)
    counts = np.bincount(idx, minlength=64)
    sums = np.bincount(idx, weights=y, minlength=64)
    occupied = np.flatnonzero(counts > 0)
    if occupied.size < MIN_BINS:
        return None
    centres = (edges[occupied] + edges[occupied + 1]) / 2
    resid = sums[occupied] / counts[occupied] - (offset + scale * curve._normalised(centres))
    jumps = np.diff(resid)
    if not np.all(np.isfinite(jumps)):
        return None
    j = int(np.argmin(jumps))
    noise = float(np.median(np.abs(np.diff(jumps)))) + 1e-12
    if -jumps[j] < 8.0 * noise:
        return None
    cut = int(edges[occupied[j + 1]])
    split = _fit_pieces(x, y, offset, scale, [cut], max_bins)
    if not split.trusted:
        return None
    single = _sse_linear(x, y, curve)
    double = _sse_linear(x, y, split)
    return split if double * 2.0 <= single else None


def _sse_linear(x: FloatArray, y: FloatArray, curve: LossCurve) -> float:
    bx, by, _, _ = _bin(x, y, 64)
    return float(np.sum((curve.predict(bx) - by) ** 2))
