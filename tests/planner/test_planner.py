"""The online Planner: decisions, robustness, thread safety, state round trip and reporting."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from planner_helpers import noisy_run

from coci_core import ConfigError
from coci_core.planner import Planner, PlannerReport


def _drive(planner, losses, start, stop, *, stall=0.5, persist=2.0):
    """Run steps [start, stop): observe, decide, record; return the decisions."""
    decisions = []
    for k in range(start, stop):
        planner.observe(k, loss=float(losses[k]), step_time_s=0.3)
        save = planner.should_save(k)
        decisions.append(save)
        if save:
            planner.record_save(stall_s=stall, persist_s=persist)
    return decisions


def _planner(**kw):
    args = {"total_steps": 20_000, "mtbf_s": 2 * 3600.0}
    args.update(kw)
    return Planner(**args)


@pytest.mark.parametrize("objective", ["time", "convergence"])
def test_state_dict_round_trips_mid_run_and_the_restored_planner_decides_the_same(objective):
    """A Planner restored from a JSON state makes exactly the same decisions afterwards (with
    the fitted loss curve too, under the convergence objective)."""
    losses = noisy_run(20_000, seed=11)
    a = _planner(objective=objective)
    _drive(a, losses, 1, 6_000)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    b = _planner(objective=objective)
    b.load_state_dict(state)
    assert b.schedule == a.schedule
    da = _drive(a, losses, 6_000, 20_000)
    db = _drive(b, losses, 6_000, 20_000)
    assert sum(da) >= 5
    assert da == db


def test_a_state_of_another_policy_keeps_the_measurements_and_plans_afresh():
    """The policy changed between runs (``every_n_steps`` first, then coci's own, as the plan
    line advises): loading the checkpoint's state raised ``'state' policy must be 'coci':
    'every_n_steps'`` and the resume failed. The measurements carry over; the plan is this
    policy's, made at the next step."""
    losses = noisy_run(2_000, seed=5)
    a = _planner(policy="every_n_steps", every_n_steps=100)
    _drive(a, losses, 1, 1_000)
    a.record_restore(30.0)  # a failure the state holds
    b = _planner()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.failures == a.failures == 1
    assert b.report().costs["step_time_s"] == pytest.approx(0.3)
    decisions = _drive(b, losses, 1_000, 2_000)
    assert b.schedule != a.schedule and sum(decisions) >= 1
    assert all(s >= 1_000 for s in b.schedule)


@pytest.mark.parametrize(
    ("field", "value"),
    [("observed", "x"), ("costs", "x"), ("schedule", [None]), ("elapsed_s", 1e400), ("ptr", {})],
)
def test_a_forged_state_is_one_config_error_and_leaves_the_planner_as_it_was(field, value):
    """A state with a field of the wrong type (a forged or foreign checkpoint, loaded by a
    plain loop's ``Checkpointer.load_state_dict``) raised the raw ``ValueError`` /
    ``AttributeError`` of the field read, after the fields before it were loaded: one
    ``ConfigError`` naming the state now, and nothing loaded."""
    losses = noisy_run(2_000, seed=5)
    a = _planner()
    _drive(a, losses, 1, 1_000)
    b = _planner()
    _drive(b, losses, 1, 10)
    before = json.dumps(b.state_dict())
    forged = {**json.loads(json.dumps(a.state_dict())), field: value}
    with pytest.raises(ConfigError, match=r"'state' cannot be loaded as a planner's state"):
        b.load_state_dict(forged)
    assert json.dumps(b.state_dict()) == before


def test_state_dict_holds_only_json_values():
    """The state survives a strict JSON round trip unchanged (no pickle needed)."""
    p = _planner()
    _drive(p, noisy_run(3_000, seed=2), 1, 3_000)
    p.observe(3_000, loss=float("nan"))
    state = p.state_dict()
    assert json.loads(json.dumps(state, allow_nan=False)) == state


def test_nan_and_inf_losses_are_skipped_and_counted():
    """Non-finite or junk losses never raise, are not fitted and are counted."""
    p = _planner()
    bad = [float("nan"), float("inf"), -float("inf"), "junk"]
    for k, loss in enumerate(bad, start=1):
        p.observe(k, loss=loss, step_time_s=0.3)
    p.observe(5, loss=1.0, step_time_s=float("nan"))
    assert p.report().skipped_losses == len(bad)
    assert p.state_dict()["losses"]["chunks"] == [[0.0, 5.0, 1.0, 1.0]]


@pytest.mark.parametrize("step", [None, "x", 1.5, -3, 10**30, np.int64(7), float("nan"), [1]])
def test_should_save_never_raises_on_odd_input(step):
    """should_save answers a bool for anything, and False for what is not a planned step."""
    p = _planner(step_time_s=0.3)
    p.observe(1, loss=1.0)
    assert p.should_save(step) in (True, False)
    huge = isinstance(step, int) and step == 10**30  # past every planned step: overdue
    assert p.should_save(step) is huge


