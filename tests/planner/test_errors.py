"""Bad arguments raise ConfigError naming the parameter, the rule and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coci_core.errors import ConfigError
from coci_core.planner import Planner, plan_schedule


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        ("stall_s", 0.0, "> 0"),
        ("stall_s", -1.0, "> 0"),
        ("persist_s", -2.0, ">= 0"),
        ("restart_s", -60.0, ">= 0"),
        ("step_time_s", 0.0, "> 0"),
        ("mtbf_s", 0.0, "> 0"),
        ("mtbf_s", -3.0, "> 0"),
        ("mtbf_s", math.nan, "finite"),
        ("objective", "fastest", "one of"),
        ("total_steps", 0, ">= 1"),
    ],
)
def test_plan_schedule_rejects_bad_arguments_by_name(resnet, name, value, rule):
    """Each bad value names its parameter and the rule it broke."""
    resnet[name] = value
    with pytest.raises(ConfigError) as info:
        plan_schedule(**resnet)
    message = str(info.value)
    assert f"'{name}'" in message
    assert rule in message
    assert repr(value) in message or str(value) in message


def test_nan_losses_in_observations_are_rejected(resnet):
    """Observed losses with NaN are an error for the pure entry point, naming 'loss'."""
    steps = np.arange(100)
    losses = np.linspace(3, 1, 100)
    losses[7] = np.nan
    with pytest.raises(ConfigError, match="'loss'"):
        plan_schedule(**resnet, loss=(steps, losses))


def test_a_loss_callable_returning_nan_is_rejected(resnet):
    """A loss formula that yields NaN is an error naming 'loss'."""
    with pytest.raises(ConfigError, match="'loss'"):
        plan_schedule(**resnet, loss=lambda k: math.nan)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"mtbf_s": 0.0}, "mtbf_s"),
        ({"mtbf_s": -5}, "mtbf_s"),
        ({"objective": "speed"}, "objective"),
        ({"policy": "sometimes"}, "policy"),
        ({"policy": "every_n_steps"}, "every_n_steps"),
        ({"policy": "every_n_seconds"}, "every_n_seconds"),
        ({"policy": "epoch"}, "steps_per_epoch"),
        ({"stall_s": 0.0}, "stall_s"),
        ({"persist_s": -1.0}, "persist_s"),
        ({"total_steps": 0}, "total_steps"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"method": "magic"}, "method"),
    ],
)
def test_planner_rejects_bad_arguments_at_construction(kwargs, name):
    """The Planner checks its arguments when built, naming the bad one."""
    with pytest.raises(ConfigError, match=f"'{name}'"):
        Planner(**kwargs)
