"""Monte Carlo of checkpointed runs, with common random numbers across policies.

Every policy sees the same failure times (a Poisson process in wall-clock time per run) and the
same termination step per run. Runs are vectorised with numpy: each loop iteration advances
every live run to its next failure (or to its end). The mechanism is the one in
:mod:`coci_core.planner.optimize`; :func:`~coci_core.planner.optimize.expected_cost` must agree
with the mean here within the confidence interval (a test checks it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from coci_core.errors import ConfigError
from coci_core.planner.checks import check_int
from coci_core.planner.optimize import Problem, normalize_steps

__all__ = ["METRICS", "MetricEstimate", "SimulationResult", "simulate"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: metric name -> description; every metric is an overhead in seconds per run.
METRICS = {
    "wall_s": "wall-clock overhead (stall + lost work + restart)",
    "convergence_excl_restart_s": "stall + value-weighted lost compute (restart excluded)",
    "progress_s": "everything weighted by the value of progress",
    "restart_s": "restart time",
    "failures": "failures per run",
}

_BLOCK = 16  # failure gaps are drawn in blocks of columns, so extending never reshuffles


@dataclass(frozen=True, kw_only=True)
class MetricEstimate:
    """Mean over runs and the half-width of its confidence interval."""

    mean: float
    half_width: float

    def __str__(self) -> str:
        return f"{self.mean:.1f} ± {self.half_width:.1f}"


@dataclass(frozen=True, kw_only=True)
class SimulationResult:
    """Per-policy metric estimates (``rows[policy][metric]``) and the settings used."""

    rows: dict[str, dict[str, MetricEstimate]]
    runs: int
    seed: int
    confidence: float

    def table(
        self, metrics: tuple[str, ...] = ("wall_s", "convergence_excl_restart_s", "progress_s")
    ) -> str:
        """A plain-text table of policies x metrics with confidence intervals."""
        head = ["policy", *metrics]
        lines = [" | ".join(f"{h:>26}" for h in head)]
        for name, row in self.rows.items():
            lines.append(" | ".join([f"{name:>26}", *(f"{row[m]!s:>26}" for m in metrics)]))
        return "\n".join(lines)


def _failure_gaps(seed: int, runs: int, blocks: int) -> FloatArray:
    parts = [
        np.random.default_rng([seed, 1, b]).standard_exponential((runs, _BLOCK))
        for b in range(blocks)
    ]
    return np.concatenate(parts, axis=1)


def _kill_steps(pb: Problem, seed: int, runs: int) -> FloatArray:
    kills, probs = pb.termination.atoms(pb.start_step, pb.end_step)
    cdf = np.cumsum(probs) / float(np.sum(probs))
    u = np.random.default_rng([seed, 2]).random(runs)
    return np.asarray(kills[np.minimum(np.searchsorted(cdf, u, side="right"), len(kills) - 1)])


class _OutOfFailures(Exception):
    """A run needed more failure times than were drawn (the caller draws more)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class _Table:
    """Per-segment arrays of one schedule truncated at one end step."""

    a: FloatArray
    b: FloatArray
    w: FloatArray
    pre: FloatArray
    stall: FloatArray
    win_c: FloatArray
    win_wait: FloatArray
    wait_at: FloatArray
    e1: FloatArray
    e2: FloatArray


def _table(pb: Problem, ckpts: IntArray, end: int) -> _Table:
    tau, s, p = pb.step_time_s, pb.stall_s, pb.persist_s
    pts = np.concatenate([[pb.start_step], ckpts, [end]]).astype(np.float64)
    n = len(ckpts)
    w_all = tau * np.diff(pts)
    merged = n >= 1 and w_all[n] < p
    count = n if merged else n + 1
    idx = np.arange(count)
    a, b, w = pts[:count], pts[1 : count + 1], w_all[:count]
    pre = np.where(idx == 0, 0.0, np.minimum(w, p))
    is_ckpt = idx < n
    stall = np.where(is_ckpt, s, 0.0)
    nxt_w = np.append(w_all[1:], 0.0)[:count]
    win_c = np.where(is_ckpt, np.minimum(p, nxt_w), 0.0)
    win_wait = np.where(is_ckpt, np.maximum(0.0, p - nxt_w), 0.0)
    wait_at = np.append(pts[2:], end)[:count]
    if merged:
        win_c[-1], win_wait[-1], wait_at[-1] = w_all[n], 0.0, pts[n]
    e2 = w + stall + win_c + win_wait
    e1 = e2 - pre
    return _Table(
        a=a,
        b=b,
        w=w,
        pre=pre,
        stall=stall,
        win_c=win_c,
        win_wait=win_wait,
        wait_at=wait_at,
        e1=e1,
        e2=e2,
    )


