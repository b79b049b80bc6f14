"""Two-level checkpointing: the plan's formula, its limits, a brute-force optimum and
a seeded Monte-Carlo simulation of crashes and node losses."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from coci_core import ConfigError
from coci_core.planner.two_level import TierCosts, overhead_rate, plan_two_levels

BASE = {
    "local_cost_s": 2.0,
    "remote_cost_s": 20.0,
    "local_restart_s": 30.0,
    "remote_restart_s": 120.0,
    "crash_rate": 1 / 3600,
    "node_loss_rate": 1 / 36000,
}


def test_without_node_losses_it_is_youngs_formula() -> None:
    plan = plan_two_levels(TierCosts(**{**BASE, "node_loss_rate": 0.0}))
    # uploads every 10^6 saves: their cost per save vanishes
    assert plan.local_interval_s == pytest.approx(math.sqrt(2 * 2.0 * 3600), rel=1e-4)
    assert plan.local_only_overhead == pytest.approx(plan.expected_overhead, rel=1e-3)
    # every save remote and no node losses: Young for the sum of both costs
    one = plan_two_levels(TierCosts(**{**BASE, "node_loss_rate": 0.0, "remote_cost_s": 0.0}))
    assert one.local_interval_s == pytest.approx(math.sqrt(2 * 2.0 * 3600))


def test_the_plan_is_the_brute_force_minimum() -> None:
    costs = TierCosts(**BASE)
    plan = plan_two_levels(costs)
    grid = np.geomspace(10, 100_000, 4000)
    best = min(overhead_rate(float(t), k, costs) for k in range(1, 60) for t in grid)
    assert plan.expected_overhead <= best * (1 + 1e-6)
    assert plan.expected_overhead >= best * (1 - 1e-3)
    assert plan.upload_every > 1  # uploads cost 10x a local save: not every save goes remote
    assert plan.expected_overhead < plan.remote_every_save_overhead
    assert math.isinf(plan.local_only_overhead)  # node losses without a remote copy


def test_uploads_are_rarer_when_they_cost_more_and_nodes_fail_less() -> None:
    ks = [
        plan_two_levels(TierCosts(**{**BASE, "remote_cost_s": c})).upload_every
        for c in (2, 20, 200)
    ]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    ks = [
        plan_two_levels(TierCosts(**{**BASE, "node_loss_rate": r})).upload_every
        for r in (1 / 3600, 1 / 36000, 1 / 360000)
    ]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert plan_two_levels(TierCosts(**{**BASE, "remote_cost_s": 0.0})).upload_every == 1


def _simulate(plan_t: float, k: int, work_s: float, seed: int) -> float:
    """Overhead per second of work of one run: saves every ``plan_t`` s of work (every k-th
    also remote), crashes roll back to the last local save, node losses to the last remote
    one; failures strike during work and saves, not during restarts."""
    rng = random.Random(seed)
    c1, c2 = BASE["local_cost_s"], BASE["remote_cost_s"]
    r1, r2 = BASE["local_restart_s"], BASE["remote_restart_s"]
    lam1, lam2 = BASE["crash_rate"], BASE["node_loss_rate"]
    clock = done = local = remote = 0.0
    saves = 0
    crash_at = rng.expovariate(lam1)
    loss_at = rng.expovariate(lam2)
    while done < work_s:
        segment = min(plan_t, work_s - done)
        upload = (saves + 1) % k == 0
        length = segment + c1 + (c2 if upload else 0.0)
        if clock + length <= min(crash_at, loss_at):
            clock += length
            done += segment
            saves += 1
            local = done
            if upload:
                remote = done
            continue
        if crash_at <= loss_at:
            clock = crash_at + r1
            done = local
            crash_at = clock + rng.expovariate(lam1)
        else:
            clock = loss_at + r2
            done = local = remote
            loss_at = clock + rng.expovariate(lam2)
            saves = 0
    return (clock - work_s) / work_s


def test_a_simulation_agrees_with_the_model() -> None:
    """Seeded runs of 2000 h of work: the measured overhead of the planned schedule is within
    10% of the model's, and lower than making every save remote."""
    plan = plan_two_levels(TierCosts(**BASE))
    t1 = math.sqrt(
        2
        * (BASE["local_cost_s"] + BASE["remote_cost_s"])
        / (BASE["crash_rate"] + BASE["node_loss_rate"])
    )
    measured = np.mean(
        [_simulate(plan.local_interval_s, plan.upload_every, 2000 * 3600, s) for s in range(4)]
    )
    measured_every = np.mean([_simulate(t1, 1, 2000 * 3600, s) for s in range(4)])
    assert measured == pytest.approx(plan.expected_overhead, rel=0.10)
    assert measured_every == pytest.approx(plan.remote_every_save_overhead, rel=0.10)
    assert measured < measured_every


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("local_cost_s", 0.0),
        ("remote_cost_s", -1.0),
        ("local_restart_s", -1.0),
        ("crash_rate", -1e-3),
        ("node_loss_rate", float("nan")),
    ],
)
def test_bad_inputs_are_named(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=name):
        TierCosts(**{**BASE, name: value})


def test_no_failures_at_all_is_refused() -> None:
    with pytest.raises(ConfigError, match="crash_rate"):
        plan_two_levels(TierCosts(**{**BASE, "crash_rate": 0.0, "node_loss_rate": 0.0}))
