"""``coci report DIR``: what a run's checkpoints cost and how they compare with the plan (DIR
a path or an fsspec URL)."""

from __future__ import annotations

import itertools
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coci_core.knobs import MAX_SCHEDULE_STEPS, TELEMETRY_PUT_DELAY_S, TELEMETRY_PUT_GAP_S
from coci_core.storage import is_url, open_storage
from coci_core.telemetry import TELEMETRY_FILE
from coci_core.telemetry.records import read_records, skipped_line, split_runs
from coci_core.telemetry.report_events import (
    SESSION_STARTS,
    notices,
    num,
    plural,
    preemption_line,
    uploads_line,
)

__all__ = [
    "MTBF_SOURCES",
    "Restart",
    "RunSummary",
    "compare_policies",
    "earlier_runs_lines",
    "facts",
    "lost_steps",
    "no_telemetry_hint",
    "render_facts",
    "render",
    "render_policies",
    "summarize",
]


@dataclass(frozen=True)
class Restart:
    """A restore that started a new session of the run: the run went back from ``failed_at``
    (the step the previous session reached) to ``restored``; the steps between were trained
    twice.

    ``index`` is the restore record's position in the records; ``failure``: the previous
    session failed (it did not end, ended on an error, or ended past the step restored), else
    the run simply went on (``fit()`` then ``fit(ckpt_path="last")``, or a finished run
    trained further);
    ``exact``: ``failed_at`` is the step the previous process last reached, not only the last
    step its records name (at most a few seconds older); ``checkpoint``: a checkpoint was
    restored (False: a ``start`` record, the session started over from step 0 with none to
    restore)."""

    index: int
    restored: int
    failed_at: int
    failure: bool = True
    exact: bool = False
    checkpoint: bool = True

    @property
    def lost_steps(self) -> int:
        return lost_steps(self.restored, self.failed_at)


def lost_steps(restored: int, reached: int) -> int:
    """The work a restart lost, in steps: those the run had reached past the step it
    restored, trained again. The one definition ``coci report``, the TensorBoard tab, the
    demo and the telemetry use."""
    return max(0, int(reached) - int(restored))


#: The longest run whose policies the report compares (the planner's per-step arrays; a step
#: read from telemetry may be anything up to 2**63 - 1).
COMPARE_MAX_STEPS = MAX_SCHEDULE_STEPS

#: The records that say the run reached their step.
STEP_RECORDS = ("loss", "plan", "save", "progress", "end", "preemption")


