"""Two-level checkpointing: how often to save to the local tier, and every how many local
saves to copy to the remote tier.

The first-order model of two-level checkpointing (Vaidya, "A case for two-level distributed
recovery schemes", SIGMETRICS 1995; Di, Bouguerra, Bautista-Gomez and Cappello, "Optimization of
multi-level checkpoint model for large scale HPC applications", IPDPS 2014, with two levels):
a local save every ``T`` seconds of work costs ``C1``; every ``k``-th is also made remote at an
extra cost ``C2``. Failures of the first kind (a process crash, rate ``lambda1``) keep the local
copy: they cost the restart ``R1`` and on average half a local interval of work; failures of the
second kind (a lost node, rate ``lambda2``) keep only the remote copy: ``R2`` and half a remote
interval. The overhead per second of work is then, to first order,

    H(T, k) = C1 / T + C2 / (k T) + lambda1 (R1 + T / 2) + lambda2 (R2 + k T / 2),

minimised over ``T`` by ``T*(k) = sqrt(2 (C1 + C2 / k) / (lambda1 + k lambda2))`` with
``H*(k) = sqrt(2 (C1 + C2 / k)(lambda1 + k lambda2)) + lambda1 R1 + lambda2 R2``, and over a
real ``k`` by ``k* = sqrt(C2 lambda1 / (C1 lambda2))`` (the best integer is next to it). With
``k = 1`` and ``lambda2 = 0`` this is Young's ``sqrt(2 C / lambda)`` for ``C = C1 + C2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coci_core.planner.checks import check_nonnegative, check_positive

__all__ = ["TierCosts", "TwoLevelPlan", "overhead_rate", "plan_two_levels"]

_MAX_UPLOAD_EVERY = 1_000_000


@dataclass(frozen=True, kw_only=True)
class TwoLevelPlan:
    """The best two-level schedule and the one-level alternatives it is compared with.

    Attributes:
        local_interval_s: seconds of work between local saves.
        upload_every: every how many local saves one is made remote.
        expected_overhead: the overhead per second of work of this plan (first order).
        remote_every_save_overhead: the best plan that makes every save remote (``k = 1``).
        local_only_overhead: the best plan without a remote tier (node losses then restart
            the job from its beginning: infinite for a job of unbounded length, so this is
            only finite when ``lambda2 = 0``).
    """

    local_interval_s: float
    upload_every: int
    expected_overhead: float
    remote_every_save_overhead: float
    local_only_overhead: float


@dataclass(frozen=True, kw_only=True)
class TierCosts:
    """What each tier costs and how often each kind of failure strikes.

    Attributes:
        local_cost_s: what a local save costs the training loop (stall, and the slowdown of
            the steps it overlaps).
        remote_cost_s: what making a save remote adds (0 when the upload overlaps training
            for free; more when it competes for the network or CPU).
        local_restart_s: restart time from the local tier (a process crash).
        remote_restart_s: restart time from the remote tier (a new node).
        crash_rate: failures per second that keep the local tier (``1 / MTBF`` of crashes).
        node_loss_rate: failures per second that lose the local tier.

    Raises:
        ConfigError: a cost or restart time is negative, ``local_cost_s`` is not positive, a
            rate is negative, or both rates are 0.
    """

    local_cost_s: float
    remote_cost_s: float
    local_restart_s: float
    remote_restart_s: float
    crash_rate: float
    node_loss_rate: float

    def __post_init__(self) -> None:
        check_positive("local_cost_s", self.local_cost_s)
        for name in ("remote_cost_s", "local_restart_s", "remote_restart_s"):
            check_nonnegative(name, getattr(self, name))
        check_nonnegative("crash_rate", self.crash_rate)
        check_nonnegative("node_loss_rate", self.node_loss_rate)
        if self.crash_rate + self.node_loss_rate <= 0:
            check_positive("crash_rate + node_loss_rate", 0.0)


def overhead_rate(interval_s: float, upload_every: int, costs: TierCosts) -> float:
    """``H(T, k)`` of the module docstring: expected overhead seconds per second of work."""
    t, k, c = interval_s, upload_every, costs
    return (
        c.local_cost_s / t
        + c.remote_cost_s / (k * t)
        + c.crash_rate * (c.local_restart_s + t / 2)
        + c.node_loss_rate * (c.remote_restart_s + k * t / 2)
    )


def _best_interval(c1: float, c2: float, lam1: float, lam2: float, k: int) -> float:
    return math.sqrt(2 * (c1 + c2 / k) / (lam1 + k * lam2))


def plan_two_levels(costs: TierCosts) -> TwoLevelPlan:
    """The local interval and upload period that minimise :func:`overhead_rate`."""
    c1, c2 = costs.local_cost_s, costs.remote_cost_s
    lam1, lam2 = costs.crash_rate, costs.node_loss_rate

    def cost(k: int) -> float:
        return overhead_rate(_best_interval(c1, c2, lam1, lam2, k), k, costs)

    if lam2 == 0:
        k_real = float(_MAX_UPLOAD_EVERY)
    else:
        k_real = min(math.sqrt(c2 * lam1 / (c1 * lam2)), float(_MAX_UPLOAD_EVERY))
    candidates = {max(1, math.floor(k_real)), max(1, math.ceil(k_real))}
    k = min(candidates, key=lambda n: (cost(n), n))
    local_only = (
        math.sqrt(2 * c1 * lam1) + lam1 * costs.local_restart_s
        if lam2 == 0 and lam1 > 0
        else math.inf
    )
    return TwoLevelPlan(
        local_interval_s=_best_interval(c1, c2, lam1, lam2, k),
        upload_every=k,
        expected_overhead=cost(k),
        remote_every_save_overhead=cost(1),
        local_only_overhead=local_only,
    )
