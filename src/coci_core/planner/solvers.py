"""The schedules that minimise :func:`~coci_core.planner.optimize.expected_cost`: uniform
intervals, the local closed-form rule ``T(k) = Daly(s, w_c / (lambda(k) rho(k)))`` and a dynamic
programme over a grid of candidate steps (a cell-averaged version of the exact cost)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from coci_core.knobs import MAX_GRID_POINTS
from coci_core.planner.checks import check_int
from coci_core.planner.optimize import (
    CostBreakdown,
    FloatArray,
    IntArray,
    Problem,
    daly_interval_s,
    value_at,
)

__all__ = ["closed_form_schedule", "dp_schedule", "uniform_schedule"]


def uniform_schedule(pb: Problem, interval_steps: float) -> IntArray:
    """Checkpoints every ``interval_steps`` (rounded, at least 1) from ``start_step``."""
    if not interval_steps < pb.end_step - pb.start_step:  # also infinite (an MTBF of 1e308 s)
        return np.empty(0, dtype=np.int64)
    k = max(1, round(interval_steps))
    return np.arange(pb.start_step + k, pb.end_step, k, dtype=np.int64)


def closed_form_schedule(pb: Problem, *, max_interval_steps: int | None = None) -> IntArray:
    """March ``T(k) = Daly(s, w_c / (lambda(k) rho(k)))`` from the start (the fast path).

    ``rho`` is the objective's weight of lost compute (its value-weighted part at the mean
    value density over the next interval: two fixed-point passes); ``w_c`` its weight of a stall
    (the value-weighted part at the local value density). Termination is ignored (it cancels to
    first order away from kill points).
    """
    wt = pb.cost_weights
    tau = pb.step_time_s
    cum: FloatArray = pb._value_cum  # type: ignore[attr-defined]
    out: list[int] = []
    x = pb.start_step
    interval = 1.0
    lam0 = pb.mean_rate(x, x + 1)
    interval = max(1.0, daly_interval_s(pb.stall_s, 1.0 / lam0) / tau)
    while True:
        for _ in range(2):
            hi = min(pb.end_step, x + max(1, round(interval)))
            a, b = x - pb.start_step, hi - pb.start_step
            rho = wt.lost_compute_s
            if wt.lost_compute_value_s:
                rho += wt.lost_compute_value_s * float(cum[b] - cum[a]) / max(1, b - a)
            w_c = wt.stall_s
            if wt.stall_value_s:
                w_c += wt.stall_value_s * value_at(pb, x)
            lam = pb.mean_rate(x, hi)
            if rho > 0:
                interval = max(1.0, daly_interval_s(pb.stall_s, w_c / (lam * rho)) / tau)
            else:  # lost work costs nothing: no checkpoint is worth its stall
                interval = float(pb.horizon_steps)
            if max_interval_steps is not None:
                interval = min(interval, float(max_interval_steps))
        nxt = x + max(1, round(interval))
        if nxt >= pb.end_step:
            break
        out.append(nxt)
        x = nxt
    return np.asarray(out, dtype=np.int64)


def _weighted(plain: float, by_value: float, value: Callable[[], Any]) -> Any:
    """``plain + by_value * value()``: the weight of one kind of overhead where the value
    density is ``value()`` (not computed when no weight is by value)."""
    return plain + by_value * value() if by_value else plain


def _grid(pb: Problem, points: int, extra: npt.ArrayLike) -> IntArray:
    n = pb.horizon_steps
    cell = max(1, math.ceil(n / points))
    g = np.arange(pb.start_step, pb.end_step, cell, dtype=np.int64)
    ex = np.asarray(extra, dtype=np.int64)
    ex = ex[(ex > pb.start_step) & (ex < pb.end_step)]
    return np.unique(np.concatenate([g, ex, [pb.start_step, pb.end_step]]))


def _dp_lost(
    e: FloatArray,
    d_a: FloatArray,
    lam: FloatArray,
    stall: FloatArray,
    win: FloatArray,
    rho_a: FloatArray,
    ws: FloatArray,
    rho_c: FloatArray,
) -> FloatArray:
    """Expected weighted loss of one attempt: compute d_a, stall, then the persist window."""
    tail = np.exp(-lam * e)
    ea = np.exp(-lam * d_a)
    eb = np.exp(-lam * (d_a + stall))
    return np.asarray(
        rho_a * (-np.expm1(-lam * d_a) / lam - d_a * tail)
        + ws * ((ea - eb) / lam - stall * tail)
        + rho_c * ((eb - tail) / lam - win * tail)
    )


def dp_schedule(
    pb: Problem,
    *,
    grid_points: int = 1000,
    max_interval_steps: int | None = None,
    band_factor: float = 2.0,
) -> IntArray:
    """Minimise the objective over checkpoints on a grid by dynamic programming.

    The segment cost is the exact one of :func:`expected_cost` with the value density averaged
    over the segment, the persist-window weight taken at the checkpoint and the wait for a
    previous persist charged to the segment that waits. Termination is exact per segment: a
    segment is paid in full if the job outlives its checkpoint, and as a final segment
    (no stall) up to each kill atom inside it otherwise; kill atoms (e.g. ASHA rungs) are
    grid points. Segments longer than ``band_factor`` times the longest closed-form interval
    are not considered, which bounds the work to O(grid x band), vectorised by blocks of rows.
    """
    check_int("grid_points", grid_points, minimum=2, maximum=MAX_GRID_POINTS)
    tau, s, p = pb.step_time_s, pb.stall_s, pb.persist_s
    wt = pb.cost_weights
    kill_steps, kill_probs = pb.termination.atoms(pb.start_step, pb.end_step)
    inner = kill_steps < pb.end_step
    atoms, atom_p = kill_steps[inner].astype(np.int64), kill_probs[inner]
    p_end = float(kill_probs[~inner].sum())
    g = _grid(pb, grid_points, atoms)
    n_g = len(g) - 1
    gi = g - pb.start_step
    vcum: FloatArray = pb._value_cum  # type: ignore[attr-defined]
    rcum: FloatArray = pb._rate_cum  # type: ignore[attr-defined]
    v_pt = pb.v[np.clip(gi, 0, pb.horizon_steps - 1)]
    # P(K > g) for every grid point (K the kill step; the end atom counts as "survives")
    # (one sum per atom, not per grid point: the atoms are sorted, so those after x are a tail)
    tails = np.array([float(atom_p[i:].sum()) + p_end for i in range(len(atoms) + 1)])
    tail_p = tails[np.searchsorted(atoms, g, side="right")]
    tail_p[-1] = p_end
    lam_min = float(np.min(rcum[1:] - rcum[:-1]))
    # the longest interval worth considering: Daly's at the lowest ratio of the weight of lost
    # compute to the weight of a stall
    lost_w = np.asarray(_weighted(wt.lost_compute_s, wt.lost_compute_value_s, lambda: pb.v))
    stall_w = np.asarray(_weighted(wt.stall_s, wt.stall_value_s, lambda: pb.v))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(stall_w > 0, lost_w / stall_w, np.inf)
    rho_min = float(np.min(ratio))
    if rho_min > 0:
        longest = daly_interval_s(s, 1.0 / (lam_min * rho_min)) / tau
    else:
        longest = float(pb.horizon_steps)
    if max_interval_steps is not None:
        longest = min(longest, float(max_interval_steps))
    band_steps = band_factor * longest + 2 * (pb.horizon_steps / n_g)
    band = max(8, int(np.searchsorted(g, g[0] + band_steps)) + 1)
    offsets = np.arange(1, band + 1)
    value = np.full(n_g + 1, np.inf)
    value[n_g] = 0.0
    nxt = np.full(n_g + 1, n_g, dtype=np.int64)
    block = max(1, 200_000 // (band + 1))
    for hi_row in range(n_g, 0, -block):
        rows = np.arange(max(0, hi_row - block), hi_row)
        js = np.concatenate(
            [np.minimum(rows[:, None] + offsets[None, :], n_g), np.full((len(rows), 1), n_g)],
            axis=1,
        )
        ii = rows[:, None]
        # absurd segments (e.g. exp(lambda E) beyond float range) become +inf, never NaN
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            cost = _dp_costs(pb, gi, js, ii, v_pt, vcum, rcum, tail_p, wt)
            if atoms.size:
                cost = cost + _dp_kill_costs(pb, g, gi, js, rows, atoms, atom_p, v_pt, wt)
        cost = np.where(np.isnan(cost), np.inf, cost)
        span = (gi[js] - gi[ii]).astype(np.float64)
        if max_interval_steps is not None:
            cost = np.where(span > max_interval_steps, np.inf, cost)
        # a checkpoint whose persist cannot finish before the end is never worth it
        cost = np.where((js == n_g) & (ii > 0) & (tau * span < p), np.inf, cost)
        for r in range(len(rows) - 1, -1, -1):
            i = int(rows[r])
            total = cost[r] + value[js[r]]
            k = int(np.argmin(total))
            value[i] = total[k]
            nxt[i] = js[r, k]
    out: list[int] = []
    i = int(nxt[0])
    while i < n_g:
        out.append(int(g[i]))
        i = int(nxt[i])
    return np.asarray(out, dtype=np.int64)


def _dp_costs(
    pb: Problem,
    gi: IntArray,
    js: IntArray,
    ii: IntArray,
    v_pt: FloatArray,
    vcum: FloatArray,
    rcum: FloatArray,
    tail_p: FloatArray,
    wt: CostBreakdown,
) -> FloatArray:
    """Cost of segments ``ii -> js`` when the job outlives ``js`` (x its probability)."""
    tau, s, p, r_s = pb.step_time_s, pb.stall_s, pb.persist_s, pb.restart_s
    n_g = len(gi) - 1
    span = np.maximum((gi[js] - gi[ii]).astype(np.float64), 1e-9)
    w = tau * span
    lam = (rcum[gi[js]] - rcum[gi[ii]]) / span
    is_end = js == n_g
    first = ii == 0
    pre = np.where(first, 0.0, np.minimum(w, p))
    stall = np.where(is_end, 0.0, s)
    win = np.where(is_end, 0.0, p)
    pre_wait = np.where(first | is_end, 0.0, np.maximum(0.0, p - w))
    d1 = w - pre
    e1 = d1 + stall + win
    e2 = w + stall + win
    q = -np.expm1(-lam * e1)
    n_fail = q * np.exp(lam * e2)
    ones = np.ones_like(w)
    # each kind of overhead's weight in the objective (x1.0 and +0.0 leave a weight exact)
    lc, lcv = wt.lost_compute_s, wt.lost_compute_value_s
    rho_a = _weighted(lc, lcv, lambda: (vcum[gi[js]] - vcum[gi[ii]]) / span) * ones
    rho_c = _weighted(lc, lcv, lambda: v_pt[js]) * ones
    ws = _weighted(wt.stall_s, wt.stall_value_s, lambda: v_pt[js]) * ones
    wls = _weighted(wt.lost_stall_s, wt.lost_stall_value_s, lambda: v_pt[js]) * ones
    wr = _weighted(wt.restart_s, wt.restart_value_s, lambda: v_pt[ii]) * ones
    parts = (lam, stall, win, rho_a, wls, rho_c)
    lost_total = q * pre * rho_a + _dp_lost(e1, d1, *parts) + n_fail * _dp_lost(e2, w, *parts)
    cost = (stall + pre_wait) * ws + lost_total + r_s * wr * n_fail
    if wt.failures:
        cost = cost + wt.failures * n_fail
    return np.asarray(tail_p[js] * cost)


def _dp_kill_costs(
    pb: Problem,
    g: IntArray,
    gi: IntArray,
    js: IntArray,
    rows: IntArray,
    atoms: IntArray,
    atom_p: FloatArray,
    v_pt: FloatArray,
    wt: CostBreakdown,
) -> FloatArray:
    """Expected cost of segments cut short by a kill at an atom inside them."""
    tau, p, r_s = pb.step_time_s, pb.persist_s, pb.restart_s
    vcum: FloatArray = pb._value_cum  # type: ignore[attr-defined]
    rcum: FloatArray = pb._rate_cum  # type: ignore[attr-defined]
    a = gi[rows][:, None].astype(np.int64)
    r = (atoms - pb.start_step)[None, :]
    span = np.maximum((r - a).astype(np.float64), 1e-9)
    w = tau * span
    lam = np.maximum((rcum[np.maximum(r, a)] - rcum[a]) / span, 1e-300)
    pre = np.where(rows[:, None] == 0, 0.0, np.minimum(w, p))
    zero = np.zeros_like(w)
    ones = np.ones_like(w)
    lc, lcv = wt.lost_compute_s, wt.lost_compute_value_s
    rho = _weighted(lc, lcv, lambda: (vcum[np.maximum(r, a)] - vcum[a]) / span) * ones
    wr = _weighted(wt.restart_s, wt.restart_value_s, lambda: v_pt[rows][:, None]) * ones
    d1 = w - pre
    q = -np.expm1(-lam * d1)
    n_fail = q * np.exp(lam * w)
    parts = (lam, zero, zero, rho, zero, zero)
    lost = q * pre * rho + _dp_lost(d1, d1, *parts) + n_fail * _dp_lost(w, w, *parts)
    per_kill = lost + r_s * wr * n_fail
    if wt.failures:
        per_kill = per_kill + wt.failures * n_fail
    per_atom = np.where(r > a, atom_p[None, :] * per_kill, 0.0)
    cum = np.concatenate([np.zeros((len(rows), 1)), np.cumsum(per_atom, axis=1)], axis=1)
    upto = np.searchsorted(atoms, g[js], side="right")  # atoms <= the segment's end
    return np.asarray(np.take_along_axis(cum, upto, axis=1))
