"""``coci report DIR``: what a run's checkpoints cost and how they compare with the plan (DIR
a path or an fsspec URL)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coci_core.storage import is_url, open_storage
from coci_core.telemetry import TELEMETRY_FILE, read_jsonl

__all__ = [
    "Restart",
    "RunSummary",
    "compare_policies",
    "facts",
    "render_facts",
    "render",
    "render_policies",
    "summarize",
]


@dataclass(frozen=True)
class Restart:
    """A restore that followed a failure: the run went back from ``failed_at`` (the last step
    recorded before it) to ``restored``; the steps between were trained twice.

    ``index`` is the restore record's position in the records."""

    index: int
    restored: int
    failed_at: int

    @property
    def lost_steps(self) -> int:
        return max(0, self.failed_at - self.restored)


#: The records that say the run reached their step.
STEP_RECORDS = ("loss", "plan", "save", "progress")


class RunSummary:
    """The facts ``coci report`` prints, gathered from a checkpoint directory's telemetry."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.saves = [r for r in records if r.get("type") == "save"]
        self.plans = [r for r in records if r.get("type") == "plan"]
        self.restores = [r for r in records if r.get("type") == "restore"]
        self.uploads = [r for r in records if r.get("type") == "upload"]
        self.losses = [r for r in records if r.get("type") == "loss"]
        self.committed = [s for s in self.saves if s.get("outcome") == "committed"]
        self.planned = sorted({int(s) for p in self.plans for s in p.get("next_steps", [])})
        self.restarts = self._restarts(records)
        #: per restart, its whole restart record (process start to first step), if written
        self.restart_records = [self._restart_record(records, r.index) for r in self.restarts]
        self.lost_steps = [r.lost_steps for r in self.restarts]
        steps = [int(r["step"]) for r in records if isinstance(r.get("step"), int)]
        self.last_step = max(steps, default=0)

    @staticmethod
    def _restarts(records: list[dict[str, Any]]) -> list[Restart]:
        # Steps recorded after the newest checkpoint and before a restore were trained twice.
        restarts: list[Restart] = []
        last: int | None = None
        for i, r in enumerate(records):
            if r.get("type") in STEP_RECORDS:
                last = r["step"] if last is None else max(last, r["step"])
            elif r.get("type") == "restore":
                failed_at = r["step"] if last is None else max(last, r["step"])
                restarts.append(Restart(i, int(r["step"]), int(failed_at)))
                last = r["step"]
        return restarts

    @staticmethod
    def _restart_record(records: list[dict[str, Any]], index: int) -> dict[str, Any] | None:
        for r in records[index + 1 :]:
            if r.get("type") == "restore":
                return None
            if r.get("type") == "restart":
                return r
        return None

    @property
    def last_plan(self) -> dict[str, Any] | None:
        return self.plans[-1] if self.plans else None


def summarize(directory: str | Path, storage_options: dict[str, Any] | None = None) -> RunSummary:
    """Read ``DIR/telemetry.jsonl``, or for an fsspec URL every session's object under
    ``DIR/telemetry/`` (written by the Lightning and Accelerate adapters)."""
    if is_url(directory):
        from coci_core.telemetry.objects import TELEMETRY_DIR, read_objects

        records = read_objects(open_storage(directory, **(storage_options or {})))
        if records is None:
            raise FileNotFoundError(
                f"no telemetry in {directory}/{TELEMETRY_DIR}/: a run writes it there when "
                f"this URL is its checkpoint directory (a remote tier's run keeps it with its "
                f"local directory, in {TELEMETRY_FILE})"
            )
        return RunSummary(records)
    path = Path(directory) / TELEMETRY_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {TELEMETRY_FILE} in {directory}: was it written by an adapter?"
        )
    return RunSummary(read_jsonl(path))


def compare_policies(
    summary: RunSummary, total_steps: int, policies: tuple[str, ...] = ("coci", "daly", "checkfreq")
) -> list[dict[str, Any]]:
    """Each policy's expected overhead for this run, from the last plan's measured costs and
    the observed losses (rows with ``policy``, ``checkpoints``, ``wall_s``, ``objective_s``)."""
    from coci_core.errors import ConfigError
    from coci_core.planner import plan_schedule

    plan = summary.last_plan
    if plan is None or plan.get("mtbf_s") is None:
        return []
    costs = plan["costs"]
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
                objective=plan["objective"],
                policy=policy,
            )
        except ConfigError:
            continue
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


def facts(summary: RunSummary, total_steps: int | None = None) -> dict[str, Any]:
    """The run's headline numbers, as ``coci report`` prints them and the TensorBoard tab shows
    them: checkpoints planned, committed, skipped and failed, the total stall (s), restarts and
    the steps of work they lost, and each policy's expected overhead (:func:`compare_policies`)
    over ``total_steps`` (default: the last step recorded)."""
    total = total_steps if total_steps is not None else summary.last_step
    stalls = [s.get("stall_s") for s in summary.saves]
    return {
        "planned": len(summary.planned),
        "committed": len(summary.committed),
        "skipped": sum(1 for s in summary.saves if s.get("outcome") == "skipped"),
        "failed": sum(1 for s in summary.saves if s.get("outcome") == "failed"),
        "total_stall_s": sum(float(v) for v in stalls if isinstance(v, (int, float))),
        "restarts": len(summary.restarts),
        "lost_steps": sum(summary.lost_steps),
        "steps": total,
        "policies": compare_policies(summary, total) if total > 0 else [],
        "termination": termination_effect(summary),
    }


def _float(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def termination_effect(summary: RunSummary) -> dict[str, float] | None:
    """How much the termination hazard changed the last plan (by its objective): the plan's
    expected overhead, the same for the plan made without the hazard, Daly's, and the share of
    the plan's gain over Daly that the hazard brings; None without a termination model."""
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

    return {
        "objective_s": objective_s,
        "without_objective_s": without_s,
        "daly_objective_s": daly_s,
        "share_of_gain": termination_share(objective_s, without_s, daly_s),
    }


