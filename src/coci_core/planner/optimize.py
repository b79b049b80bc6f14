"""The exact expected cost of a checkpoint schedule (the schedules that minimise it are in
:mod:`coci_core.planner.solvers`).

The mechanism modelled (the same for every policy): at a checkpoint step the job first waits for
the previous checkpoint's persist to finish, then stalls ``stall_s`` for a consistent snapshot,
then persists for ``persist_s`` in the background while training continues. A checkpoint is
durable only when its persist is done; a failure rolls back to the newest *durable* checkpoint
(so a failure inside the persist window of the newest one rolls back to the one before), costs
``restart_s``, and training resumes with nothing in flight. Failures are Poisson with the rate of
a :class:`~coci_core.planner.model.FailureModel` (evaluated per segment), and never strike during
a restart. The job ends when it reaches ``end_step`` or is stopped by its termination model.

Between two durable points the process renews, which gives each segment a closed form: with
first-attempt exposure ``e1`` and retry exposure ``E2`` the expected time is
``(1 - exp(-lambda e1)) · exp(lambda E2) · (1/lambda + R)``, and the expected lost work is an
integral of the weights against ``exp(-lambda t) - exp(-lambda e)``. :func:`expected_cost` sums
those exactly (per step);
:func:`dp_schedule` minimises a cell-averaged version over a grid of candidate steps;
:func:`closed_form_schedule` is the local rule ``T(k) = Daly(s, w_c / (lambda(k) rho(k)))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from coci_core.errors import ConfigError
from coci_core.planner.checks import check_int, check_nonnegative, check_positive
from coci_core.planner.model import FailureModel, NoTermination, Termination
from coci_core.planner.objectives import FIELDS as _FIELDS
from coci_core.planner.objectives import (
    OBJECTIVES,
    CostBreakdown,
    Objective,
    make_objective,
)

__all__ = [
    "OBJECTIVES",
    "CostBreakdown",
    "Problem",
    "daly_interval_s",
    "expected_cost",
    "normalize_steps",
    "young_interval_s",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: value density is floored here so that late intervals stay finite (at most 10x Young's).
VALUE_FLOOR = 0.01


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young (1974): ``sqrt(2 s M)``."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Daly (2006, eq. 37): the higher-order estimate of the optimal compute interval."""
    s, m = stall_s, mtbf_s
    if s >= 2.0 * m:
        return m
    r = s / (2.0 * m)
    return math.sqrt(2.0 * s * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - s


@dataclass(frozen=True, kw_only=True, eq=False)
class Problem:
    """Everything the cost model needs, in one place (times in any one unit, steps as ints).

    Args:
        start_step: the step the plan starts from (the latest durable state).
        end_step: the step at which the job ends (exclusive bound for checkpoints).
        step_time_s: compute time of one step.
        stall_s: blocking snapshot time of a checkpoint.
        persist_s: background persist time (0 for a synchronous save).
        restart_s: time to restart and restore after a failure.
        failure: the failure model.
        value: normalised value density per step of ``[start_step, end_step)`` (mean 1);
            None for a flat value.
        objective: ``"time"``, ``"convergence"``, ``"progress"`` or the name of another
            objective of :data:`~coci_core.planner.objectives.OBJECTIVES`.
        termination: the early-termination model.
    """

    start_step: int
    end_step: int
    step_time_s: float
    stall_s: float
    persist_s: float
    restart_s: float
    failure: FailureModel
    value: FloatArray | None = None
    objective: str = "time"
    termination: Termination = field(default_factory=NoTermination)

    def __post_init__(self) -> None:
        check_int("start_step", self.start_step, minimum=0)
        check_int("end_step", self.end_step, minimum=self.start_step + 1)
        check_positive("step_time_s", self.step_time_s)
        check_positive("stall_s", self.stall_s)
        check_nonnegative("persist_s", self.persist_s)
        check_nonnegative("restart_s", self.restart_s)
        object.__setattr__(self, "_goal", make_objective(self.objective))
        n = self.end_step - self.start_step
        if self.value is None:
            value = np.ones(n)
        else:
            value = np.asarray(self.value, dtype=np.float64)
            if value.shape != (n,) or not np.all(np.isfinite(value)) or np.any(value < 0):
                raise ConfigError(
                    f"'value' must be {n} finite values >= 0, one per step: shape {value.shape}"
                )
        object.__setattr__(self, "value", np.maximum(value, VALUE_FLOOR))
        steps = np.arange(self.start_step, self.end_step)
        rate = (
            np.full(n, 1.0 / self.failure.mtbf_s * float(self.failure.nodes))  # type: ignore[arg-type]
            if self.failure.is_constant
            else self.failure.rate_per_s(steps)
        )
        object.__setattr__(self, "_rate", rate)
        object.__setattr__(self, "_rate_cum", np.concatenate([[0.0], np.cumsum(rate)]))
        object.__setattr__(self, "_value_cum", np.concatenate([[0.0], np.cumsum(self.v)]))

    @property
    def v(self) -> FloatArray:
        """The (floored) value density per step."""
        return self.value  # type: ignore[return-value]

    @property
    def goal(self) -> Objective:
        """The objective named by :attr:`objective`."""
        goal: Objective = self._goal  # type: ignore[attr-defined]
        return goal

    @property
    def horizon_steps(self) -> int:
        """Number of steps planned over."""
        return self.end_step - self.start_step

    def mean_rate(self, lo: float, hi: float) -> float:
        """Mean failure rate (1/s) over steps ``[lo, hi)``."""
        cum: FloatArray = self._rate_cum  # type: ignore[attr-defined]
        a = int(np.clip(math.floor(lo) - self.start_step, 0, self.horizon_steps - 1))
        b = int(np.clip(math.ceil(hi) - self.start_step, a + 1, self.horizon_steps))
        return float(cum[b] - cum[a]) / (b - a)

    def weights(self) -> tuple[bool, bool]:
        """(lost compute weighted by value, stall and restart weighted by value)."""
        return self.goal.lost_work_by_value, self.goal.stall_by_value

    @property
    def cost_weights(self) -> CostBreakdown:
        """The weight of each field of a :class:`CostBreakdown` in the objective: what the
        solvers minimise."""
        return self.goal.weights


def normalize_steps(steps: npt.ArrayLike, start_step: int, end_step: int) -> IntArray:
    """Sorted unique integer steps strictly inside ``(start_step, end_step)``."""
    arr = np.unique(np.asarray(steps, dtype=np.float64).round().astype(np.int64))
    return arr[(arr > start_step) & (arr < end_step)]


# ----------------------------------------------------------------------------- exact evaluation


def _exp_integrals(
    pb: Problem, u0: float, u1: float, c: float
) -> tuple[float, float, float, float]:
    """integral over steps [u0, u1) of (1, v) x (e^{-c(u-u0)}, 1) du, for piecewise-constant v."""
    if u1 <= u0:
        return 0.0, 0.0, 0.0, 0.0
    k0, k1 = math.floor(u0), math.ceil(u1)
    ks = np.arange(k0, k1)
    lo = np.maximum(ks, u0)
    hi = np.minimum(ks + 1, u1)
    idx = np.clip(ks - pb.start_step, 0, pb.horizon_steps - 1)
    v = pb.v[idx]
    width = hi - lo
    small = c * (u1 - u0) < 1e-12
    ex = width if small else np.exp(-c * (lo - u0)) * -np.expm1(-c * width) / c
    return float(ex.sum()), float((v * ex).sum()), float(width.sum()), float((v * width).sum())


def value_at(pb: Problem, step: float) -> float:
    """The weight ``v`` of progress at ``step`` (clipped to the horizon)."""
    return float(pb.v[int(np.clip(int(step) - pb.start_step, 0, pb.horizon_steps - 1))])


def _segment_vector(
    pb: Problem, pts: FloatArray, i: int, w_all: FloatArray | None = None
) -> FloatArray:
    """Expected cost components of segment ``i`` of the schedule ``pts`` (start, ckpts..., end).

    ``w_all`` (``step_time_s * diff(pts)``) is passed by callers that visit every segment, so
    that a schedule's cost stays linear in its number of checkpoints.
    """
    tau, s, p, r_s = pb.step_time_s, pb.stall_s, pb.persist_s, pb.restart_s
    n = len(pts) - 2  # number of checkpoints
    if w_all is None:
        w_all = tau * np.diff(pts)
    merged = n >= 1 and w_all[n] < p
    a, b = float(pts[i]), float(pts[i + 1])
    w = float(w_all[i])
    is_ckpt = i < n
    pre = 0.0 if i == 0 else min(w, p)
    if is_ckpt:
        stall = s
        if merged and i == n - 1:
            win_c, win_wait, wait_at = float(w_all[n]), 0.0, b
        else:
            win_c = min(p, float(w_all[i + 1]))
            win_wait = max(0.0, p - float(w_all[i + 1]))
            wait_at = float(pts[i + 2])
    else:
        stall, win_c, win_wait, wait_at = 0.0, 0.0, 0.0, b
    d_first = w - pre
    e1 = d_first + stall + win_c + win_wait
    e2 = w + stall + win_c + win_wait
    lam = pb.mean_rate(a, b + win_c / tau)
    q = -math.expm1(-lam * e1)
    n_fail = q * math.exp(min(lam * e2, 700.0))  # capped: beyond it the job never finishes
    ws_b, ws_w, wr = value_at(pb, b), value_at(pb, wait_at), value_at(pb, a)
    # the pre-durable part (compute of this segment done inside the previous persist window)
    _, _, pre_plain, pre_val = _exp_integrals(pb, a, a + pre / tau, 0.0)

    def lost(first: bool, e: float) -> FloatArray:
        u0 = a + pre / tau if first else a
        d_a = w - pre if first else w
        tail = math.exp(-lam * e)
        exa, exa_v, pla, pla_v = _exp_integrals(pb, u0, b, lam * tau)
        exc, exc_v, plc, plc_v = _exp_integrals(pb, b, b + win_c / tau, lam * tau)
        t_c = d_a + stall
        e_c = math.exp(-lam * t_c)
        comp = tau * (exa - tail * pla) + tau * (e_c * exc - tail * plc)
        comp_v = tau * (exa_v - tail * pla_v) + tau * (e_c * exc_v - tail * plc_v)

        def const_piece(t0: float, dur: float) -> float:
            if dur <= 0:
                return 0.0
            return math.exp(-lam * t0) * -math.expm1(-lam * dur) / lam - dur * tail

        jb = const_piece(d_a, stall)
        jd = const_piece(d_a + stall + win_c, win_wait)
        return np.array([comp, comp_v, jb + jd, jb * ws_b + jd * ws_w])

    l1 = lost(True, e1)
    l2 = lost(False, e2)
    tot = l1 + n_fail * l2
    tot[0] += q * tau * pre_plain
    tot[1] += q * tau * pre_val
    return np.array(
        [
            stall + win_wait,
            tot[0],
            tot[2],
            r_s * n_fail,
            n_fail,
            stall * ws_b + win_wait * ws_w,
            tot[1],
            tot[3],
            r_s * n_fail * wr,
        ]
    )


def _horizon_vectors(pb: Problem, ckpts: IntArray, end: int) -> FloatArray:
    pts = np.concatenate([[pb.start_step], ckpts, [end]]).astype(np.float64)
    n = len(ckpts)
    merged = n >= 1 and pb.step_time_s * (pts[-1] - pts[-2]) < pb.persist_s
    count = n if merged else n + 1
    w_all = pb.step_time_s * np.diff(pts)
    return np.array([_segment_vector(pb, pts, i, w_all) for i in range(count)])


def expected_cost(pb: Problem, steps: npt.ArrayLike) -> CostBreakdown:
    """Exact expected overhead of checkpointing at ``steps`` (see the module docstring).

    Exact for a constant failure rate; with a rate that varies by step the rate is averaged per
    segment. Termination is a mixture over the model's kill atoms.
    """
    ckpts = normalize_steps(steps, pb.start_step, pb.end_step)
    full = _horizon_vectors(pb, ckpts, pb.end_step)
    prefix = np.vstack([np.zeros(len(_FIELDS)), np.cumsum(full, axis=0)])
    kill_steps, probs = pb.termination.atoms(pb.start_step, pb.end_step)
    total = np.zeros(len(_FIELDS))
    for kill, prob in zip(kill_steps, probs, strict=True):
        end = int(kill)
        if prob <= 0:
            continue
        if end >= pb.end_step:
            total += prob * prefix[-1]
            continue
        c = ckpts[ckpts < end]
        n_k = len(c)
        # segments before the last two are unchanged by the truncation
        keep = max(0, n_k - 1)
        pts = np.concatenate([[pb.start_step], c, [end]]).astype(np.float64)
        merged = n_k >= 1 and pb.step_time_s * (pts[-1] - pts[-2]) < pb.persist_s
        count = n_k if merged else n_k + 1
        tail = sum(
            (_segment_vector(pb, pts, i) for i in range(keep, count)), np.zeros(len(_FIELDS))
        )
        total += prob * (prefix[keep] + tail)
    return CostBreakdown.from_vector(total)
