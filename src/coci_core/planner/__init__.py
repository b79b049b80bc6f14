"""Convergence-aware checkpoint planner: when to checkpoint, measured, explained and simulated.

Public names: :class:`Planner` (the online object used by the adapters), :func:`plan_schedule`
(the pure entry point), :func:`simulate` (Monte Carlo), the policies, the objectives and the
models.
"""

import typing as _typing

if _typing.TYPE_CHECKING:
    from coci_core.planner.costs import CostEstimate, CostEstimator
    from coci_core.planner.curve import LossCurve, fit_loss_curve, value_density
    from coci_core.planner.model import (
        DEFAULT_MTBF_S,
        AshaRungs,
        FailureModel,
        NoTermination,
        StopDistribution,
        SurvivalFunction,
        Termination,
        UniformKill,
        estimate_mtbf_s,
    )
    from coci_core.planner.objectives import (
        OBJECTIVES,
        Objective,
        make_objective,
        register_objective,
    )
    from coci_core.planner.optimize import (
        CostBreakdown,
        Problem,
        daly_interval_s,
        expected_cost,
        young_interval_s,
    )
    from coci_core.planner.planner import Planner, PlannerConfig, PlannerReport, planner_config
    from coci_core.planner.policies import (
        POLICIES,
        CheckFreq,
        Coci,
        CociPaper,
        Daly,
        Epoch,
        EveryNSeconds,
        EveryNSteps,
        PlanContext,
        SavePolicy,
        Young,
        make_policy,
    )
    from coci_core.planner.schedule import ExpectedOverhead, Schedule, plan_schedule
    from coci_core.planner.simulate import METRICS, MetricEstimate, SimulationResult, simulate
    from coci_core.planner.solvers import closed_form_schedule, dp_schedule, uniform_schedule
    from coci_core.planner.two_level import TierCosts, TwoLevelPlan, plan_two_levels

# each public name and the module that defines it
_LAZY = {
    "CostEstimate": "coci_core.planner.costs",
    "CostEstimator": "coci_core.planner.costs",
    "LossCurve": "coci_core.planner.curve",
    "fit_loss_curve": "coci_core.planner.curve",
    "value_density": "coci_core.planner.curve",
    "DEFAULT_MTBF_S": "coci_core.planner.model",
    "AshaRungs": "coci_core.planner.model",
    "FailureModel": "coci_core.planner.model",
    "NoTermination": "coci_core.planner.model",
    "StopDistribution": "coci_core.planner.model",
    "SurvivalFunction": "coci_core.planner.model",
    "Termination": "coci_core.planner.model",
    "UniformKill": "coci_core.planner.model",
    "estimate_mtbf_s": "coci_core.planner.model",
    "OBJECTIVES": "coci_core.planner.objectives",
    "Objective": "coci_core.planner.objectives",
    "make_objective": "coci_core.planner.objectives",
    "CostBreakdown": "coci_core.planner.optimize",
    "Problem": "coci_core.planner.optimize",
    "daly_interval_s": "coci_core.planner.optimize",
    "expected_cost": "coci_core.planner.optimize",
    "young_interval_s": "coci_core.planner.optimize",
    "Planner": "coci_core.planner.planner",
    "PlannerConfig": "coci_core.planner.planner",
    "PlannerReport": "coci_core.planner.planner",
    "planner_config": "coci_core.planner.planner",
    "POLICIES": "coci_core.planner.policies",
    "CheckFreq": "coci_core.planner.policies",
    "Coci": "coci_core.planner.policies",
    "CociPaper": "coci_core.planner.policies",
    "Daly": "coci_core.planner.policies",
    "Epoch": "coci_core.planner.policies",
    "EveryNSeconds": "coci_core.planner.policies",
    "EveryNSteps": "coci_core.planner.policies",
    "PlanContext": "coci_core.planner.policies",
    "SavePolicy": "coci_core.planner.policies",
    "Young": "coci_core.planner.policies",
    "make_policy": "coci_core.planner.policies",
    "ExpectedOverhead": "coci_core.planner.schedule",
    "Schedule": "coci_core.planner.schedule",
    "plan_schedule": "coci_core.planner.schedule",
    "METRICS": "coci_core.planner.simulate",
    "MetricEstimate": "coci_core.planner.simulate",
    "SimulationResult": "coci_core.planner.simulate",
    "simulate": "coci_core.planner.simulate",
    "closed_form_schedule": "coci_core.planner.solvers",
    "dp_schedule": "coci_core.planner.solvers",
    "uniform_schedule": "coci_core.planner.solvers",
    "TierCosts": "coci_core.planner.two_level",
    "TwoLevelPlan": "coci_core.planner.two_level",
    "plan_two_levels": "coci_core.planner.two_level",
    "register_objective": "coci_core.planner.objectives",
}

__all__ = [
    "DEFAULT_MTBF_S",
    "METRICS",
    "OBJECTIVES",
    "POLICIES",
    "AshaRungs",
    "CheckFreq",
    "Coci",
    "CociPaper",
    "CostBreakdown",
    "CostEstimate",
    "CostEstimator",
    "Daly",
    "Epoch",
    "EveryNSeconds",
    "EveryNSteps",
    "ExpectedOverhead",
    "FailureModel",
    "LossCurve",
    "MetricEstimate",
    "NoTermination",
    "Objective",
    "PlanContext",
    "Planner",
    "PlannerConfig",
    "TierCosts",
    "TwoLevelPlan",
    "PlannerReport",
    "Problem",
    "SavePolicy",
    "Schedule",
    "SimulationResult",
    "StopDistribution",
    "SurvivalFunction",
    "Termination",
    "UniformKill",
    "Young",
    "closed_form_schedule",
    "daly_interval_s",
    "dp_schedule",
    "estimate_mtbf_s",
    "expected_cost",
    "fit_loss_curve",
    "make_objective",
    "make_policy",
    "plan_schedule",
    "plan_two_levels",
    "register_objective",
    "planner_config",
    "simulate",
    "uniform_schedule",
    "value_density",
    "young_interval_s",
]


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'coci_core.planner' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
