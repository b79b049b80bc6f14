"""Child process of test_restore_memory: one save or restore of a ~400 MB state, with its
peak resident memory above what the process held just before (VmHWM, reset through
/proc/self/clear_refs), printed as JSON.

``python -m tests.engine._memory_child save DIR COMPRESSION``
``python -m tests.engine._memory_child restore DIR into|copy``
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import sys
from typing import Any

import torch

from coci_core import CheckpointManager

WIDTH, LAYERS = 2048, 8  # 8 x 16 MiB weights; with Adam's two moments, ~400 MB of state


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    assert match is not None
    return int(match.group(1)) * 1024


def _settle() -> int:
    """Free what is garbage, give freed heap memory back, reset the peak: the resident bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():  # one update creates the moments (no forward pass: cheaper)
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors: list[torch.Tensor] = list(model.state_dict().values())
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    mode, directory, how = sys.argv[1:4]
    model, opt = _model_and_optimizer()
    out: dict[str, Any] = {"state_bytes": _state_bytes(model, opt)}
    if mode == "save":
        with CheckpointManager(directory, compression=how, keep_last=None) as mgr:
            before = _settle()
            mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
            out["extra_bytes"] = _status("VmHWM") - before
    else:
        with torch.no_grad():  # what the restore must bring back
            for p in model.parameters():
                p.zero_()
        ptrs = [p.data_ptr() for p in model.parameters()]
        with CheckpointManager(directory) as mgr:
            before = _settle()
            if how == "into":
                mgr.restore(into={"model": model, "optim": opt})
            else:  # what restore(into=...) did before: a full state, then load_state_dict
                state = mgr.restore()
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                del state
            out["extra_bytes"] = _status("VmHWM") - before
        out["same_tensors"] = ptrs == [p.data_ptr() for p in model.parameters()]
    out["weight_sum"] = float(model[0].weight.detach().double().sum())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
