"""A real Optuna study under injected failures: the fault-tolerance cost of each save policy.

Run:  python -m benchmarks.hpo_bench [--trials 30] [--seeds 0 1 2] [--pruner median|sha]
      [--state-mb N] [--mtbf-share 0.1] [--policies ...] [--no-final-when-pruned]

Each seed runs the same study once per policy: an Optuna study (random sampler, seeded; a
median or successive-halving pruner) of ``--trials`` trials, each training the digits CNN on
CPU in a process of its own (forked from this one), reporting the validation loss after every
epoch to the study (this process holds the in-memory study and answers ``should_prune`` for
the trial). Failures are SIGKILLs at exponential times on the study's busy clock (the time
trial processes run), MTBF ``--mtbf-share`` of the length of a study of unpruned trials with no
checkpoints and no failures (measured: one trial's busy time here x ``--trials``), drawn from the
seed: the same failure times for every policy. A killed trial is started again at once and
resumes from its newest checkpoint; one killed after the study pruned it is done.

Each seed also runs the study with no checkpoints and no failures: the reference of the measured
overhead (busy time over it) and of the trials' outcomes, which every policy must reproduce.

Policies (``coci_core.training.Checkpointer`` in the trial's loop, objective "time", the true
MTBF given to all): ``coci+term`` (coci's plan with the trial's termination model from the
study, re-estimated at each report; a pruned trial takes no final save), ``coci`` (no
termination model; the final save at the stop, as the adapters took before), ``daly``,
``checkfreq`` and ``epoch`` (every epoch), all with the final save (``--no-final-when-pruned``:
none when pruned, so that only the plans differ).

``--state-mb N`` adds N MB of extra state (a tensor saved beside the model and optimizer, as
a large model's would be) to every trial's checkpoints, so that a save costs real stall.

Cost per study (seconds): stall (the saves' measured stalls), lost work (the wall time from the
newest durable checkpoint's state to each kill), restart (from each kill to the resumed trial's
first step); and the study's best value, which is the same for every policy when resumes are
exact and the study's decisions do not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import torch
from tests.harness.digits import DigitsCNN, digits_images

from benchmarks._lib.results import log, run_recorded
from coci_core.hpo.optuna import STEP_ATTR, per_epoch, study_termination
from coci_core.planner import Termination
from coci_core.training import Checkpointer

POLICIES = ("coci+term", "coci", "daly", "checkfreq", "epoch")
#: the reference of each seed: the same study with no checkpoints and no failures
BASELINE = "none"
EPOCHS = 8
BATCH = 64
TRAIN = 1280  # 20 steps per epoch
STEPS_PER_EPOCH = TRAIN // BATCH
TOTAL = EPOCHS * STEPS_PER_EPOCH
WIDTH = 16

_DATA: dict[str, torch.Tensor] = {}


def _data() -> dict[str, torch.Tensor]:
    if not _DATA:
        x, y = digits_images()
        _DATA.update(x=x[:TRAIN], y=y[:TRAIN], vx=x[1400:], vy=y[1400:])
    return _DATA


# --------------------------------------------------------------------------- the trial process


@dataclass
class TrialSpec:
    """What a trial process needs (pickled into the fork)."""

    number: int
    lr: float
    momentum: float
    policy: str
    directory: str
    events: str
    mtbf_s: float
    termination: Termination | None
    stall_s: float = 0.01
    state_mb: int = 0
    final_when_pruned: bool = True  # other policies than coci+term: a final save when pruned


def _model(spec: TrialSpec) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1000 + spec.number)
    model = DigitsCNN(WIDTH)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    return model, opt


def _extra_state(spec: TrialSpec) -> torch.Tensor | None:
    """``spec.state_mb`` MB of float32 values (None for 0), seeded per trial."""
    if spec.state_mb <= 0:
        return None
    g = torch.Generator().manual_seed(spec.number)
    return torch.rand(spec.state_mb * 2**18, generator=g)


def _batch(step: int, number: int) -> torch.Tensor:
    """The indices of training step ``step`` (1-based): a seeded permutation per epoch, so a
    resumed trial sees exactly the batches it would have."""
    epoch, i = divmod(step - 1, STEPS_PER_EPOCH)
    g = torch.Generator().manual_seed(number * 1000 + epoch)
    return torch.randperm(TRAIN, generator=g)[i * BATCH : (i + 1) * BATCH]


def _validate(model: torch.nn.Module) -> float:
    d = _data()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(d["vx"]), d["vy"]))


def trial_process(spec: TrialSpec, conn: multiprocessing.connection.Connection) -> None:
    """Train one trial (from its newest checkpoint if any), reporting each epoch to the parent
    over ``conn``; write step and save events to ``spec.events``."""
    torch.set_num_threads(1)
    events = open(spec.events, "a", buffering=1)  # noqa: SIM115 (kept open until killed)

    def write(**fields: Any) -> None:
        events.write(json.dumps(fields) + "\n")

    def on_event(event: Any) -> None:
        if getattr(event, "outcome", None) == "committed" and hasattr(event, "stall_s"):
            write(committed=event.step, stall=event.stall_s, t=time.time())

    d = _data()
    model, opt = _model(spec)
    extra = _extra_state(spec)
    name = "coci" if spec.policy == "coci+term" else spec.policy
    # every planner starts from the stall measured once here (a new trial's planner has not
    # measured one yet; the default assumes a large model's and plans almost no save)
    options: dict[str, Any] = {"total_steps": TOTAL, "default_stall_s": spec.stall_s}
    if name == "epoch":
        options["steps_per_epoch"] = STEPS_PER_EPOCH
    if spec.policy == "coci+term" and spec.termination is not None:
        options["termination"] = spec.termination
    if spec.policy == BASELINE:
        _train_without_checkpoints(spec, conn, model, opt, extra)
        return
    ckpt = Checkpointer(
        spec.directory,
        policy=name,
        objective="time",
        mtbf_s=spec.mtbf_s,
        keep_last=2,
        compression="none",
        planner_options=options,
        listeners=[on_event],
    )
    start = 0
    if ckpt.latest_step() is not None:
        state = ckpt.restore(into={"model": model, "optim": opt})
        ckpt.load_state_dict(state.get("coci", {}))
        start = int(ckpt.resumed_from or 0)
        if extra is not None:
            extra = state["extra"]
    write(ready=start, t=time.time())
    conn.send(("ready",))

    def state() -> dict[str, Any]:
        out = {"model": model.state_dict(), "optim": opt.state_dict(), "coci": ckpt.state_dict()}
        if extra is not None:
            out["extra"] = extra
        return out

    def final(step: int, final_save: bool) -> None:
        if final_save and ckpt.resumed_from != step and step > start:
            write(final=step)
            ckpt.save(step, state(), block=True).wait()
        ckpt.close()

    for k in range(start + 1, TOTAL + 1):
        t = time.perf_counter()
        idx = _batch(k, spec.number)
        loss = torch.nn.functional.cross_entropy(model(d["x"][idx]), d["y"][idx])
        loss.backward()
        ckpt.before_update()
        opt.step()
        opt.zero_grad()
        t_plan = time.perf_counter()
        ckpt.observe(k, loss=float(loss.detach()), step_time_s=t_plan - t)
        planning = time.perf_counter() - t_plan
        if k % STEPS_PER_EPOCH == 0:
            value = _validate(model)
            conn.send(("report", k // STEPS_PER_EPOCH - 1, value, k))
            prune, termination = conn.recv()
            if termination is not None and spec.policy == "coci+term":
                t_plan = time.perf_counter()
                ckpt.planner.set_termination(termination)
                planning += time.perf_counter() - t_plan
            if prune:
                final(k, final_save=spec.policy != "coci+term" and spec.final_when_pruned)
                conn.send(("pruned",))
                return
        t_plan = time.perf_counter()
        save = ckpt.should_save(k)
        write(step=k, t=time.time(), planning=planning + time.perf_counter() - t_plan)
        if save:
            ckpt.save(k, state())
    value = _validate(model)  # also when it resumed from its last step
    final(TOTAL, final_save=True)
    conn.send(("done", value))


def _train_without_checkpoints(
    spec: TrialSpec,
    conn: multiprocessing.connection.Connection,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    extra: torch.Tensor | None,
) -> None:
    """The trial's loop with no checkpointing at all (the baseline of the measured overhead);
    ``extra`` is made as in the other policies, so that the process costs the same to start."""
    d = _data()
    conn.send(("ready",))
    for k in range(1, TOTAL + 1):
        idx = _batch(k, spec.number)
        loss = torch.nn.functional.cross_entropy(model(d["x"][idx]), d["y"][idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if k % STEPS_PER_EPOCH == 0:
            conn.send(("report", k // STEPS_PER_EPOCH - 1, _validate(model), k))
            prune, _ = conn.recv()
            if prune:
                conn.send(("pruned",))
                return
    del extra
    conn.send(("done", _validate(model)))


# --------------------------------------------------------------------------- the study driver


@dataclass
class Costs:
    """One study's fault-tolerance cost (seconds) and outcome."""

    stall_s: float = 0.0
    final_stall_s: float = 0.0
    planning_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    kills: int = 0
    saves: int = 0
    busy_s: float = 0.0
    best_value: float = math.nan
    pruned: int = 0
    values: list[float] = field(default_factory=list)
    #: per trial: its state ("pruned", "complete") and the value of each report (by epoch)
    outcomes: dict[int, tuple[str, list[float]]] = field(default_factory=dict)
    #: reports that a resumed trial made again with a value other than its first one
    #: (trial, epoch, first, again): a resume that was not exact
    mismatches: list[tuple[int, int, float, float]] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.stall_s + self.planning_s + self.lost_s + self.restart_s


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    return out