def _step(r: dict[str, Any]) -> int | None:
    step = r.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class RunSummary:
    """The facts ``coci report`` prints, gathered from a checkpoint directory's telemetry
    (``records`` checked as :func:`~coci_core.telemetry.records.parse_records` checks them;
    ``skipped_lines``: the lines it could not use).

    Of the latest run the records hold (:func:`~coci_core.telemetry.records.split_runs`),
    its ``run_id`` (None: not recorded); the earlier ones are in ``earlier_runs``, oldest first."""

    def __init__(self, records: list[dict[str, Any]], skipped_lines: int = 0) -> None:
        *earlier, records = split_runs(records)
        self.earlier_runs = [RunSummary(run) for run in earlier]
        self.run_id: str | None = next((r["run_id"] for r in records if r.get("run_id")), None)
        self.records = records
        self.skipped_lines = skipped_lines
        self.saves = [r for r in records if r.get("type") == "save"]
        self.plans = [r for r in records if r.get("type") == "plan"]
        self.restores = [r for r in records if r.get("type") == "restore"]
        self.uploads = [r for r in records if r.get("type") == "upload"]
        self.losses = [r for r in records if r.get("type") == "loss"]
        #: the preemption notices: each one's decision and outcome
        self.preemptions = notices(records)
        self.committed = [s for s in self.saves if s.get("outcome") == "committed"]
        #: every step any plan proposed, reached or not (the tab draws them)
        self.proposed = sorted({int(s) for p in self.plans for s in p.get("next_steps", [])})
        #: per restore: the restart it started (a failure's, or the run going on)
        self.resumes = self._restarts(records)
        #: the restarts after a failure
        self.restarts = [r for r in self.resumes if r.failure]
        #: per restart, its whole restart record (process start to first step), if written
        self.restart_records = [self._restart_record(records, r.index) for r in self.restarts]
        self.lost_steps = [r.lost_steps for r in self.restarts]
        #: the steps the run trained: the last step it reached
        self.last_step = max(
            [s for s in map(_step, records) if s is not None] + [r.failed_at for r in self.resumes],
            default=0,
        )
        #: the planned steps the run reached, each under the plan in force when it came
        self.planned = self._planned(records)

    @staticmethod
    def _restarts(records: list[dict[str, Any]]) -> list[Restart]:
        # Steps reached after the newest checkpoint and before a restore were trained twice.
        restarts: list[Restart] = []
        last: int | None = None
        ended = False
        for i, r in enumerate(records):
            kind, step = r.get("type"), _step(r)
            if kind in STEP_RECORDS and step is not None:
                last = step if last is None else max(last, step)
                ended = ended or (kind == "end" and not r.get("failed"))
            elif kind in SESSION_STARTS and step is not None:
                reached = r.get("reached")
                exact = isinstance(reached, int) and not isinstance(reached, bool)
                failed_at = max(
                    x for x in (step, last, reached if exact else None) if x is not None
                )
                failure = not ended or failed_at > step
                restarts.append(Restart(i, step, failed_at, failure, exact, kind == "restore"))
                last, ended = step, False
        return restarts

    def _planned(self, records: list[dict[str, Any]]) -> list[int]:
        """Each session (the steps from a restore, or the start, to the step it reached) under
        its plans: a step is planned when the plan made before it, in that session, has it."""
        bounds = [(0, -1)] + [(r.restored, r.index) for r in self.resumes]
        ends = [r.failed_at for r in self.resumes] + [self.last_step]
        planned: set[int] = set()
        for (start, begin), reach, finish in zip(
            bounds, ends, [r.index for r in self.resumes] + [len(records)], strict=True
        ):
            plans = sorted(
                (int(p["step"]), [int(s) for s in p.get("next_steps", [])])
                for p in records[begin + 1 : finish]
                if p.get("type") == "plan" and _step(p) is not None
            )
            for j, (made, steps) in enumerate(plans):
                until = min(plans[j + 1][0], reach) if j + 1 < len(plans) else reach
                planned.update(s for s in steps if max(made, start) < s <= until)
        return sorted(planned)

    @staticmethod
    def _restart_record(records: list[dict[str, Any]], index: int) -> dict[str, Any] | None:
        for r in records[index + 1 :]:
            if r.get("type") in SESSION_STARTS:
                return None
            if r.get("type") == "restart":
                return r
        return None

    @property
    def last_plan(self) -> dict[str, Any] | None:
        return self.plans[-1] if self.plans else None

    @property
    def ahead(self) -> list[int]:
        """The steps the last plan still had ahead of the run's last step."""
        plan = self.last_plan
        steps = [] if plan is None else plan.get("next_steps", [])
        return sorted(int(s) for s in steps if int(s) > self.last_step)


def summarize(directory: str | Path, storage_options: dict[str, Any] | None = None) -> RunSummary:
    """Read ``DIR/telemetry.jsonl``, or for an fsspec URL every session's object under
    ``DIR/telemetry/`` (written by the Lightning and Accelerate adapters)."""
    if is_url(directory):
        from coci_core.telemetry.objects import TELEMETRY_DIR, read_object_records

        read = read_object_records(open_storage(directory, **(storage_options or {})))
        if read is None:
            raise FileNotFoundError(
                f"no telemetry in {directory}/{TELEMETRY_DIR}/: a run writes it there when "
                f"this URL is its checkpoint directory (a remote tier's run keeps it with its "
                f"local directory, in {TELEMETRY_FILE})"
            )
        return RunSummary(*read)
    path = Path(directory) / TELEMETRY_FILE
    if not path.is_file():
        if path.exists() or path.is_symlink():  # a FIFO, a directory, a device, a broken link
            raise FileNotFoundError(
                f"{path} is not a regular file: coci reads a run's telemetry from the file its "
                "adapter writes there"
            )
        raise FileNotFoundError(no_telemetry_hint(directory))
    return RunSummary(*read_records(path))


