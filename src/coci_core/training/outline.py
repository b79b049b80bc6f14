"""What an adapter's one log line on the plan says: the facts, gathered once for every adapter
(each words the line for its own users, naming its own arguments)."""

from __future__ import annotations

import dataclasses

from coci_core.planner import Planner
from coci_core.planner.report import PlannerReport

__all__ = ["PlanOutline"]

_MTBF_SOURCES = {"user": "given as mtbf_s"}


FIXED_INTERVAL_POLICIES = frozenset({"every_n_steps", "every_n_seconds", "epoch"})


@dataclasses.dataclass(frozen=True)
class PlanOutline:
    """The plan as a log line tells it (see :meth:`Checkpointer.plan_outline
    <coci_core.training.Checkpointer.plan_outline>`).

    Attributes:
        report: the planner's report (without the expected overhead: cheap).
        total_steps: the run's steps, if known.
        every_n_steps: the interval (or cap on it) given, if any.
        every_n_seconds: the interval in seconds given, if any.
        default_mtbf_s: coci's prior MTBF (without ``mtbf_s`` and failures, the plan's MTBF
            is this plus the time run without a failure).
        failures: the failures the planner counts (the MTBF estimated from them is
            ``(time run + default_mtbf_s) / (failures + 1)``).
    """

    report: PlannerReport
    total_steps: int | None
    every_n_steps: int | None
    every_n_seconds: float | None
    default_mtbf_s: float | None = None
    failures: int = 0

    @classmethod
    def of(cls, planner: Planner) -> PlanOutline:
        """The outline of ``planner``'s current plan."""
        return cls(
            report=planner.report(with_overhead=False),
            total_steps=planner.total_steps,
            every_n_steps=planner.every_n_steps,
            every_n_seconds=planner.every_n_seconds,
            default_mtbf_s=planner.default_mtbf_s,
            failures=planner.failures,
        )

    @property
    def mtbf_s(self) -> float:
        """The MTBF planned with (NaN when there is none)."""
        mtbf = self.report.mtbf_s
        return mtbf if mtbf is not None else float("nan")

    @property
    def step_time_s(self) -> float:
        """The measured step time (0 until measured)."""
        return self.report.costs.get("step_time_s") or 0.0

    @property
    def fixed_interval(self) -> bool:
        """Whether the policy saves at a fixed interval (the MTBF and costs do not move it)."""
        return self.report.policy in FIXED_INTERVAL_POLICIES

    def fixed_advice(self, adapter: str) -> str:
        """How to change a fixed interval, for the plan line of ``adapter`` (its class)."""
        option = {
            "every_n_seconds": "every_n_seconds=S",
            "epoch": "policy='every_n_steps', every_n_steps=N",
        }.get(self.report.policy, "every_n_steps=N")
        return (
            f"a fixed interval: the MTBF and the measured costs do not change it; change it "
            f"with {adapter}({option}), or leave policy out for coci to plan from "
            "the measured costs"
        )

    def mtbf_source(self, default: str) -> str:
        """Where the MTBF comes from, in words; ``default`` words coci's default (to which
        the time run without a failure is added, said when it shows)."""
        source = self.report.mtbf_source
        if source == "estimated" and self.default_mtbf_s is not None and self.failures > 0:
            # the default counts as one failure: with few failures, it weighs the most
            n, prior = self.failures, self.default_mtbf_s
            run = max(0.0, self.mtbf_s * (n + 1) - prior)
            failures = f"{n} failure" + ("" if n == 1 else "s")
            return (
                f"coci's default {prior:.0f} s, counted as one failure, averaged with this "
                f"run's {failures} in {run:.0f} s: ({prior:.0f} + {run:.0f}) / {n + 1}"
            )
        if source == "estimated":
            return "coci's default, counted as one failure, averaged with this run's failures"
        if source != "default":
            return _MTBF_SOURCES.get(source, source)
        grown = self.mtbf_s - (self.default_mtbf_s or self.mtbf_s)
        if grown >= 0.5:
            return f"{default}, plus the {grown:.0f} s run without a failure"
        return default

    def line(
        self,
        step: int,
        *,
        adapter: str,
        objective: str,
        total_source: str | None = None,
        total_hint: str | None = None,
        final_save: bool = True,
    ) -> tuple[str, bool]:
        """The plan line every adapter logs once (rank 0), in one wording: the plan, when
        the first save comes and how often, the MTBF and where it comes from, and how to
        change it with ``adapter``'s arguments; and whether it is a warning (no save is
        planned before the end).

        Args:
            step: the step the line is told at.
            adapter: the class the user made (named in the advice).
            objective: the planner's objective.
            total_source: where the total steps come from ("given as total_steps").
            total_hint: how to give the total, said when it is unknown.
            final_save: whether the adapter saves at the end of training.
        """
        report, total, every = self.report, self.total_steps, self.every_n_steps
        ahead = [s for s in report.next_steps if s > step]
        first = ahead[0] if ahead else None
        interval = ahead[1] - ahead[0] if len(ahead) > 1 else report.interval_steps
        if interval is None and report.policy == "every_n_steps":
            interval = every
        if first is not None and total is not None and first > total:
            first = None
        step_time = self.step_time_s
        if total is None:
            length = "over a rolling horizon" + (f" ({total_hint})" if total_hint else "")
        else:
            length = f"of {total} steps" + (f" ({total_source})" if total_source else "")
        measuring = first is None and step_time == 0 and not self.fixed_interval
        warn = first is None and not measuring and report.policy != "every_n_seconds"
        if report.policy == "every_n_seconds":
            when = f"a save every {self.every_n_seconds:g} s"
        elif measuring:
            when = "first save planned once a few step times are measured"
        elif first is None:
            when = "no save planned before the end"
            when += " (only the final save)" if final_save else ""
        else:
            when = f"first save at step {first}" + _took(first - step, step_time, "in ")
        if report.policy == "every_n_seconds" or warn:
            then = ""
        elif first is not None and total is not None and first >= total:
            then = ", the run's last step"  # no interval after the run's end
        elif interval:
            then = f", then every {interval} steps" + _took(interval, step_time)
        else:
            then = ", then at an interval from the measured costs" + (
                f", at most {every} steps" if every is not None else ""
            )
        head = f"coci: plan at step {step} ({report.policy} policy, {objective} objective) {length}"
        if self.fixed_interval:
            return f"{head}: {when}{then}; {self.fixed_advice(adapter)}.", warn
        # whole seconds: the default refined by a second of failure-free time is no news
        mtbf = (
            f"{self.mtbf_s:.0f}"
            if 10 <= self.mtbf_s < 1e9  # past a billion seconds: 1e+308, not 309 digits
            else f"{self.mtbf_s:.3g}"
        )
        source = self.mtbf_source("coci's default: no mtbf_s given and no failure seen yet")
        return (
            f"{head}: {when}{then}; MTBF assumed {mtbf} s ({source}). Change it with "
            f"{adapter}(mtbf_s=..., every_n_steps=N (a cap on the interval), "
            "policy='every_n_steps'); the plan is re-made as costs are measured.",
            warn,
        )


def _took(steps: int, step_time_s: float, prefix: str = "") -> str:
    """`` (~X s)`` for ``steps`` of ``step_time_s``, once step times are measured."""
    return f" ({prefix}~{steps * step_time_s:.3g} s)" if step_time_s > 0 else ""
