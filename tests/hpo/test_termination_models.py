"""The termination models the hpo integrations produce, and what the planner does with them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coci_core.errors import ConfigError
from coci_core.hpo import (
    asha_rungs,
    combine_terminations,
    improvement_probability,
    patience_stops,
    threshold_stops,
)
from coci_core.planner import AshaRungs, NoTermination, Planner, StopDistribution, UniformKill
from coci_core.planner.model import alive_at


def test_stop_distribution_atoms_are_conditioned_on_the_plan_start() -> None:
    d = StopDistribution(steps=(100, 200), probabilities=(0.5, 0.25))
    steps, probs = d.atoms(0, 1000)
    assert steps.tolist() == [100, 200, 1000]
    assert probs.tolist() == pytest.approx([0.5, 0.25, 0.25])
    steps, probs = d.atoms(150, 1000)  # past the first stop: P(stop at 200 | running) = 1/2
    assert steps.tolist() == [200, 1000]
    assert probs.tolist() == pytest.approx([0.5, 0.5])
    with pytest.raises(ConfigError, match="sum to <= 1"):
        StopDistribution(steps=(1, 2), probabilities=(0.7, 0.7))


def test_patience_rule_probabilities() -> None:
    # patience 2, wait 1: the next validation stops with P(no improvement) = 1 - p
    d = patience_stops(
        patience=2, wait_count=1, improve_probability=0.25, validation_steps=[10, 20, 30]
    )
    assert d.steps[0] == 10
    assert d.probabilities[0] == pytest.approx(0.75)
    # at 20: it improved at 10 (wait 0), then cannot stop at 20 (wait 1 only)
    # at 30: improved at 10, not at 20 nor 30: 0.25 * 0.75 * 0.75
    assert dict(zip(d.steps, d.probabilities, strict=True)) == pytest.approx(
        {10: 0.75, 30: 0.25 * 0.75 * 0.75}
    )
    # a metric that never improves stops for sure within patience validations
    sure = patience_stops(
        patience=3, wait_count=0, improve_probability=0.0, validation_steps=range(5, 100, 5)
    )
    assert sure.steps == (15,) and sure.stop_probability == pytest.approx(1.0)
    assert improvement_probability([True, False, False, False], window=4) == pytest.approx(2 / 6)


def test_asha_mapping_follows_ray_tunes_rungs() -> None:
    # ASHAScheduler(grace_period=1, reduction_factor=4, max_t=100): rungs 1, 4, 16, 64
    assert asha_rungs(grace_period=1, reduction_factor=4, max_t=100) == AshaRungs(
        rung_steps=(1, 4, 16, 64), reduction_factor=4.0
    )
    # epochs of 50 steps, max_t at a rung: that rung is the end, not a termination
    rungs = asha_rungs(grace_period=2, reduction_factor=2, max_t=16, steps_per_unit=50)
    assert rungs.rung_steps == (100, 200, 400)
    with pytest.raises(ConfigError, match="no ASHA rung"):
        asha_rungs(grace_period=10, reduction_factor=3, max_t=10)


def test_combining_is_the_product_of_survivals() -> None:
    a = StopDistribution(steps=(100,), probabilities=(0.5,), source="a")
    b = AshaRungs(rung_steps=(50, 150), reduction_factor=2.0)
    c = combine_terminations([a, NoTermination(), b])
    ks = np.array([1, 51, 101, 151, 1000])
    assert c.survival(ks).tolist() == pytest.approx((a.survival(ks) * b.survival(ks)).tolist())
    assert isinstance(combine_terminations([NoTermination()]), NoTermination)


def _planner(termination: object) -> Planner:
    p = Planner(
        total_steps=4000,
        step_time_s=0.5,
        stall_s=2.0,
        persist_s=0.0,
        restart_s=10.0,
        mtbf_s=1800.0,
        objective="time",
        termination=termination,  # type: ignore[arg-type]
    )
    for k in range(1, 5):
        p.observe(k, step_time_s=0.5)
    return p


def test_a_likely_early_stop_changes_the_plan_and_explain_says_how_much() -> None:
    stops = StopDistribution(
        steps=(300, 600, 1200), probabilities=(0.4, 0.3, 0.2), source="Optuna study 's'"
    )
    with_hazard, without = _planner(stops), _planner(None)
    # the plan moves its checkpoints with the likely stops (none just before one)
    assert with_hazard.schedule != without.schedule
    text = with_hazard.explain(with_hazard.schedule[0])
    assert "termination hazard: Optuna study 's'" in text
    assert "P(stop) 90%" in text
    assert "the hazard accounts for" in text
    ov = with_hazard.report().expected_overhead
    assert ov is not None and ov.without_termination_objective_s is not None
    # the plan made without the hazard costs more under it
    assert ov.without_termination_objective_s > ov.objective_s
    assert ov.termination_share is not None and 0 < ov.termination_share <= 1
    assert "termination hazard" not in without.explain(without.schedule[0])


def test_set_termination_replans() -> None:
    p = _planner(None)
    replans = p.replans
    p.set_termination(StopDistribution(steps=(100,), probabilities=(0.9,)))
    p.observe(5, step_time_s=0.5)
    assert p.replans == replans + 1
    assert p.report().stop_probability == pytest.approx(0.9)


def test_tensorboard_summary_says_how_much_the_hazard_brings(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        event_accumulator as ea,
    )

    from coci_core.telemetry.tensorboard import TensorBoardTelemetry

    p = _planner(StopDistribution(steps=(300, 600), probabilities=(0.5, 0.3), source="s"))
    report = p.report()
    ov = report.expected_overhead
    assert ov is not None and ov.termination_share is not None
    with TensorBoardTelemetry(tmp_path) as tele:
        tele.record_plan(4, report)
    acc = ea.EventAccumulator(str(tmp_path), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    got = {t: acc.Scalars(t)[0].value for t in acc.Tags()["scalars"] if "termination" in t}
    assert got == pytest.approx(
        {
            "coci/termination/stop_probability": report.stop_probability,
            "coci/termination/without_objective_s": ov.without_termination_objective_s,
            "coci/termination/share_of_gain": ov.termination_share,
        },
        rel=1e-6,
    )
    assert report.stop_probability == pytest.approx(0.8)


def test_coci_report_and_the_tab_say_how_much_the_hazard_brings(tmp_path: Path) -> None:
    """The plan's telemetry record carries the plan made without the hazard: ``coci report``'s
    facts (which the TensorBoard tab's summary shows) give the same share of the gain."""
    from coci_core.telemetry import TELEMETRY_FILE, JsonlTelemetry
    from coci_core.telemetry.report import facts, render_facts, summarize

    p = _planner(StopDistribution(steps=(300, 600), probabilities=(0.5, 0.3), source="s"))
    report = p.report()
    ov = report.expected_overhead
    assert ov is not None and ov.termination_share is not None
    sink = JsonlTelemetry(tmp_path / TELEMETRY_FILE)
    sink.record_plan(4, report)
    sink.close()
    got = facts(summarize(tmp_path))["termination"]
    assert got is not None
    assert got["share_of_gain"] == pytest.approx(ov.termination_share)
    assert got["without_objective_s"] == pytest.approx(ov.without_termination_objective_s)
    text = "\n".join(render_facts(facts(summarize(tmp_path))))
    saving = (ov.without_termination_objective_s - ov.objective_s) / (
        ov.without_termination_objective_s
    )
    assert got["saving"] == pytest.approx(saving) and 0 < saving <= 1
    assert f"(the hazard saves {saving:.0%})" in text


def test_threshold_stops_follow_the_trend() -> None:
    line = [1.0, 0.9, 0.8, 0.7, 0.6]
    coming = list(range(10, 100, 10))
    # a straight line: it passes 0.35 at the third coming validation (0.3), for sure
    d = threshold_stops(line, mode="min", stopping_threshold=0.35, validation_steps=coming)
    assert d.steps == (30,) and d.stop_probability == pytest.approx(1.0)
    # "max": the same values rising, mirrored
    up = threshold_stops(
        [-v for v in line], mode="max", stopping_threshold=-0.35, validation_steps=coming
    )
    assert up.steps == (30,)
    # a falling metric does not diverge upwards
    assert (
        threshold_stops(line, mode="min", divergence_threshold=5.0, validation_steps=coming).steps
        == ()
    )
    # a rising one does: up to 1.0 by 0.1 per validation, past 1.25 at the third (1.3)
    rising = threshold_stops(
        line[::-1], mode="min", divergence_threshold=1.25, validation_steps=coming
    )
    assert rising.steps == (30,)
    # noisy values: the stop spreads around the crossing, most of it near it
    noisy = threshold_stops(
        [1.0, 0.88, 0.82, 0.69, 0.61, 0.49],
        mode="min",
        stopping_threshold=0.35,
        validation_steps=coming,
    )
    probs = dict(zip(noisy.steps, noisy.probabilities, strict=True))
    assert noisy.stop_probability == pytest.approx(1.0, abs=1e-3)
    assert probs[10] + probs[20] > 0.8
    # fewer than three values, or no threshold: no stop
    short = threshold_stops([1.0, 0.5], mode="min", stopping_threshold=0.6, validation_steps=coming)
    assert short.steps == ()
    assert threshold_stops(line, mode="min", validation_steps=coming).steps == ()
    with pytest.raises(ConfigError, match="'mode' must be 'min' or 'max'"):
        threshold_stops(line, mode="lower", stopping_threshold=0.3, validation_steps=coming)


def test_a_model_given_the_job_runs_keeps_only_the_stops_ahead() -> None:
    stops = StopDistribution(steps=(10, 20, 30), probabilities=(0.5, 0.25, 0.125), source="s")
    later = alive_at(stops, 20)
    # running at 20: the stop after 10 is past; the ones after 20 and 30 scale by 1 / S(20)
    assert later == StopDistribution(steps=(20, 30), probabilities=(0.5, 0.25), source="s")
    ks = np.array([1, 20, 21, 31, 99])
    assert later.survival(ks) == pytest.approx(np.minimum(1, stops.survival(ks) / 0.5))
    assert alive_at(stops, 31) == NoTermination()
    rungs = AshaRungs(rung_steps=(10, 30, 90), reduction_factor=3.0)
    assert alive_at(rungs, 30) == AshaRungs(rung_steps=(30, 90), reduction_factor=3.0)
    assert alive_at(rungs, 91) == NoTermination()
    uniform = UniformKill(start_step=0, end_step=100, probability=0.5)
    given = alive_at(uniform, 50)
    assert given.survival(np.array([10, 50, 100])) == pytest.approx([1.0, 1.0, 0.5 / 0.75])
    assert given.to_dict()["alive_at"] == 50
    kills, probs = given.atoms(40, 100)
    assert kills.min() >= 50 and probs.sum() == pytest.approx(1.0)


def test_a_stop_passed_since_the_newest_checkpoint_no_longer_counts() -> None:
    # nine in ten runs stop after step 20; this one is at step 60 with no checkpoint yet, so
    # its plan starts at 0: the stop at 20 cannot come any more
    costs = {"total_steps": 400, "step_time_s": 0.5, "stall_s": 5.0, "mtbf_s": 600.0}
    p = Planner(**costs, termination=StopDistribution(steps=(20,), probabilities=(0.9,)))
    for k in range(1, 61):
        p.observe(k, step_time_s=0.5)
    assert p.report().stop_probability == pytest.approx(0.9)  # planned at step 3
    p.set_termination(StopDistribution(steps=(20,), probabilities=(0.9,), source="again"))
    p.observe(61, step_time_s=0.5)
    assert p.report().stop_probability == pytest.approx(0.0)
    # the plan is the one made with no termination model
    q = Planner(**costs)
    for k in range(1, 62):
        q.observe(k, step_time_s=0.5)
    q.set_termination(None)
    q.set_termination(StopDistribution(steps=(1,), probabilities=(0.5,)))  # also passed
    q.observe(62, step_time_s=0.5)
    p.observe(62, step_time_s=0.5)
    assert p.schedule and p.schedule == q.schedule