def _simulate_group(
    pb: Problem, ckpts: IntArray, end: int, gaps: FloatArray, lam: float
) -> dict[str, FloatArray]:
    """Simulate ``len(gaps)`` runs of one schedule ending at ``end``."""
    tau, r_s = pb.step_time_s, pb.restart_s
    tb = _table(pb, ckpts, end)
    m = len(tb.a)
    runs = gaps.shape[0]
    fail_t = np.cumsum(gaps, axis=1) / lam
    vcum = pb._value_cum  # type: ignore[attr-defined]
    grid = np.arange(len(vcum), dtype=np.float64) + pb.start_step

    def vint(u0: FloatArray, u1: FloatArray) -> FloatArray:
        return np.asarray(tau * (np.interp(u1, grid, vcum) - np.interp(u0, grid, vcum)))

    def v_at(step: FloatArray) -> FloatArray:
        return np.asarray(
            pb.v[np.clip(step.astype(np.int64) - pb.start_step, 0, pb.horizon_steps - 1)]
        )

    ce1 = np.cumsum(tb.e1)
    succ = tb.stall + tb.win_wait
    succ_v = tb.stall * v_at(tb.b) + tb.win_wait * v_at(tb.wait_at)
    cs = np.concatenate([[0.0], np.cumsum(succ)])
    cs_v = np.concatenate([[0.0], np.cumsum(succ_v)])
    out = {
        k: np.zeros(runs)
        for k in (
            "stall_s",
            "stall_value_s",
            "lost_compute_s",
            "lost_compute_value_s",
            "lost_stall_s",
            "lost_stall_value_s",
            "restart_s",
            "restart_value_s",
            "failures",
            "end_time_s",
        )
    }
    seg = np.zeros(runs, dtype=np.int64)
    fresh = np.ones(runs, dtype=bool)
    t0 = np.zeros(runs)
    ptr = np.zeros(runs, dtype=np.int64)
    live = np.arange(runs)
    while live.size:
        if int(ptr[live].max()) >= fail_t.shape[1]:
            raise _OutOfFailures
        i, fr, t = seg[live], fresh[live], t0[live]
        f = fail_t[live, ptr[live]]
        e_cur = np.where(fr, tb.e2[i], tb.e1[i])
        fin_last = t + e_cur + ce1[m - 1] - ce1[i]
        done = f >= fin_last
        d = live[done]
        di = i[done]
        out["end_time_s"][d] = fin_last[done]
        out["stall_s"][d] += cs[m] - cs[di]
        out["stall_value_s"][d] += cs_v[m] - cs_v[di]
        nd = ~done
        live, i, fr, t, f, e_cur = live[nd], i[nd], fr[nd], t[nd], f[nd], e_cur[nd]
        if not live.size:
            break
        in_cur = f < t + e_cur
        z = f - t - e_cur + ce1[i]
        j = np.where(in_cur, i, np.searchsorted(ce1, z, side="right"))
        start_j = np.where(in_cur, t, t + e_cur + ce1[np.maximum(j - 1, 0)] - ce1[i])
        mode_first = np.where(in_cur, ~fr, True)
        y = f - start_j
        out["stall_s"][live] += cs[j] - cs[i]
        out["stall_value_s"][live] += cs_v[j] - cs_v[i]
        a, b, w, pre = tb.a[j], tb.b[j], tb.w[j], np.where(mode_first, tb.pre[j], 0.0)
        u0 = a + pre / tau
        d_a = w - pre
        yc = np.clip(y, 0.0, d_a)
        ys = np.clip(y - d_a, 0.0, tb.stall[j])
        yw = np.clip(y - d_a - tb.stall[j], 0.0, tb.win_c[j])
        yd = np.clip(y - d_a - tb.stall[j] - tb.win_c[j], 0.0, tb.win_wait[j])
        out["lost_compute_s"][live] += pre + yc + yw
        out["lost_compute_value_s"][live] += (
            vint(a, u0) + vint(u0, u0 + yc / tau) + vint(b, b + yw / tau)
        )
        out["lost_stall_s"][live] += ys + yd
        out["lost_stall_value_s"][live] += ys * v_at(b) + yd * v_at(tb.wait_at[j])
        out["restart_s"][live] += r_s
        out["restart_value_s"][live] += r_s * v_at(a)
        out["failures"][live] += 1
        seg[live] = j
        fresh[live] = True
        t0[live] = f + r_s
        ptr[live] = np.sum(fail_t[live] <= (f + r_s)[:, None], axis=1)
    out["end_time_s"] -= tau * (end - pb.start_step)
    return out