def render_facts(f: dict[str, Any]) -> list[str]:
    """:func:`facts` as lines of text."""
    lines = [
        f"total stall {f['total_stall_s']:.3f} s over {f['committed'] + f['failed']} saves; "
        f"lost work: {f['lost_steps']} steps over {f['restarts']} restarts",
        "",
        f"expected overhead of each policy over the run's {f['steps']} steps, from the "
        "measured costs:",
        render_policies(f["policies"]),
    ]
    t = f.get("termination")
    if t:
        lines.append(
            f"termination hazard: the plan's expected overhead {t['objective_s']:.2f} s by its "
            f"objective, {t['without_objective_s']:.2f} s for the plan made without it: "
            f"{t['share_of_gain']:.0%} of its gain over Daly ({t['daly_objective_s']:.2f} s)"
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


def _num(value: Any, spec: str, scale: float = 1.0, unknown: str = "-") -> str:
    """``value * scale`` formatted by ``spec``; ``unknown`` for a missing (None) value, which
    telemetry writes for a non-finite or not yet measured one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return unknown
    return format(value * scale, spec)


def render(
    summary: RunSummary, *, tensorboard_dir: str | None = None, with_overhead: bool = True
) -> str:
    """The report as text (``with_overhead=False``: without the plan's expected overhead, for
    a caller that states each policy's overhead itself)."""
    lines = []
    actual = [s["step"] for s in summary.committed]
    lines.append(f"checkpoints committed: {len(actual)} at steps {actual}")
    planned_ahead = [s for s in summary.planned if not actual or s > actual[-1]]
    lines.append(
        f"planned checkpoint steps seen: {len(summary.planned)}; still ahead: {planned_ahead[:10]}"
    )
    skipped = [s["step"] for s in summary.saves if s.get("outcome") == "skipped"]
    failed = [s["step"] for s in summary.saves if s.get("outcome") == "failed"]
    if skipped or failed:
        lines.append(f"skipped saves: {skipped}; failed saves: {failed}")
    lines.append("")
    lines.append(f"{'step':>8} {'stall ms':>10} {'persist ms':>11} {'durable ms':>11} {'MB':>9}")
    for s in summary.committed:
        lines.append(
            f"{s['step']:>8} {_num(s.get('stall_s'), '.2f', 1e3):>10} "
            f"{_num(s.get('persist_s'), '.2f', 1e3):>11} "
            f"{_num(s.get('time_to_durable_s'), '.2f', 1e3):>11} "
            f"{_num(s.get('bytes_written'), '.2f', 1e-6):>9}"
        )
    lines.append(
        f"median stall {_ms([s.get('stall_s') for s in summary.committed])}, "
        f"median persist {_ms([s.get('persist_s') for s in summary.committed])}"
    )
    if summary.uploads:
        lines.append(_uploads_line(summary.uploads))
    for r, lost, whole in zip(
        summary.restores, summary.lost_steps, summary.restart_records, strict=False
    ):
        took = (
            ""
            if whole is None
            else f"; first step {_num(whole.get('seconds'), '.1f', unknown='?')} s after "
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
        lines.append(
            f"restart: restored step {r['step']} in {_num(r.get('seconds'), '.2f', unknown='?')}"
            f" s{f' ({parts} s)' if parts else ''}{took}; about {lost} steps of work were lost "
            "and redone"
        )
    plan = summary.last_plan
    if plan is not None:
        lines.append("")
        interval = plan.get("interval_steps")
        mtbf = _num(plan.get("mtbf_s"), ".0f", unknown="")
        source = plan.get("mtbf_source")
        lines.append(
            f"plan: policy {plan.get('policy') or '?'}, objective "
            f"{plan.get('objective') or '?'}, "
            + (f"interval {interval} steps, " if interval is not None else "no interval yet, ")
            + (f"MTBF {mtbf} s" if mtbf else "MTBF unknown")
            + (f" ({source})" if source else "")
        )
        overhead = plan.get("expected_overhead") if with_overhead else None
        if overhead:

            def cost(key: str) -> str:
                return _num(overhead.get(key), ".1f", unknown="?")

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


def _uploads_line(uploads: list[dict[str, Any]]) -> str:
    """The remote tier in one line: steps uploaded, the newest, failed attempts."""
    done = [u for u in uploads if u.get("outcome") == "committed"]
    failed = [u for u in uploads if u.get("outcome") == "failed"]
    line = f"remote tier: {len(done)} checkpoints uploaded"
    if done:
        median = statistics.median(float(u.get("seconds", 0.0)) for u in done)
        line += f", newest step {done[-1]['step']} (median {_num(median, '.2f')} s each)"
    if failed:
        last = failed[-1]
        line += f"; {len(failed)} failed attempts, the last at step {last['step']}: "
        line += str(last.get("error") or "?")
        if not done or done[-1]["step"] < last["step"]:
            line += " (not uploaded since)"
    return line
