"""A plain training loop that acts on preemption notices, on one process or one gloo rank.

argv: a JSON object: ``dir``, ``sources`` (names, or ``{"aws": url}``), ``margin_s``,
``write_delay_s`` (a slow disk: each data file write sleeps that long), ``step_s`` (each
step's compute takes that long more), ``ready_at`` (the step
after which it takes one save, waits for it and prints ``READY``), ``telemetry`` (rank 0
records telemetry in the directory, for ``coci report``). It resumes from the newest
checkpoint (printing ``RESUMED <json>``), trains until the notice, and prints ``SAVED <json>``
(the step and a digest of the model) at every save and ``PREEMPTED <json>`` before it stops
with :class:`~coci_core.Preempted`. With RANK and WORLD_SIZE set it is one gloo rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from coci_core import LocalStorage, NoCheckpointError, Preempted
from coci_core.preemption import AwsSpotNotice, NoticeSource, Preemption
from coci_core.telemetry import JsonlTelemetry
from coci_core.training import Checkpointer
from coci_core.training.preemption import min_over_ranks


class SlowDisk(LocalStorage):
    """A disk whose data file writes take ``delay_s`` more."""

    def __init__(self, root: str, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        if path.endswith(".bin"):
            time.sleep(self.delay_s)  # the disk's speed, not a synchronisation
        return super().write_file(path, chunks, aligned=aligned)


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(
        b"".join(t.numpy().tobytes() for t in model.state_dict().values())
    ).hexdigest()


def say(mark: str, payload: dict[str, Any]) -> None:
    print(f"{mark} {json.dumps(payload)}", flush=True)


def main() -> None:
    args = json.loads(sys.argv[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    broadcast = reduce = None
    if world > 1:
        dist.init_process_group("gloo")

        def broadcast(obj: Any) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        reduce = min_over_ranks()
    sources: list[str | NoticeSource] = [
        AwsSpotNotice(s["aws"], interval_s=0.05) if isinstance(s, dict) else s
        for s in args["sources"]
    ]
    delay = float(args.get("write_delay_s", 0))
    directory = SlowDisk(args["dir"], delay) if delay else args["dir"]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64, 4, 8)
    ckpt = Checkpointer(
        directory,
        policy="every_n_steps",
        every_n_steps=10**9,
        keep_last=None,
        preemption=Preemption(tuple(sources), margin_s=float(args.get("margin_s", 1.0))),
        rank=rank,
        world_size=world,
        broadcast=broadcast,
        min_over_ranks=reduce,
        sinks=[JsonlTelemetry(f"{args['dir']}/telemetry.jsonl")]
        if args.get("telemetry") and rank == 0
        else [],
    )
    step = 0
    try:
        state = ckpt.restore()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        say("RESUMED", {"step": step, "digest": digest(model)})
    except NoCheckpointError:
        pass
    ckpt.watch_preemption()
    ready_at = step + int(args.get("ready_at", 5))

    def save() -> None:
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        ckpt.save(step, state)
        say("SAVED", {"step": step, "digest": digest(model), "rank": rank})

    step_s = float(args.get("step_s", 0))
    try:
        while step < 10**8:
            if step_s:
                time.sleep(step_s)  # a longer step's compute, not a synchronisation
            loss = model(data[step % 64]).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            ckpt.observe(step, loss=float(loss.detach()))
            if ckpt.should_save(step):
                save()
            elif step == ready_at:
                save()
                ckpt.wait()
                print("READY", flush=True)
            ckpt.stop_if_preempted()
    except Preempted as stop:
        decision = ckpt.preempted
        assert decision is not None
        say(
            "PREEMPTED",
            {
                "saved": stop.step,
                "at": decision.step,
                "noticed_at": decision.noticed_at,
                "source": decision.source,
                "reason": decision.reason,
                "rank": rank,
                "code": stop.code,
            },
        )
        raise


if __name__ == "__main__":
    main()