def simulate(
    schedules: Mapping[str, npt.ArrayLike],
    problem: Problem,
    *,
    runs: int = 20_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> SimulationResult:
    """Simulate each schedule on the same failures and terminations.

    Args:
        schedules: policy name -> checkpoint steps.
        problem: costs, failure model (constant rate), value density and termination.
        runs: Monte Carlo runs per schedule.
        seed: seed of the common random numbers.
        confidence: confidence level of the reported intervals (normal approximation).

    Returns:
        Means and confidence half-widths of :data:`METRICS` per policy.

    Raises:
        ConfigError: on bad arguments or a failure rate that varies by step.
    """
    check_int("runs", runs, minimum=2)
    check_int("seed", seed, minimum=0)
    if not 0 < confidence < 1:
        raise ConfigError(f"'confidence' must be in (0, 1): {confidence!r}")
    if not problem.failure.is_constant:
        raise ConfigError("'problem' must have a constant failure rate to be simulated")
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + confidence / 2))
    lam = problem.mean_rate(problem.start_step, problem.end_step)
    kills = _kill_steps(problem, seed, runs)
    rows: dict[str, dict[str, MetricEstimate]] = {}
    for name, steps in schedules.items():
        ckpts = normalize_steps(steps, problem.start_step, problem.end_step)
        # enough failure times for a run ~4x longer than its compute, plus slack
        span = problem.horizon_steps * problem.step_time_s + len(ckpts) * (
            problem.stall_s + problem.persist_s
        )
        expect = lam * span * 4.0
        blocks = max(1, math.ceil((expect + 10 * math.sqrt(expect) + 20) / _BLOCK))
        gaps = _failure_gaps(seed, runs, blocks)
        per_run = {
            k: np.zeros(runs)
            for k in (
                "wall_s",
                "convergence_excl_restart_s",
                "progress_s",
                "restart_s",
                "failures",
                "end_time_s",
            )
        }
        for kill in np.unique(kills):
            mask = kills == kill
            while True:
                try:
                    res = _simulate_group(problem, ckpts[ckpts < kill], int(kill), gaps[mask], lam)
                    break
                except _OutOfFailures:
                    # the same seed and blocks give the same first columns: CRN is preserved
                    if blocks >= 4096:
                        raise ConfigError(
                            f"'schedules' entry {name!r} needs more than "
                            f"{blocks * _BLOCK} failures per run: the job hardly ever finishes"
                        ) from None
                    blocks *= 2
                    gaps = _failure_gaps(seed, runs, blocks)
            per_run["wall_s"][mask] = (
                res["stall_s"] + res["lost_compute_s"] + res["lost_stall_s"] + res["restart_s"]
            )
            per_run["convergence_excl_restart_s"][mask] = (
                res["stall_s"] + res["lost_compute_value_s"] + res["lost_stall_s"]
            )
            per_run["progress_s"][mask] = (
                res["stall_value_s"]
                + res["lost_compute_value_s"]
                + res["lost_stall_value_s"]
                + res["restart_value_s"]
            )
            per_run["restart_s"][mask] = res["restart_s"]
            per_run["failures"][mask] = res["failures"]
            per_run["end_time_s"][mask] = res["end_time_s"]
        row = {
            k: MetricEstimate(
                mean=float(x.mean()), half_width=z * float(x.std(ddof=1)) / math.sqrt(runs)
            )
            for k, x in per_run.items()
        }
        rows[name] = row
    return SimulationResult(rows=rows, runs=runs, seed=seed, confidence=confidence)