class FailureClock:
    """Failures at exponential times on the study's busy clock (seeded)."""

    def __init__(self, mtbf_s: float, seed: int) -> None:
        self.rng = np.random.default_rng([seed, 19])
        self.mtbf_s = mtbf_s
        self.next = float(self.rng.exponential(mtbf_s)) if math.isfinite(mtbf_s) else math.inf

    def advance(self) -> None:
        self.next += float(self.rng.exponential(self.mtbf_s))


def _termination(study: optuna.Study, trial: optuna.trial.BaseTrial) -> Termination:
    return study_termination(
        study,
        trial=trial,
        train_step_of=per_epoch(STEPS_PER_EPOCH),
        min_trials=3,
        max_report_step=EPOCHS - 1,
    )


def run_trial(
    study: optuna.Study,
    trial: optuna.Trial,
    policy: str,
    root: Path,
    clock: FailureClock,
    costs: Costs,
    mtbf_s: float,
    stall_s: float = 0.01,
    state_mb: int = 0,
    final_when_pruned: bool = True,
) -> None:
    """Run one trial to its end (completed or pruned), through any number of kills."""
    ctx = mp.get_context("fork")
    directory = root / f"trial-{trial.number}"
    events = root / f"trial-{trial.number}.jsonl"
    lr = trial.suggest_float("lr", 1e-3, 0.5, log=True)
    momentum = trial.suggest_float("momentum", 0.0, 0.95)
    killed_at: float | None = None
    decided: dict[int, bool] = {}
    reported: dict[int, float] = {}
    pruned_at: float | None = None  # when the study's answer to prune was sent
    while True:
        spec = TrialSpec(
            trial.number,
            lr,
            momentum,
            policy,
            str(directory),
            str(events),
            mtbf_s,
            _termination(study, trial) if policy == "coci+term" else None,
            stall_s,
            state_mb,
            final_when_pruned,
        )
        parent, child = ctx.Pipe()
        launched = time.time()
        proc = ctx.Process(target=trial_process, args=(spec, child), daemon=True)
        proc.start()
        child.close()
        outcome: tuple[Any, ...] | None = None
        kill_time: float | None = None
        while outcome is None:
            remaining = clock.next - (costs.busy_s + time.time() - launched)
            if remaining <= 0:
                os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
                kill_time = time.time()
                break
            if not parent.poll(None if math.isinf(remaining) else remaining):
                continue
            try:
                msg = parent.recv()
            except EOFError:
                raise RuntimeError(f"trial {trial.number} died (exit {proc.exitcode})") from None
            if msg[0] == "ready" and killed_at is not None:
                ready = [e for e in _read_events(events) if "ready" in e]
                costs.restart_s += ready[-1]["t"] - killed_at
                killed_at = None
            elif msg[0] == "report":
                _, epoch, value, step = msg
                # a resumed trial reports its epoch again: the study's answer stands (a
                # successive-halving pruner asked twice at a rung moves on to the next rung)
                if epoch not in decided:
                    trial.set_user_attr(STEP_ATTR, int(step))
                    trial.report(value, epoch)
                    decided[epoch] = trial.should_prune()
                    reported[epoch] = value
                elif value != reported[epoch]:
                    costs.mismatches.append((trial.number, epoch, reported[epoch], value))
                prune = decided[epoch]
                if prune:
                    pruned_at = time.time()
                term = _termination(study, trial) if policy == "coci+term" else None
                parent.send((prune, term))
            elif msg[0] in ("pruned", "done"):
                outcome = msg
        proc.join()
        parent.close()
        costs.busy_s += (kill_time or time.time()) - launched
        if kill_time is None:
            assert outcome is not None
            values = [reported[e] for e in sorted(reported)]
            if outcome[0] == "pruned":
                costs.pruned += 1
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                costs.outcomes[trial.number] = ("pruned", values)
            else:
                costs.values.append(float(outcome[1]))
                study.tell(trial, float(outcome[1]))
                costs.outcomes[trial.number] = ("complete", [*values, float(outcome[1])])
            break
        # killed: the work since the newest durable checkpoint is lost
        costs.kills += 1
        pruned_before = any(decided.values())
        clock.advance()
        log_ = _read_events(events)
        mine = [i for i, e in enumerate(log_) if "ready" in e and e["t"] >= launched]
        if not mine:  # killed before it was ready: its start was restart time too
            if killed_at is None:
                costs.restart_s += kill_time - launched
                killed_at = kill_time
            continue
        ready = log_[mine[0]]
        durable = max((e["committed"] for e in log_ if "committed" in e), default=0)
        reached = ready["t"]
        if durable > ready["ready"]:
            reached = next(
                (e["t"] for e in log_[mine[0] :] if e.get("step") == durable), ready["t"]
            )
        if pruned_before:
            # killed after the study pruned it, in its final save: the trial is done (nothing
            # to redo; a process resumed from that final save would not report the pruned
            # epoch again). The time since the answer was the final save's.
            cut = kill_time - (pruned_at or kill_time)
            costs.stall_s += cut
            costs.final_stall_s += cut
            costs.pruned += 1
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            costs.outcomes[trial.number] = ("pruned", [reported[e] for e in sorted(reported)])
            break
        costs.lost_s += max(0.0, kill_time - reached)
        killed_at = kill_time
    entries = _read_events(events)
    finals = {e["final"] for e in entries if "final" in e}
    for e in entries:
        if "committed" in e:
            costs.saves += 1
            costs.stall_s += e["stall"]
            if e["committed"] in finals:
                costs.final_stall_s += e["stall"]
        if "planning" in e:
            costs.planning_s += e["planning"]
    shutil.rmtree(directory, ignore_errors=True)


