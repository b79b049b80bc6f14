"""``coci report --plot FILE.png``: the coci tab's timeline drawn with matplotlib.

The same data as the TensorBoard tab (:func:`~coci_core.telemetry.timeline.timeline`): the
observed loss and the planner's fitted curve, a lane of planned checkpoints (hollow and struck
through when a later plan dropped them), a lane of saves coloured by outcome, failures,
restarts and the lost work shaded; x is the training step.
"""

from __future__ import annotations

import os
from typing import Any

from coci_core.errors import ConfigError
from coci_core.telemetry.report_events import plural

__all__ = ["plot_timeline"]

COLORS = {
    "loss": "#1f77b4",
    "fitted": "#ff7f0e",
    "lost_loss": "#9e9e9e",
    "planned": "#6a3d9a",
    "revised": "#9e9e9e",
    "committed": "#2e7d32",
    "skipped": "#f9a825",
    "failed": "#c62828",
}


#: the colour of a preemption notice (the tab's)
NOTICE = "#ef6c00"


def plot_timeline(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw ``data`` (a timeline) to the image file ``path`` (its suffix picks the format).

    Raises:
        ConfigError: if matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from e

    fig, (ax, lanes) = plt.subplots(
        2, 1, figsize=(12, 5.2), sharex=True, gridspec_kw={"height_ratios": [3, 1.1]}
    )
    for restart in data["restarts"]:
        for a in (ax, lanes):
            a.axvspan(restart["restored"], restart["failed_at"], color="#c62828", alpha=0.13)
            a.axvline(restart["failed_at"], color="#c62828", lw=1.5)
            a.axvline(restart["restored"], color="#c62828", lw=1.5, ls="--")
        ax.annotate(
            f"lost work: {'' if restart['exact'] else 'at least '}"
            f"{plural(restart['lost_steps'], 'step')}\n"
            f"✕ failure after step {restart['failed_at']}\n"
            f"↻ restart from step {restart['restored']}",
            xy=((restart["restored"] + restart["failed_at"]) / 2, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="top",
            color="#c62828",
            fontsize=9,
        )

    for notice in data.get("preemptions", []):
        for a in (ax, lanes):
            a.axvline(notice["step"], color=NOTICE, lw=1.5, ls=":")
        if notice["save_step"] != notice["step"]:  # the save moved before a known end
            lanes.annotate(
                "",
                xy=(notice["save_step"], 1.45),
                xytext=(notice["step"], 1.45),
                arrowprops={"arrowstyle": "->", "color": NOTICE, "lw": 1.5},
            )
        decision = notice["decision"]
        ax.annotate(
            f"⚑ {notice['source']} notice: "
            + (f"saved step {notice['saved']}" if decision == "saved" else decision),
            xy=(notice["step"], 0.88),
            xycoords=("data", "axes fraction"),
            color=NOTICE,
            fontsize=9,
        )

    # the loss, one line per stretch; a stretch trained again after a restart is grey
    stretch: list[dict[str, Any]] = []
    stretches: list[list[dict[str, Any]]] = []
    for point in data["loss"]:
        if stretch and (
            point["lost"] != stretch[-1]["lost"] or point["step"] < stretch[-1]["step"]
        ):
            stretches.append(stretch)
            stretch = []
        stretch.append(point)
    if stretch:
        stretches.append(stretch)
    for part in stretches:
        points = [p for p in part if p["loss"] is not None]
        lost = bool(part[0]["lost"])
        ax.plot(
            [p["step"] for p in points],
            [p["loss"] for p in points],
            color=COLORS["lost_loss"] if lost else COLORS["loss"],
            ls="--" if lost else "-",
            lw=2,
        )
    fitted = [p for p in data["loss"] if p["fitted"] is not None and not p["lost"]]
    ax.plot(
        [p["step"] for p in fitted],
        [p["fitted"] for p in fitted],
        color=COLORS["fitted"],
        ls="--",
        lw=1.5,
    )
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)

    # lanes: planned at y=1, saves at y=0
    for p in data["planned"]:
        revised = p["state"] == "revised"
        color = COLORS["revised"] if revised else COLORS["planned"]
        lanes.plot(
            p["step"],
            1,
            marker="D",
            ms=9,
            mec=color,
            mew=2,
            mfc=color if p["state"] == "taken" else "white",
        )
        if revised:
            lanes.plot(p["step"], 1, marker="x", ms=10, color=COLORS["revised"], mew=2)
    for s in data["saves"]:
        color = COLORS.get(s["outcome"], "black")
        marker = "X" if s["outcome"] == "failed" else "o"
        lanes.plot(s["step"], 0, marker=marker, ms=10, color=color, mec="white")
    lanes.set_yticks([0, 1], ["saves", "planned"])
    lanes.set_ylim(-0.7, 1.7)
    lanes.set_xlabel("training step")
    lanes.set_xlim(left=0)
    handles = [
        Line2D([], [], color=COLORS["loss"], lw=2, label="observed loss"),
        Line2D([], [], color=COLORS["fitted"], ls="--", label="planner's fitted curve"),
        Line2D([], [], color=COLORS["planned"], marker="D", ls="", label="planned checkpoint"),
        Line2D([], [], color=COLORS["revised"], marker="D", ls="", label="planned, then revised"),
        Line2D([], [], color=COLORS["committed"], marker="o", ls="", label="save committed"),
        Line2D([], [], color=COLORS["skipped"], marker="o", ls="", label="save skipped"),
        Line2D([], [], color=COLORS["failed"], marker="X", ls="", label="save failed"),
        Patch(color="#c62828", alpha=0.13, label="lost work"),
    ]
    if data.get("preemptions"):
        handles.append(Line2D([], [], color=NOTICE, ls=":", label="preemption notice"))
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=9, frameon=False)
    f = data["summary"]
    fig.suptitle(
        f"{data['run']}: {f['planned']} checkpoints planned, {f['taken']} of them taken, "
        f"{f['committed']} committed, total stall {f['total_stall_s']:.3f} s, "
        f"{'' if f['lost_exact'] else 'at least '}{plural(f['lost_steps'], 'step')} lost over "
        f"{plural(f['restarts'], 'restart')}",
        y=0.02,
        va="bottom",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