def test_a_late_step_triggers_the_overdue_checkpoint_once_per_step():
    """Skipping past a planned step saves at the next step asked, and repeated asks agree."""
    p = _planner(policy="every_n_seconds", every_n_seconds=30.0, step_time_s=0.3)
    p.observe(1)
    assert not p.should_save(99)
    assert p.should_save(150)
    assert p.should_save(150)
    assert not p.should_save(151)
    assert p.should_save(200)


def test_record_save_is_thread_safe_and_measured_costs_are_used():
    """Concurrent record_save calls are all kept; the median becomes the planned cost."""
    p = _planner(step_time_s=0.3)
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for _ in range(200):
            p.record_save(persist_s=4.0)
            p.record_save(stall_s=1.5)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rep = p.report()
    assert rep.cost_sources["persist_s"] == "measured"
    assert rep.costs["persist_s"] == 4.0
    assert rep.costs["stall_s"] == 1.5


def test_user_given_costs_override_measurements_and_are_reported_as_such():
    """A stall given by the user wins over a measured one, and the report says which is which."""
    p = _planner(stall_s=2.0)
    p.record_save(stall_s=9.0, persist_s=3.0)
    rep = p.report()
    assert (rep.costs["stall_s"], rep.cost_sources["stall_s"]) == (2.0, "user")
    assert (rep.costs["persist_s"], rep.cost_sources["persist_s"]) == (3.0, "measured")
    assert rep.cost_sources["restart_s"] == "default"


def test_restores_feed_the_mtbf_estimate_when_none_is_given():
    """Without mtbf_s, restarts pull the MTBF estimate below the documented default."""
    p = Planner(total_steps=10_000, default_mtbf_s=24 * 3600.0)
    assert p.report().mtbf_source == "default"
    for k in range(1, 200):
        p.observe(k, loss=1.0, step_time_s=60.0)
    p.record_restore(30.0)
    p.record_restore(50.0)
    rep = p.report()
    assert rep.mtbf_source == "estimated"
    assert rep.mtbf_s < 24 * 3600.0
    assert (rep.costs["restart_s"], rep.cost_sources["restart_s"]) == (40.0, "measured")


def test_an_unknown_total_plans_over_a_rolling_horizon():
    """With total_steps=None the planner still plans ahead and says the horizon is rolling."""
    p = Planner(mtbf_s=3600.0, stall_s=1.0, step_time_s=0.5)
    decisions = _drive(p, noisy_run(6_000, seed=4), 1, 6_000)
    rep = p.report()
    assert rep.rolling
    assert rep.horizon_end_step is not None
    assert rep.horizon_end_step > 5_999
    assert sum(decisions) >= 3
    assert rep.next_steps


def test_every_n_steps_with_coci_caps_the_interval():
    """every_n_steps given to the coci policy is an upper bound on the interval."""
    p = _planner(every_n_steps=150, mtbf_s=100 * 3600.0)
    decisions = _drive(p, noisy_run(5_000, seed=6), 1, 5_000)
    saves = np.flatnonzero(decisions) + 1
    assert len(saves) > 10
    assert np.diff(saves).max() <= 150


def test_report_and_explain_describe_the_plan():
    """report() carries plan vs Daly figures and fitted loss; explain() names the inputs."""
    losses = noisy_run(20_000, seed=8)
    p = _planner(objective="convergence")
    _drive(p, losses, 1, 9_000)
    rep = p.report()
    assert isinstance(rep, PlannerReport)
    assert rep.expected_overhead is not None
    assert rep.expected_overhead.daly_wall_s > 0
    assert rep.fitted_loss is not None
    assert abs(rep.fitted_loss - 1.5 - 5.4 * 4**-0.5) < 0.3
    assert rep.replans >= 5
    text = p.explain(rep.next_steps[0])
    assert "checkpoint" in text
    assert "stall_s 0.5 (measured)" in text
    assert "Daly" in text
    assert rep.plan_method == "dp for the convergence objective"


def test_time_objective_matches_daly_intervals_once_costs_are_measured():
    """With the time objective and no termination the online intervals are Daly's."""
    p = _planner(objective="time", stall_s=0.5, persist_s=2.0, step_time_s=0.3)
    saves = np.flatnonzero(_drive(p, noisy_run(20_000, seed=1), 1, 20_000)) + 1
    gaps = np.diff(saves)
    assert len(gaps) > 10
    assert np.all(np.abs(gaps - 283) <= 1)
    assert p.report().plan_method.startswith("Daly's interval (time objective")


def test_zero_step_times_and_odd_restores_never_crash_observe():
    """Degenerate measurements (0 s steps, junk restores) keep the planner running."""
    p = _planner()
    for k in range(1, 300):
        p.observe(k, loss=1.0 / k, step_time_s=0.0)
        p.should_save(k)
    p.record_restore("soon")
    p.record_restore(-4.0)
    p.observe(300, loss=0.5, step_time_s=0.0)
    assert p.report().cost_sources["restart_s"] == "default"