def no_telemetry_hint(directory: str | Path) -> str:
    """What to do when a local checkpoint directory has no telemetry, in one line: the
    adapters write it; a plain :class:`~coci_core.CheckpointManager` loop writes it with a
    listener (the engine itself writes checkpoints only)."""
    path = Path(directory) / TELEMETRY_FILE
    said = f"no {TELEMETRY_FILE} in {directory}"
    try:  # a run's output folder, its adapter's "coci" folder below it (coci's default first)
        with os.scandir(directory) as listing:
            children = sorted(
                (Path(e.path) for e in itertools.islice(listing, 200) if e.is_dir()),
                key=lambda c: (c.name != "coci", c.name),
            )
        for child in children:
            if (child / TELEMETRY_FILE).is_file():
                return f"{said}; did you mean {child}? (it holds a run's {TELEMETRY_FILE})"
    except OSError:
        pass
    return (
        f"{said}: the adapters (Lightning's CociCheckpoint, Accelerate's CociCheckpointer, the "
        f"Trainer's CociCallback) write it in their checkpoint directory; with a "
        f"CheckpointManager, pass listeners=[JsonlTelemetry({str(path)!r})] (from "
        f"coci_core.telemetry) to write it (coci ls {directory} lists the checkpoints)"
    )


def compare_policies(
    summary: RunSummary, total_steps: int, policies: tuple[str, ...] = ("coci", "daly", "checkfreq")
) -> list[dict[str, Any]]:
    """Each policy's plan for the run's ``total_steps``, made afresh with the last plan's
    measured costs and MTBF and the observed losses, and its expected overhead (rows with
    ``policy``, ``checkpoints``, ``wall_s``, ``objective_s``). The ``coci`` row is not the plan
    the run followed (made as it measured its costs, the steps :attr:`RunSummary.planned`
    counts), and no row counts the final save."""
    from coci_core.errors import ConfigError
    from coci_core.planner import plan_schedule

    plan = summary.last_plan
    if plan is None or plan.get("mtbf_s") is None or total_steps > COMPARE_MAX_STEPS:
        return []
    costs = plan.get("costs") or {}
    if not costs.get("step_time_s"):
        return []
    steps = [r["step"] for r in summary.losses if r.get("loss") is not None]
    losses = [r["loss"] for r in summary.losses if r.get("loss") is not None]
    rows = []
    for policy in policies:
        try:
            sched = plan_schedule(
                total_steps=total_steps,
                step_time_s=costs["step_time_s"],
                stall_s=max(costs.get("stall_s") or 0.0, 1e-6),
                persist_s=costs.get("persist_s") or 0.0,
                restart_s=costs.get("restart_s") or 0.0,
                mtbf_s=plan["mtbf_s"],
                loss=(steps, losses) if len(steps) >= 8 else None,
                objective=plan.get("objective") or "time",
                policy=policy,
            )
        except (ConfigError, ValueError, ArithmeticError, MemoryError):
            continue  # costs the planner cannot plan with (telemetry is read, not trusted)
        ov = sched.expected_overhead_s
        rows.append(
            {
                "policy": policy,
                "checkpoints": len(sched.steps),
                "wall_s": ov.wall_s,
                "objective_s": ov.objective_s,
            }
        )
    return rows


def not_compared(summary: RunSummary, total_steps: int) -> str:
    """Why :func:`compare_policies` gives no rows for this run, in words."""
    plan = summary.last_plan
    if plan is None:
        return "no plan recorded (coci's planner did not choose these saves)"
    if total_steps <= 0:
        return "no step trained"
    if total_steps > COMPARE_MAX_STEPS:
        return f"the policies are compared over at most {COMPARE_MAX_STEPS:,} steps"
    if plan.get("mtbf_s") is None:
        return "the plan recorded no MTBF"
    if not (plan.get("costs") or {}).get("step_time_s"):
        return "no step time measured yet"
    return "the planner could not plan with the recorded costs"


