"""One of two ranks whose partner is SIGKILLed before its share of step 2 (see
test_silent_rank.py): both save step 1; rank ``cfg["victim"]`` then prints ``KILLME`` and waits
to be killed; the other saves step 2 with the default commit timeout (600 s) and a short
silence (``cfg["silent_s"]``), and prints ``RESULT`` with the error and how long it took. With
``cfg["restore"]`` the other restores instead (the restore's agreement has a default timeout of
1800 s), its partner killed before it says which step it can restore. With ``cfg["first"]``
nothing is saved before the kill: the other's save of step 2 is its first, whose check that the
ranks share the directory waits for its partner (for the commit timeout, 600 s, before). With
``cfg["after_report"]`` (and ``restore``) the victim is killed once it said which step it holds,
before it read the others' reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from coci_core import BackgroundSaveError, CheckpointError, CheckpointManager, RankGroup


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    with contextlib.suppress(ImportError):  # (so that this also runs against a coci without it)
        from coci_core.engine import pulse

        pulse.RANK_SILENT_S = cfg["silent_s"]  # the knob, shortened for the test
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mgr = CheckpointManager(cfg["dir"], group=RankGroup.from_torch_distributed())
    if not cfg.get("first"):
        mgr.save(1, {"w": torch.arange(8.0)}).wait()
    if rank == cfg["victim"] and cfg.get("after_report"):  # killed once it said what it holds
        from coci_core.engine.agreement import RestoreAgreement

        def stop(self: Any, key: str) -> None:
            print("KILLME", flush=True)
            time.sleep(600)

        RestoreAgreement._wait_until_all_read = stop  # type: ignore[method-assign]
    elif rank == cfg["victim"]:
        print("KILLME", flush=True)
        time.sleep(600)
    started = time.monotonic()
    if cfg.get("restore"):
        try:
            mgr.restore()
        except CheckpointError as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
        return {"error": None, "seconds": time.monotonic() - started}
    try:
        mgr.save(2, {"w": torch.arange(8.0) + 2}).wait()
    except BackgroundSaveError as e:
        cause = e.__cause__
        error, ranks = f"{type(cause).__name__}: {cause}", getattr(cause, "ranks", None)
    except CheckpointError as e:  # the first save's check, before anything is written
        error, ranks = f"{type(e).__name__}: {e}", None
    else:
        error, ranks = None, None
    return {"error": error, "ranks": ranks, "seconds": time.monotonic() - started}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