def run_study(
    policy: str, seed: int, args: argparse.Namespace, root: Path, mtbf_s: float, stall_s: float
) -> Costs:
    """One study under one policy; the failures and the sampler come from ``seed``."""
    pruner: optuna.pruners.BasePruner = (
        optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1)
        if args.pruner == "median"
        else optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    )
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=seed), pruner=pruner, study_name="digits"
    )
    clock = FailureClock(math.inf if policy == BASELINE else mtbf_s, seed)
    costs = Costs()
    work = root / f"{policy}-{seed}"
    work.mkdir(parents=True)
    for _ in range(args.trials):
        trial = study.ask()
        run_trial(
            study,
            trial,
            policy,
            work,
            clock,
            costs,
            mtbf_s,
            stall_s,
            args.state_mb,
            not getattr(args, "no_final_when_pruned", False),
        )
    costs.best_value = study.best_value
    # the final saves' stalls are part of the saves' stalls (committed events)
    return costs


def warm_up() -> None:
    """Import here, before any fork, what torch imports lazily on the first optimizer and
    backward (seconds of imports): a restarted trial is a fork of a warm process."""
    spec = TrialSpec(0, 0.05, 0.9, "epoch", "", "", 1.0, None)
    model, opt = _model(spec)
    d = _data()
    idx = _batch(1, 0)
    torch.nn.functional.cross_entropy(model(d["x"][idx]), d["y"][idx]).backward()
    opt.step()
    opt.zero_grad()
    _validate(model)


