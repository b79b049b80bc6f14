"""The Planner's checkpointed state: ``state_dict``/``load_state_dict`` (JSON-compatible)."""

from __future__ import annotations

import math
from typing import Any

from coci_core.errors import ConfigError
from coci_core.planner.curve import FLAT, curve_from_dict
from coci_core.planner.replanning import Replanner

__all__ = ["FORMAT_VERSION", "load_planner_state", "planner_state"]

FORMAT_VERSION = 1


def planner_state(plan: Replanner) -> dict[str, Any]:
    """See :meth:`Planner.state_dict`."""
    obs = plan.obs
    with obs.lock:
        exclude = obs.exclude_next
    return {
        "format_version": FORMAT_VERSION,
        "policy": plan.settings.policy_name,
        "objective": plan.settings.objective,
        "costs": obs.costs.state_dict(),
        "losses": obs.losses.state_dict(),
        "first_losses": [list(r) for r in obs.first_losses],
        "skipped_losses": obs.skipped,
        "observed": obs.observed,
        "last_step": obs.last_step,
        "elapsed_s": obs.elapsed_s + obs.outside_s(),
        "failures": obs.failures,
        "schedule": list(plan.schedule),
        "ptr": plan.ptr,
        "last_true": obs.last_true,
        "exclude_next": exclude,
        "next_replan": plan.next_replan,
        "force_replan": plan.force_replan,
        "replans": plan.replans,
        "plan_inputs": dict(plan.plan_inputs),
        "horizon_end": plan.horizon_end,
        "regime_flagged": plan.regime_flagged,
        "curve": plan.curve.to_dict(),
        "pending_curve": None if plan.pending_curve is None else plan.pending_curve.to_dict(),
    }


def _finite(value: Any, name: str) -> float:
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"'{name}' must be a finite number >= 0, got {value!r}")
    return number


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def load_planner_state(plan: Replanner, state: dict[str, Any]) -> None:
    """See :meth:`Planner.load_state_dict`."""
    policy = plan.settings.policy_name
    if state.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"'state' format_version must be {FORMAT_VERSION}: {state.get('format_version')!r}"
        )
    saved_policy = state.get("policy")
    if not isinstance(saved_policy, str):
        raise ConfigError(f"'state' policy must be a policy's name: {saved_policy!r}")
    obs = plan.obs
    obs.costs.load_state_dict(state["costs"])
    obs.losses.load_state_dict(state["losses"])
    obs.first_losses = [[float(a), float(b)] for a, b in state["first_losses"]]
    obs.skipped = int(state["skipped_losses"])
    obs.observed = int(state["observed"])
    obs.last_step = _optional_int(state["last_step"])
    obs.close_wall()
    obs.elapsed_s = _finite(state["elapsed_s"], "elapsed_s")
    obs.failures = int(state["failures"])
    obs.last_true = int(state["last_true"])
    with obs.lock:
        obs.exclude_next = bool(state["exclude_next"])
    if saved_policy != policy:
        # the run goes on under another policy (the user changed it between runs): the
        # measurements hold, the saved plan was another policy's: plan afresh at once
        plan.curve = plan.no_curve()
        plan.pending_curve = None
        plan.force_replan = True
        plan.problem = None
        plan.overhead = None
        return
    plan.schedule = [int(s) for s in state["schedule"]]
    plan.ptr = int(state["ptr"])
    plan.next_replan = _optional_int(state["next_replan"])
    plan.force_replan = bool(state["force_replan"])
    plan.replans = int(state["replans"])
    plan.plan_inputs = {
        str(k): _finite(v, f"plan_inputs.{k}") for k, v in state["plan_inputs"].items()
    }
    plan.horizon_end = _optional_int(state["horizon_end"])
    plan.regime_flagged = bool(state["regime_flagged"])
    plan.curve = plan.no_curve()
    plan.pending_curve = None
    if plan.uses_curve:  # a curve saved under another objective is not used
        plan.curve = curve_from_dict(state["curve"]) if state.get("curve") else FLAT
        pending = state.get("pending_curve")
        plan.pending_curve = curve_from_dict(pending) if pending else None
    plan.problem = None
    plan.overhead = None
