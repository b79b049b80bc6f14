"""Convergence-aware checkpoint planner: when to checkpoint, measured, explained and simulated.

Public names: :class:`Planner` (the online object used by the adapters), :func:`plan_schedule`
(the pure entry point), :func:`simulate` (Monte Carlo), the policies, the objectives and the
models.
"""

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
from coci_core.planner.objectives import OBJECTIVES, Objective, make_objective
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
    "planner_config",
    "simulate",
    "uniform_schedule",
    "value_density",
    "young_interval_s",
]