def facts(summary: RunSummary, total_steps: int | None = None) -> dict[str, Any]:
    """The run's headline numbers, as ``coci report`` prints them and the TensorBoard tab shows
    them: checkpoints planned (the steps reached that the plan in force had), ``taken`` (those
    of them committed), committed (every save: the final one, and any other, too), skipped
    and failed, the total stall (s), restarts after a failure and the steps of work
    they lost, resumes that lost nothing (the run went on after it ended), the steps the run
    trained, and each policy's expected overhead (:func:`compare_policies`) over
    ``total_steps`` (default: the steps the run trained), or why not (``not_compared``)."""
    total = total_steps if total_steps is not None else summary.last_step
    stalls = [s.get("stall_s") for s in summary.saves]
    policies = compare_policies(summary, total) if total > 0 else []
    return {
        "planned": len(summary.planned),
        "taken": _taken(summary),
        "committed": len(summary.committed),
        "skipped": sum(1 for s in summary.saves if s.get("outcome") == "skipped"),
        "failed": sum(1 for s in summary.saves if s.get("outcome") == "failed"),
        "total_stall_s": sum(float(v) for v in stalls if isinstance(v, (int, float))),
        "restarts": len(summary.restarts),
        "resumes": len(summary.resumes) - len(summary.restarts),
        "lost_steps": sum(summary.lost_steps),
        # the step each failed session reached is known (else lost_steps is a lower bound)
        "lost_exact": all(r.exact for r in summary.restarts),
        "steps": total,
        "policies": policies,
        "not_compared": None if policies else not_compared(summary, total),
        "termination": termination_effect(summary),
    }


def _taken(summary: RunSummary) -> int:
    """The planned steps (:attr:`RunSummary.planned`) that were committed."""
    return len(set(summary.planned) & {int(s["step"]) for s in summary.committed})


