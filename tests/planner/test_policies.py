"""The baseline policies follow their published rules; coci_paper shows its known flaws."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import power_loss

from coci_core.planner import (
    POLICIES,
    FailureModel,
    PlanContext,
    Problem,
    SavePolicy,
    make_policy,
    plan_schedule,
    young_interval_s,
)


def _pb(stall=0.5, persist=2.0):
    return Problem(
        start_step=0,
        end_step=50_000,
        step_time_s=0.3,
        stall_s=stall,
        persist_s=persist,
        restart_s=60.0,
        failure=FailureModel(mtbf_s=8 * 3600.0),
    )


def test_every_registered_policy_satisfies_the_protocol():
    """Each registry entry builds a SavePolicy whose name is its registry key."""
    opts = {
        "every_n_steps": {"every_n_steps": 10},
        "every_n_seconds": {"every_n_seconds": 5.0},
        "epoch": {"steps_per_epoch": 100},
    }
    for name in POLICIES:
        policy = make_policy(name, **opts.get(name, {}))
        assert isinstance(policy, SavePolicy)
        assert policy.name == name


@pytest.mark.parametrize(("stall", "persist", "interval"), [(0.5, 2.0, 35), (5.0, 20.0, 335)])
def test_checkfreq_hides_persist_then_grows_by_two_until_overhead_is_bounded(
    stall, persist, interval
):
    """CheckFreq starts at ceil(persist/step) and adds 2 until stall/interval <= 5%."""
    steps = make_policy("checkfreq").plan(_pb(stall, persist), context=PlanContext())
    assert set(np.diff(steps).tolist()) == {interval}


def test_young_uses_the_square_root_rule():
    """Young's interval is sqrt(2 s M) in steps."""
    steps = make_policy("young").plan(_pb(), context=PlanContext())
    assert steps[0] == round(young_interval_s(0.5, 8 * 3600.0) / 0.3)


def test_every_n_seconds_and_epoch_convert_to_steps():
    """every_n_seconds divides by the step time; epoch saves at epoch boundaries."""
    pb = _pb()
    assert (
        make_policy("every_n_seconds", every_n_seconds=60.0).plan(pb, context=PlanContext())[0]
        == 200
    )
    epochs = make_policy("epoch", steps_per_epoch=5005).plan(pb, context=PlanContext())
    assert epochs.tolist() == [5005 * i for i in range(1, 10)]


def test_coci_paper_places_nothing_when_the_early_loss_rises(resnet):
    """The published rule fits theta1 >= 0 on a noisy rising start and places no checkpoint."""
    rising = plan_schedule(**resnet, loss=lambda k: 3.0 + 1e-3 * k, policy="coci_paper")
    ours = plan_schedule(**resnet, loss=lambda k: 3.0 + 1e-3 * k)
    assert rising.steps == ()
    assert len(ours.steps) > 10
    assert rising.expected_overhead_s.wall_s > 3 * ours.expected_overhead_s.wall_s


def test_coci_paper_places_nothing_when_early_noise_hides_the_trend():
    """1% noise over the first 50 steps makes the published fit rise: no checkpoint at all."""
    ks = np.arange(64, dtype=np.float64)
    rng = np.random.default_rng(0)
    noisy = power_loss(ks) * (1 + 0.01 * rng.standard_normal(64))
    ctx = PlanContext(loss_steps=ks, loss_values=noisy)
    clean = PlanContext(loss_steps=ks, loss_values=power_loss(ks))
    for unit_s in (1.0, 60.0, 3600.0):
        policy = make_policy("coci_paper", time_unit_s=unit_s)
        assert policy.plan(_pb(), context=ctx).size == 0
        assert policy.plan(_pb(), context=clean).size > 10


def test_a_policy_object_stands_for_its_name_and_options() -> None:
    """policy=EveryNSteps(every_n_steps=3) plans as policy="every_n_steps", every_n_steps=3;
    an object carries its own options (CheckFreq's bound); an interval given twice, or
    something that is not a policy, is refused naming the argument."""
    from coci_core.errors import ConfigError
    from coci_core.planner import CheckFreq, Epoch, EveryNSteps, Planner

    by_object = Planner(policy=EveryNSteps(every_n_steps=3), total_steps=10)
    by_name = Planner(policy="every_n_steps", every_n_steps=3, total_steps=10)
    assert by_object.policy_name == "every_n_steps"
    assert [s for s in range(1, 11) if by_object.should_save(s)] == [3, 6, 9]
    assert [s for s in range(1, 11) if by_name.should_save(s)] == [3, 6, 9]
    epoch = Planner(policy=Epoch(steps_per_epoch=4), total_steps=10)
    assert [s for s in range(1, 11) if epoch.should_save(s)] == [4, 8]
    assert Planner(policy=CheckFreq(overhead_bound=0.03)).policy_name == "checkfreq"
    with pytest.raises(ConfigError, match="'every_n_steps' is given twice"):
        Planner(policy=EveryNSteps(every_n_steps=3), every_n_steps=4)
    with pytest.raises(ConfigError, match="'checkfreq_overhead_bound' is given twice"):
        Planner(policy=CheckFreq(overhead_bound=0.03), checkfreq_overhead_bound=0.5)
    # the same value both ways, or the argument left at its default: the object's
    Planner(policy=CheckFreq(overhead_bound=0.03), checkfreq_overhead_bound=0.03)
    assert Planner(policy=CheckFreq(overhead_bound=0.03))._settings.policy == CheckFreq(
        overhead_bound=0.03
    )
    with pytest.raises(ConfigError, match=r"'policy' must be one of .* or a policy object"):
        Planner(policy=object())  # type: ignore[arg-type]