def calibrate(root: Path, state_mb: int = 0) -> tuple[float, float]:
    """The busy time of one unpruned trial here with no checkpoints and no failures (the unit
    of the MTBF), and the median stall of a save (saving every epoch), in seconds, with
    ``state_mb`` MB of extra state."""
    busy, stalls = 0.0, []
    for policy in (BASELINE, "epoch"):
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        study.enqueue_trial({"lr": 0.05, "momentum": 0.9})
        costs = Costs()
        work = root / f"calibration-{policy}"
        work.mkdir(parents=True)
        clock = FailureClock(math.inf, 0)
        run_trial(study, study.ask(), policy, work, clock, costs, 3600.0, state_mb=state_mb)
        if policy == BASELINE:
            busy = costs.busy_s
        else:
            stalls = [e["stall"] for e in _read_events(work / "trial-0.jsonl") if "committed" in e]
    return busy, statistics.median(stalls)


def _spread(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.1f}" if xs else "-"
    return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"


def paired_table(res: dict[str, Any]) -> str:
    """Each policy against Daly and CheckFreq seed by seed (the same trials and failure times),
    in percent: mean ± standard deviation over the seeds, for the total cost, the total without
    the final saves' stalls (the plan's part), the part a policy steers (stall + lost work) and
    the measured overhead."""
    runs = res["runs"]
    by = {(r["policy"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    metrics = {
        "total": lambda r: r["total_s"],
        "total but final saves": lambda r: r["total_s"] - r["final_stall_s"],
        "stall + lost work": lambda r: r["stall_s"] + r["lost_s"],
        "measured overhead": lambda r: r.get("overhead_s", math.nan),
    }
    refs = [q for q in ("daly", "checkfreq") if q in res["policies"]]
    head = " | ".join(f"{m} vs {q}" for q in refs for m in metrics)
    rows = [f"| policy | {head} |", "|---" * (1 + len(refs) * len(metrics)) + "|"]
    for p in res["policies"]:
        cells = []
        for q in refs:
            for f in metrics.values():
                xs = [
                    100 * (f(by[p, s]) / f(by[q, s]) - 1)
                    for s in seeds
                    if (p, s) in by and (q, s) in by and f(by[q, s]) > 0
                ]
                if len(xs) >= 2:
                    cells.append(f"{statistics.mean(xs):+.0f} ± {statistics.stdev(xs):.0f}%")
                else:
                    cells.append(f"{xs[0]:+.0f}%" if xs else "-")
        rows.append(f"| {p} | {' | '.join(cells)} |")
    return "\n".join(rows)


def table(res: dict[str, Any]) -> str:
    """The results as a markdown table (mean ± standard deviation over the seeds)."""
    rows = [
        "| policy | total cost (s) | stall (s) | of it final saves (s) | planning (s) | "
        "lost work (s) | restart (s) | kills | saves | best value | vs Daly | vs CheckFreq | "
        "measured overhead (s) | vs Daly | vs CheckFreq |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = res["runs"]

    def mean_of(p: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs if r["policy"] == p)

    def versus(p: str, key: str) -> dict[str, str]:
        return {
            q: f"{100 * (mean_of(p, key) / mean_of(q, key) - 1):+.0f}%"
            if q in res["policies"]
            else "-"
            for q in ("daly", "checkfreq")
        }

    for p in res["policies"]:
        rs = [r for r in runs if r["policy"] == p]
        if not rs:
            continue
        best = sorted({round(r["best_value"], 6) for r in rs})
        vs = versus(p, "total_s")
        if all("overhead_s" in r for r in runs):
            vo = versus(p, "overhead_s")
            measured = (
                f"{_spread([r['overhead_s'] for r in rs])} | {vo['daly']} | {vo['checkfreq']}"
            )
        else:
            measured = "- | - | -"
        rows.append(
            f"| {p} | {_spread([r['total_s'] for r in rs])} | "
            f"{_spread([r['stall_s'] for r in rs])} | "
            f"{_spread([r['final_stall_s'] for r in rs])} | "
            f"{_spread([r['planning_s'] for r in rs])} | "
            f"{_spread([r['lost_s'] for r in rs])} | {_spread([r['restart_s'] for r in rs])} | "
            f"{_spread([float(r['kills']) for r in rs])} | "
            f"{_spread([float(r['saves']) for r in rs])} | "
            f"{', '.join(f'{b:.4f}' for b in best)} | {vs['daly']} | {vs['checkfreq']} | "
            f"{measured} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--pruner", choices=("median", "sha"), default="median")
    ap.add_argument(
        "--mtbf-share",
        type=float,
        default=0.1,
        help="MTBF as a share of the failure-free length of a study of unpruned trials",
    )
    ap.add_argument(
        "--state-mb",
        type=int,
        default=0,
        help="MB of extra state saved in every trial's checkpoints (0: the model's only)",
    )
    ap.add_argument(
        "--no-final-when-pruned",
        action="store_true",
        help="no policy takes a final save when its trial is pruned (as coci+term): compares "
        "the plans alone",
    )
    ap.add_argument("--out-dir", default=None, help="where the result file goes")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    warm_up()

    def run(scratch: Path) -> dict[str, Any]:
        trial_s, stall_s = calibrate(scratch, args.state_mb)
        mtbf_s = args.mtbf_share * trial_s * args.trials
        log(
            f"one trial {trial_s:.2f} s (no checkpoints), a save's stall "
            f"{stall_s * 1e3:.1f} ms; MTBF {mtbf_s:.1f} s of busy time"
        )
        runs = []
        for seed in args.seeds:
            baseline = run_study(BASELINE, seed, args, scratch, mtbf_s, stall_s)
            log(f"seed {seed} {BASELINE}: busy {baseline.busy_s:.1f} s, {baseline.pruned} pruned")
            order = list(args.policies)
            rotate = seed % len(order)  # each policy leads in turn (drift, warm caches)
            for policy in order[rotate:] + order[:rotate]:
                t0 = time.perf_counter()
                c = run_study(policy, seed, args, scratch, mtbf_s, stall_s)
                overhead = c.busy_s - baseline.busy_s
                differ = sorted(
                    n for n in baseline.outcomes if c.outcomes.get(n) != baseline.outcomes[n]
                )
                if differ or c.mismatches:
                    log(
                        f"seed {seed} {policy}: trials {differ} ended otherwise than with no "
                        f"checkpoints; reports made again with other values: {c.mismatches}"
                    )
                log(
                    f"seed {seed} {policy}: total {c.total_s:.1f} s (stall {c.stall_s:.1f}, "
                    f"lost {c.lost_s:.1f}, restart {c.restart_s:.1f}), measured overhead "
                    f"{overhead:.1f} s, {c.kills} kills, {c.saves} saves, {c.pruned} pruned, "
                    f"best {c.best_value:.4f} ({time.perf_counter() - t0:.0f} s)"
                )
                runs.append(
                    {
                        "policy": policy,
                        "seed": seed,
                        "total_s": c.total_s,
                        "overhead_s": overhead,
                        "baseline_busy_s": baseline.busy_s,
                        "trials_unlike_baseline": differ,
                        **{k: v for k, v in c.__dict__.items() if k != "values"},
                    }
                )
        return {
            "trial_s": trial_s,
            "stall_s": stall_s,
            "mtbf_s": mtbf_s,
            "trials": args.trials,
            "epochs": EPOCHS,
            "steps_per_epoch": STEPS_PER_EPOCH,
            "pruner": args.pruner,
            "state_mb": args.state_mb,
            "final_when_pruned": not args.no_final_when_pruned,
            "policies": args.policies,
            "runs": runs,
        }

    res, path = run_recorded("hpo", run, out_dir=args.out_dir)
    print(table(res))
    print()
    print(paired_table(res))
    log(f"results: {path}")


if __name__ == "__main__":
    main()