def _float(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def termination_effect(summary: RunSummary) -> dict[str, float] | None:
    """How much the termination hazard changed the last plan (by its objective): the plan's
    expected overhead, the same for the plan made without the hazard, Daly's, and the
    ``saving``: the share of the plan-without-the-hazard's overhead that the hazard saves
    (0 to 1), and ``share_of_gain``: the share of the plan's gain over Daly it brings (0 to
    1, see :func:`~coci_core.planner.schedule.termination_share`); None without a
    termination model.

    (Not a share of the plan's gain over Daly: where the plan made without the hazard costs
    more than Daly's, that share exceeds 100% and tells nothing.)"""
    plan = summary.last_plan
    ov = plan.get("expected_overhead") if plan is not None else None
    if not isinstance(ov, dict):
        return None
    objective_s = _float(ov.get("objective_s"))
    without_s = _float(ov.get("without_termination_objective_s"))
    daly_s = _float(ov.get("daly_objective_s"))
    if objective_s is None or without_s is None or daly_s is None:
        return None
    from coci_core.planner.schedule import termination_share

    saved = max(0.0, without_s - objective_s)
    return {
        "objective_s": objective_s,
        "without_objective_s": without_s,
        "daly_objective_s": daly_s,
        "saving": saved / without_s if without_s > 0 else 0.0,
        "share_of_gain": termination_share(objective_s, without_s, daly_s),
    }


def render_facts(f: dict[str, Any]) -> list[str]:
    """:func:`facts` as lines of text."""
    saves = f["committed"] + f["failed"]
    at_least = "" if f.get("lost_exact", True) else "at least "
    lost = f"lost work: {at_least}{plural(f['lost_steps'], 'step')}"
    lost += f" over {plural(f['restarts'], 'restart')} after a failure"
    if f.get("resumes"):
        lost += f" (and {plural(f['resumes'], 'resume')} that lost nothing)"
    lines = [
        f"total stall {f['total_stall_s']:.3f} s over {plural(saves, 'save')}; {lost}",
        "",
    ]
    if f["policies"]:
        lines += [
            f"each policy's plan over the run's {plural(f['steps'], 'step')}, made afresh with "
            "the costs measured by its end, and its expected overhead (not the plan the run "
            "followed, made as it measured them; the final save not counted):",
            render_policies(f["policies"]),
        ]
    else:
        lines.append(f"policies not compared: {f.get('not_compared') or 'no measured costs yet'}")
    t = f.get("termination")
    if t:
        lines.append(
            f"termination hazard: the plan's expected overhead {t['objective_s']:.2f} s by its "
            f"objective, {t['without_objective_s']:.2f} s for the plan made without it (the "
            f"hazard saves {t['saving']:.0%}); Daly's {t['daly_objective_s']:.2f} s"
        )
    return lines


def render_policies(rows: list[dict[str, Any]]) -> str:
    """The policy comparison as a table."""
    if not rows:
        return "(no measured costs yet to compare policies)"
    lines = [f"{'policy':<10} {'checkpoints':>11} {'wall-clock s':>13} {'objective s':>12}"]
    for r in rows:
        lines.append(
            f"{r['policy']:<10} {r['checkpoints']:>11} {r['wall_s']:>13.2f} "
            f"{r['objective_s']:>12.2f}"
        )
    return "\n".join(lines)


def _ms(values: list[Any]) -> str:
    known = [v for v in values if isinstance(v, (int, float))]
    return f"{1e3 * statistics.median(known):.1f} ms" if known else "-"


def render(
    summary: RunSummary, *, tensorboard_dir: str | None = None, with_overhead: bool = True
) -> str:
    """The report as text (``with_overhead=False``: without the plan's expected overhead, for
    a caller that states each policy's overhead itself)."""
    lines = [skipped_line(summary.skipped_lines)] if summary.skipped_lines else []
    lines += earlier_runs_lines(summary)
    actual = [s["step"] for s in summary.committed]
    lines.append(f"checkpoints committed: {len(actual)} at steps {actual}")
    if not summary.plans:
        lines.append("no plan recorded: coci's planner did not choose these saves")
    else:
        lines.append(
            f"checkpoints planned over the {plural(summary.last_step, 'step')} run: "
            f"{len(summary.planned)} at steps {summary.planned[:20]}"
            + (" ..." if len(summary.planned) > 20 else "")
            + f", {_taken(summary)} of them taken"
            + (f"; still ahead: {summary.ahead[:10]}" if summary.ahead else "")
        )
    skipped = [s["step"] for s in summary.saves if s.get("outcome") == "skipped"]
    failed = [s["step"] for s in summary.saves if s.get("outcome") == "failed"]
    if skipped or failed:
        lines.append(f"skipped saves: {skipped}; failed saves: {failed}")
    lines.append("")
    lines.append(f"{'step':>8} {'stall ms':>10} {'persist ms':>11} {'durable ms':>11} {'MB':>9}")
    for s in summary.committed:
        lines.append(
            f"{s['step']:>8} {num(s.get('stall_s'), '.2f', 1e3):>10} "
            f"{num(s.get('persist_s'), '.2f', 1e3):>11} "
            f"{num(s.get('time_to_durable_s'), '.2f', 1e3):>11} "
            f"{num(s.get('bytes_written'), '.2f', 1e-6):>9}"
        )
    lines.append(
        f"median stall {_ms([s.get('stall_s') for s in summary.committed])}, "
        f"median persist {_ms([s.get('persist_s') for s in summary.committed])}"
    )
    if summary.uploads:
        lines.append(uploads_line(summary.uploads))
    for notice in summary.preemptions:
        lines.append(preemption_line(notice))
    for resume in summary.resumes:
        lines.append(restart_line(summary, resume))
    plan = summary.last_plan
    if plan is not None:
        lines.append("")
        mtbf = num(plan.get("mtbf_s"), ".0f", unknown="")
        source = plan.get("mtbf_source")
        lines.append(
            f"plan: policy {plan.get('policy') or '?'}, objective "
            f"{plan.get('objective') or '?'}, {_plan_when(plan)}, "
            + (f"MTBF {mtbf} s" if mtbf else "MTBF unknown")
            + (f" ({MTBF_SOURCES.get(source, source)})" if source else "")
        )
        overhead = plan.get("expected_overhead") if with_overhead else None
        if overhead:

            def cost(key: str) -> str:
                return num(overhead.get(key), ".1f", unknown="?")

            lines.append(
                f"expected overhead over the horizon: plan {cost('wall_s')} s wall-clock "
                f"({cost('objective_s')} s by its objective) vs Daly "
                f"{cost('daly_wall_s')} s ({cost('daly_objective_s')} s)"
            )
    if with_overhead:
        lines.append("")
        lines += render_facts(facts(summary))
    if tensorboard_dir:
        lines.append("")
        lines.append(f"see it in TensorBoard's coci tab: tensorboard --logdir {tensorboard_dir}")
    return "\n".join(lines)


#: the earlier runs ``coci report`` and the TensorBoard tab list, the newest ones
EARLIER_RUNS_LISTED = 10


def earlier_runs_lines(summary: RunSummary) -> list[str]:
    """The runs written there before the one reported, a line each ([] for none): the
    ``EARLIER_RUNS_LISTED`` newest, and how many older ones are not listed."""
    runs = [*summary.earlier_runs, summary]
    names = [f"run {r.run_id}" if r.run_id else "a run (no run id recorded)" for r in runs]
    lines = [
        f"this directory's telemetry holds {len(runs)} runs, one after the other: this report "
        f"is of the latest, {names[-1]}; the earlier ones:"
    ]
    older = len(summary.earlier_runs) - EARLIER_RUNS_LISTED
    if older > 0:
        lines.append(f"  ({plural(older, 'older run')} not listed)")
        runs, names = runs[older:], names[older:]
    for run, name in zip(runs[:-1], names, strict=False):
        steps = [s["step"] for s in run.committed]
        lines.append(
            f"  {name}: {plural(run.last_step, 'step')}, {plural(len(steps), 'checkpoint')}"
            f" committed at steps {steps[:10]}{' ...' if len(steps) > 10 else ''}"
        )
    return [*lines, ""] if summary.earlier_runs else []


#: Where a plan's MTBF comes from, in words. Without a failure the estimate is coci's prior
#: plus the time the run has gone without one, so it grows past the default as the run goes;
#: with failures, the prior counts as one of them (after one, the MTBF is about half of it).
MTBF_SOURCES = {
    "user": "given as mtbf_s",
    "estimated": "coci's default, counted as one failure, averaged with this run's failures: "
    "(default + time run) / (failures + 1)",
    "default": "no mtbf_s given: coci's default, plus the time run without a failure",
}


def _plan_when(plan: dict[str, Any]) -> str:
    """The plan's checkpoints in words: its interval, else its next planned step."""
    interval = plan.get("interval_steps")
    if isinstance(interval, int) and interval > 0:
        return f"interval {plural(interval, 'step')}"
    ahead = sorted(int(s) for s in plan.get("next_steps", []) if int(s) > int(plan["step"]))
    if ahead:
        return f"next checkpoint at step {ahead[0]}"
    return f"no checkpoint planned after step {plan['step']} (the run's end, or its final save)"


def restart_line(summary: RunSummary, resume: Restart) -> str:
    """One restore: what it read, the whole restart, and the work lost (or that the run went
    on from where it ended)."""
    r = summary.records[resume.index]
    if not resume.checkpoint:  # written only where the step reached is known
        return (
            f"restart: no checkpoint to restore, the run started over from step 0; it had "
            f"reached step {resume.failed_at}: {plural(resume.lost_steps, 'step')} of work "
            f"lost and redone"
        )
    whole = summary._restart_record(summary.records, resume.index)
    took = (
        ""
        if whole is None
        else f"; first step {num(whole.get('seconds'), '.1f', unknown='?')} s after "
        f"{whole.get('since', 'process start')}"
    )
    parts = ", ".join(
        f"{name} {r[key]:.2f}"
        for name, key in (
            ("read", "read_s"),
            ("verify", "verify_s"),
            ("decode", "decode_s"),
            ("load", "load_s"),
        )
        if isinstance(r.get(key), (int, float)) and r[key] > 0
    )
    restored = (
        f"restored step {r['step']} in {num(r.get('seconds'), '.2f', unknown='?')} s"
        f"{f' ({parts} s)' if parts else ''}{took}"
    )
    if not resume.failure:
        return f"resume: {restored}; the run had ended at that step: no work lost"
    if not resume.exact:
        return (
            f"restart: {restored}; the run had reached step {resume.failed_at} or further (the "
            f"records of its last seconds were not written before it stopped; an object "
            f"store's are put every {TELEMETRY_PUT_GAP_S:.0f}-{TELEMETRY_PUT_DELAY_S:.0f} s): "
            f"at least {plural(resume.lost_steps, 'step')} of work lost and redone, the exact "
            f"number unknown"
        )
    return (
        f"restart: {restored}; the run had reached step {resume.failed_at}: "
        f"{plural(resume.lost_steps, 'step')} of work lost and redone"
    )
