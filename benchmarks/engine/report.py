"""The engine benchmark's Markdown tables, from its results (a run's or a saved JSON file's)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks._lib.timing import fmt_s, human, stats
from benchmarks.engine.measure import DISTURBED


def _load(u: str) -> str:
    return u.split("load average: ")[-1]


def _nd(rs: list[dict[str, Any]]) -> str:
    """Samples, and how many of them other processes disturbed (>= DISTURBED cores)."""
    return f"{len(rs)} ({sum(r.get('others_cores', 0) >= DISTURBED for r in rs)})"


def report(res: dict[str, Any]) -> str:
    L: list[str] = []
    m = res["machine"]
    L.append(
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']:.1f} GiB RAM, torch "
        f"{m['torch']}, "
        f"python {m['python']}, disk {m['disk']}"
    )
    L.append(
        f"Command: `{res['command']}` (started {res['started']}, took {res['seconds'] / 60:.1f} "
        "min, "
        f"of which {res.get('idle_waited_s', 0) / 60:.1f} min waiting for idle cores)"
    )
    L.append("")
    for cell in res["cells"]:
        st = cell["state"]
        L.append(
            f"### State {human(st['bytes'])}: {st['tensors']} tensors, {st['params'] / 1e6:.1f} M "
            "params "
            f"(d={st['d_model']}, {st['layers']} layers, vocab {st['vocab']}); {cell['reps']} "
            "reps; "
            f"load before/after: `{_load(cell['uptime_before'])}` / `{_load(cell['uptime_after'])}`"
        )
        L.append("")
        saves = cell["saves"]
        L.append(
            "| method | first save stall s | steady stall s, median (min-max) | stall / copy | "
            "time to durable s | durable MB/s | compute s | samples (disturbed) |"
        )
        L.append("|---|---|---|---|---|---|---|---|")
        copy_med = stats([r["stall_s"] for r in saves["copy"]["reps"]]).get("median")
        for name, v in saves.items():
            reps = v["reps"]
            stall = stats([r["stall_s"] for r in reps if "stall_s" in r])
            dur = stats([r["durable_s"] for r in reps if "durable_s" in r])
            mbs = stats([r["bytes"] / r["durable_s"] / 1e6 for r in reps if "durable_s" in r])
            comp = stats([r["compute_s"] for r in reps if "compute_s" in r])
            first = v["first"].get("stall_s") if v.get("first") else None
            ratio = f"{stall['median'] / copy_med:.2f}x" if stall and copy_med else ""
            label = f"{name} (matmuls only)" if name.startswith("compute") else name
            L.append(
                f"| {label} | {'' if first is None else f'{first:.3f}'} | "
                f"{fmt_s(stall) if stall else ''} | "
                f"{ratio} | {fmt_s(dur) if dur else ''} | {fmt_s(mbs, digits=0) if mbs else ''} | "
                f"{fmt_s(comp) if comp else ''} | {_nd(reps)} |"
            )
        for name in ("coci_block", "coci_nb"):
            reps = saves.get(name, {}).get("reps", [])
            if reps:
                L.append("")
                extra = ""
                if name == "coci_nb":
                    extra = (
                        f", save() call {fmt_s(stats([r['save_call_s'] for r in reps]))}, "
                        f"before_update {fmt_s(stats([r['before_update_s'] for r in reps]))}"
                    )
                L.append(
                    f"{name}: engine copy_s {fmt_s(stats([r['copy_s'] for r in reps]))}, "
                    "persist_s (crc+write+fsync+commit) "
                    f"{fmt_s(stats([r['persist_s'] for r in reps]))}, "
                    f"wait() returned after {fmt_s(stats([r['waited_s'] for r in reps]))}, "
                    f"engine stall_s {fmt_s(stats([r['engine_stall_s'] for r in reps]))}" + extra
                )
        raw = saves.get("raw_direct", {}).get("reps", [])
        if raw and "unlink_s" in raw[0]:
            L.append("")
            L.append(f"unlink of the raw file: {fmt_s(stats([r['unlink_s'] for r in raw]))} s")
        L.append("")
        rs = cell.get("restores", {})
        if rs:
            L.append(
                "| restore | cold s | cold MB/s | warm (page cache) s | warm MB/s | samples "
                "(disturbed) |"
            )
            L.append("|---|---|---|---|---|---|")
            for name, v in rs.items():
                c, w = v["cold"], v["warm"]
                L.append(
                    f"| {name} | {fmt_s(stats([r['seconds'] for r in c]))} | "
                    f"{fmt_s(stats([r['bytes'] / r['seconds'] / 1e6 for r in c]), digits=0)} | "
                    f"{fmt_s(stats([r['seconds'] for r in w]))} | "
                    f"{fmt_s(stats([r['bytes'] / r['seconds'] / 1e6 for r in w]), digits=0)} | "
                    f"{_nd(c + w)} |"
                )
            L.append("")
    tr = res.get("training")
    if tr:
        md = tr["model"]
        L.append(
            f"### Training loop: MLP {md['layers']}xLinear({md['width']}), "
            f"{md['params'] / 1e6:.1f} M params, "
            f"Adam, batch {md['batch']}, state {human(tr.get('state_bytes', 0))}; {tr['rounds']} "
            "rounds x "
            f"{tr['steps_per_block']} steps per method, saves after steps {tr['save_at']} of each "
            "block; "
            f"load before/after `{_load(tr['uptime_before'])}` / `{_load(tr['uptime_after'])}`"
        )
        L.append("")
        L.append(
            "| method | mean step s | median step s | mean save-step s | overhead (mean) | "
            "overhead per round, median (min-max) | save call s, median | first save step s | "
            "rounds (disturbed) |"
        )
        L.append("|---|---|---|---|---|---|---|---|---|")
        base = tr["methods"]["none"]["rounds"]
        base_mean = statistics.fmean(t for r in base for t in r["step_s"])
        base_round = {r["round"]: statistics.fmean(r["step_s"]) for r in base}
        for name, v in tr["methods"].items():
            rounds = v["rounds"]
            steps = [t for r in rounds for t in r["step_s"]]
            ssteps = [
                t for r in rounds for t, s in zip(r["step_s"], r["save_step"], strict=True) if s
            ]
            calls = [c for r in rounds for c in r["save_call_s"]]
            prs = stats(
                [(statistics.fmean(r["step_s"]) / base_round[r["round"]] - 1) * 100 for r in rounds]
            )
            w = v["warmup"]
            first = [t for t, s in zip(w["step_s"], w["save_step"], strict=True) if s]
            L.append(
                f"| {name} | {statistics.fmean(steps):.3f} | {statistics.median(steps):.3f} | "
                f"{statistics.fmean(ssteps):.3f} | "
                f"{(statistics.fmean(steps) / base_mean - 1) * 100:+.1f}% | "
                f"{prs['median']:+.1f}% ({prs['min']:+.1f} to {prs['max']:+.1f}) | "
                f"{statistics.median(calls) if calls else 0:.3f} | {first[0] if first else 0:.3f} "
                f"| {_nd(rounds)} |"
            )
        L.append("")
    return "\n".join(L)