def test_garbage_input_never_raises_and_never_fails_a_replan(caplog):
    """Random odd steps, losses, times and restores: no exception, no logged re-plan failure."""
    rng = np.random.default_rng(2)
    configs = [
        {"total_steps": 5_000, "mtbf_s": 60.0, "objective": "convergence"},
        {"total_steps": None, "mtbf_s": None, "objective": "progress"},
        {"total_steps": 5_000, "mtbf_s": 1e6, "objective": "time", "termination": [100, 300]},
    ]
    for cfg in configs:
        p = Planner(**cfg)
        k = 0
        for i in range(1_200):
            k += int(rng.integers(-3, 5))
            loss = rng.choice([rng.normal() * 1e300, -5.0, 1.0 / (i + 1), np.nan, 0.0])
            step_time = rng.choice([0.0, 1e-9, 0.3, 1e6, -1.0, np.inf])
            p.observe(k, loss=loss, step_time_s=step_time)
            if p.should_save(k):
                p.record_save(stall_s=rng.choice([0.0, 1e-6, 5.0, 1e9]), persist_s=20.0)
            if i % 400 == 399:
                p.record_restore(rng.choice([0.0, 30.0, np.nan]))
        json.dumps(p.state_dict(), allow_nan=False)
        assert p.report().skipped_losses > 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.parametrize(
    ("policy", "option"),
    [("every_n_steps", {"every_n_steps": 3}), ("epoch", {"steps_per_epoch": 3})],
)
def test_a_fixed_interval_saves_at_exactly_the_multiples_from_step_one(policy, option):
    """every_n_steps/epoch need no measurement: multiples of N from the first step (before
    any plan), the run's last step included, and the schedule says so from the start."""
    p = Planner(policy=policy, total_steps=12, **option)
    assert p.schedule[:4] == (3, 6, 9, 12)
    report = p.report()
    assert report.next_steps == (3, 6, 9, 12) and report.interval_steps == 3
    saved = []
    for k in range(1, 13):
        p.observe(k, loss=1.0, step_time_s=0.3)
        if p.should_save(k):
            p.record_save(stall_s=0.1, persist_s=0.1)
            saved.append(k)
    assert saved == [3, 6, 9, 12]
    assert p.replans >= 1  # the plan was made (costs measured), and did not move a multiple


def test_a_fixed_interval_is_kept_across_a_restore_and_a_slow_first_plan():
    """A resumed every_n_steps planner keeps the multiples; a skipped multiple is not moved."""
    p = Planner(policy="every_n_steps", every_n_steps=4, start_step=6)
    assert p.schedule[:2] == (8, 12)
    assert not p.should_save(7) and p.should_save(8)
    assert not p.should_save(9) and not p.should_save(13) and p.should_save(16)
    assert "checkpoint" in p.explain(12).splitlines()[0]
    assert "no checkpoint" in p.explain(13).splitlines()[0]


def test_a_state_loaded_after_a_restore_keeps_it_once():
    """Restores recorded before a load are recorded again unless the state holds them."""
    p = _planner()
    _drive(p, noisy_run(300, seed=3), 1, 200)
    before = p.state_dict()
    p.record_restore(5.0)
    p.record_restart(9.0)
    after = p.state_dict()
    assert after["failures"] == 1
    p.load_state_dict(before)  # a checkpoint taken before the failure
    assert p.state_dict()["failures"] == 1
    assert p.state_dict()["costs"]["restart_s"] == [9.0]
    p.load_state_dict(after)  # one that holds it: not counted twice
    assert p.state_dict()["failures"] == 1
    other = _planner()
    other.load_state_dict(after)  # another planner: the state is all it knows
    assert other.state_dict()["failures"] == 1
    assert other.state_dict()["costs"]["restart_s"] == [9.0]


def test_a_loaded_state_comes_back_unchanged_and_a_restore_is_replayed_on_every_load():
    p = _planner()
    _drive(p, noisy_run(300, seed=4), 1, 200)
    saved = json.loads(json.dumps(p.state_dict()))
    q = _planner()
    q.load_state_dict(saved)
    assert q.state_dict() == saved  # nothing recorded before the load: the state as saved
    r = _planner()
    r.record_restore(2.0)
    for _ in range(2):  # e.g. the adapter's load, then the callback's
        r.load_state_dict(saved)
        assert r.state_dict()["failures"] == saved["failures"] + 1
        assert r.state_dict()["costs"]["restart_s"] == [*saved["costs"]["restart_s"], 2.0]
    taken = r.state_dict()
    r.record_restore(3.0)  # a second restore, in the same process, from a state holding the first
    r.load_state_dict(taken)
    assert r.state_dict()["failures"] == saved["failures"] + 2
