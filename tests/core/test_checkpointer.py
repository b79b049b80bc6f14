"""Checkpointer: the planner and the engine joined; shared decisions across ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import ConfigError
from coci_core.checkpointer import Checkpointer
from coci_core.decision import SharedDecision
from coci_core.planner import Planner


def test_measured_save_costs_reach_the_planner(tmp_path: Path) -> None:
    """After a committed save the planner's stall and persist are measured, not defaults."""
    with_ckpt = Checkpointer(tmp_path, policy="every_n_steps", planner_options={"every_n_steps": 2})
    assert with_ckpt.planner.cost_source("stall_s") == "default"
    with_ckpt.save(2, {"w": torch.ones(10)})
    with_ckpt.wait()
    assert with_ckpt.planner.cost_source("stall_s") == "measured"
    assert with_ckpt.planner.cost_source("persist_s") == "measured"
    with_ckpt.close()


def test_bad_arguments(tmp_path: Path) -> None:
    """Unknown compression modes and bad telemetry settings are refused."""
    with pytest.raises(ConfigError, match="'compression' must be one of"):
        Checkpointer(tmp_path, compression="zstd")
    with pytest.raises(ConfigError, match="'telemetry_every_n_steps'"):
        Checkpointer(tmp_path, telemetry_every_n_steps=0)
    with pytest.raises(ConfigError, match="'policy'"):
        Checkpointer(tmp_path, policy="often")


def test_shared_decision_same_on_every_rank_with_few_broadcasts() -> None:
    """Two ranks whose planners see different losses and step times decide identically,
    broadcasting only at sync steps (far fewer than the steps)."""
    sent: dict[int, Any] = {}
    calls = {0: [], 1: []}  # type: dict[int, list[int]]

    def broadcaster(rank: int, step_of: list[int]) -> Any:
        def broadcast(obj: Any) -> Any:
            calls[rank].append(step_of[0])
            if rank == 0:
                sent[step_of[0]] = obj
            return sent[step_of[0]]

        return broadcast

    current = [0]
    planners = [
        Planner(policy="daly", total_steps=3000, mtbf_s=600.0, stall_s=0.5, step_time_s=0.1),
        Planner(policy="daly", total_steps=3000, mtbf_s=600.0, stall_s=0.5, step_time_s=0.3),
    ]
    ranks = [SharedDecision(planners[r], rank=r, broadcast=broadcaster(r, current)) for r in (0, 1)]
    decided: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 3000):
        current[0] = step
        for r in (0, 1):  # rank 0 reaches each collective first, as a real broadcast orders
            planners[r].observe(step, loss=5.0 / (1 + step * (r + 1)), step_time_s=0.1 * (r + 1))
            if ranks[r].should_save(step):
                decided[r].append(step)
    assert decided[0] == decided[1]
    assert len(decided[0]) >= 3
    assert calls[0] == calls[1]
    assert len(calls[0]) < len(decided[0]) + 15
