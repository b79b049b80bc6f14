"""One rank of torch's distributed-checkpoint tests, ported to coci (see
``tests/sharding/test_ported_dcp.py`` for which upstream test each case ports). Every case runs
in sequence in this one launch, each in its own checkpoint directory under ``ROOT``, and prints
``CASE <name> <json>``: ``{"ok": bool, "detail": str}`` (what differed, or the error).

Run as ``python -m tests.sharding._ported_dcp_child ROOT`` with RANK, WORLD_SIZE (4),
MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from coci_core import CheckpointManager, RankGroup
from coci_core.engine.restore.inplace import InPlaceTargets
from tests.harness.states import full_digest

GLOBAL = torch.arange(16, dtype=torch.float32).view(4, 4)
UNEVEN = torch.arange(15, dtype=torch.float32).view(5, 3)  # 5 rows over 2 or 4: uneven
ONE_D: list[list[Placement]] = [[Shard(0)], [Replicate()]]
TWO_D: list[list[Placement]] = [
    [Replicate(), Replicate()],
    [Replicate(), Shard(0)],
    [Shard(0), Replicate()],
    [Shard(0), Shard(0)],
]
FULL = StateDictOptions(full_state_dict=True)  # the same on every rank (no cpu_offload)


class Meshes:
    """The meshes every case uses: ``one`` (4,), ``two`` (2, 2) named ``("dp", "tp")``."""

    def __init__(self) -> None:
        self.one = init_device_mesh("cpu", (4,))
        self.two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _mgr(root: Path, name: str) -> CheckpointManager:
    return CheckpointManager(root / name, group=RankGroup.from_torch_distributed(), keep_last=None)


def _zeros(shape: torch.Size, mesh: DeviceMesh, placements: list[Placement]) -> DTensor:
    return distribute_tensor(torch.zeros(shape), mesh, placements)


def _name(mesh: DeviceMesh, placements: list[Placement]) -> str:
    return f"{tuple(mesh.shape)}{[str(p) for p in placements]}"


def _reshard(root: Path, meshes: Meshes, sources: str, targets: str) -> list[str]:
    """Save ``GLOBAL`` and ``UNEVEN`` distributed on each of the ``sources`` layouts, restore
    them in place into zeros on each of the ``targets`` layouts (other than the source): the
    full tensors equal the originals, and each rank's local pieces equal those that
    ``distribute_tensor`` gives on the target layout (and, on the same mesh, redistributed back
    to the source placements, the saved pieces)."""
    layouts = {
        "1d": [(meshes.one, p) for p in ONE_D],
        "2d": [(meshes.two, p) for p in TWO_D],
    }
    wrong = []
    for i, (src_mesh, src_pl) in enumerate(layouts[sources]):
        name = f"reshard-{sources}-{i}"
        saved = {k: distribute_tensor(v, src_mesh, src_pl) for k, v in _globals().items()}
        mgr = _mgr(root, name)
        mgr.save(1, saved)
        for dst_mesh, dst_pl in layouts[targets]:
            if dst_mesh is src_mesh and dst_pl == src_pl:
                continue
            live = {k: _zeros(v.shape, dst_mesh, dst_pl) for k, v in _globals().items()}
            state = mgr.restore(1, targets=InPlaceTargets(live))
            where = f"{_name(src_mesh, src_pl)} -> {_name(dst_mesh, dst_pl)}"
            for key, expected in _globals().items():
                got = live[key]
                if state[key] is not got:
                    wrong.append(f"{where} {key}: not filled in place")
                if not torch.equal(got.full_tensor(), expected):
                    wrong.append(f"{where} {key}: full tensor differs")
                local = distribute_tensor(expected, dst_mesh, dst_pl).to_local()
                if not torch.equal(got.to_local(), local):
                    wrong.append(f"{where} {key}: local piece differs")
                if dst_mesh is src_mesh:
                    back = got.redistribute(src_mesh, src_pl).to_local()
                    if not torch.equal(back, saved[key].to_local()):
                        wrong.append(f"{where} {key}: redistributed back differs")
        mgr.close()
    return wrong


def _globals() -> dict[str, torch.Tensor]:
    return {"dtensor": GLOBAL, "uneven": UNEVEN}


def case_reshard_1d_to_1d(root: Path, meshes: Meshes) -> list[str]:
    return _reshard(root, meshes, "1d", "1d")


def case_reshard_2d_to_2d(root: Path, meshes: Meshes) -> list[str]:
    return _reshard(root, meshes, "2d", "2d")


def case_reshard_1d_to_2d(root: Path, meshes: Meshes) -> list[str]:
    return _reshard(root, meshes, "1d", "2d")


def case_reshard_2d_to_1d(root: Path, meshes: Meshes) -> list[str]:
    return _reshard(root, meshes, "2d", "1d")


class MLPModule(nn.Module):
    """torch's test ``MLPModule``: two linear layers around a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def case_tp_checkpoint(root: Path, meshes: Meshes) -> list[str]:
    """Save a tensor-parallel model's state, train a step (every parameter changes), restore in
    place into its live state dict: the parameters are the saved ones again."""
    torch.manual_seed(0)
    model = MLPModule()
    parallelize_module(model, meshes.one, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    original = copy.deepcopy(model.state_dict())
    mgr = _mgr(root, "tp")
    mgr.save(1, {"model": model.state_dict()})
    torch.manual_seed(0)
    model(torch.rand(20, 10)).sum().backward()
    optimizer.step()
    wrong = []
    state_dict = model.state_dict()
    for key, value in original.items():
        if torch.equal(value.to_local(), state_dict[key].to_local()):
            wrong.append(f"{key}: unchanged by the step")
    mgr.restore(1, targets=InPlaceTargets({"model": state_dict}))
    mgr.close()
    params = dict(model.named_parameters())
    for key, value in original.items():
        if not torch.equal(value.to_local(), params[key].to_local()):
            wrong.append(f"{key}: the parameter is not the saved one")
    return wrong


def _digest(state: Any) -> str:
    return full_digest(state)


def case_fsdp_model_state(root: Path, meshes: Meshes) -> list[str]:
    """FSDP2 model state saved sharded over 4 ranks, restored into a model initialised
    otherwise, sharded over the same 4 ranks and (resharding) over 2 of them (ranks {0, 2} and
    {1, 3}, replicated across the pairs)."""
    wrong = []
    for step, mesh in ((1, meshes.one), (2, meshes.two["dp"])):
        torch.manual_seed(1)
        model = nn.Linear(8, 8)
        fully_shard(model, mesh=meshes.one)
        model(torch.rand(8, 8)).sum().backward()
        mgr = _mgr(root, "fsdp-model")
        mgr.save(step, {"model": get_model_state_dict(model)})
        torch.manual_seed(2)
        other = nn.Linear(8, 8)
        fully_shard(other, mesh=mesh)
        expected = _digest(get_model_state_dict(model))
        if _digest(get_model_state_dict(other)) == expected:
            wrong.append(f"mesh {tuple(mesh.shape)}: the new model equals the saved one already")
        live = get_model_state_dict(other)
        mgr.restore(step, targets=InPlaceTargets({"model": live}))
        set_model_state_dict(other, live)
        if _digest(get_model_state_dict(other)) != expected:
            wrong.append(f"mesh {tuple(mesh.shape)}: restored model differs")
        mgr.close()
    return wrong


class Dummy(nn.Module):
    """torch's ``TestDummyModel`` of the FSDP optimizer-state test: widths scale with the world
    size."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.net1 = nn.Sequential(nn.Linear(8, world), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(world, world * 2), nn.ReLU())
        self.net3 = nn.Sequential(nn.Linear(world * 2, world * 3), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net3(self.net2(self.net1(x)))


def case_fsdp_optim_state(root: Path, meshes: Meshes) -> list[str]:
    """FSDP2 model and Adam state saved together; loaded into a new model and an Adam without
    state yet, the model first and alone, then the optimizer: both equal the saved ones."""
    world = dist.get_world_size()
    torch.manual_seed(3)
    model = Dummy(world)
    fully_shard(model, mesh=meshes.one)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(8, 8)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    expected = [_digest(msd), _digest(osd)]
    mgr = _mgr(root, "fsdp-optim")
    mgr.save(1, {"model": msd, "optim": osd})
    torch.manual_seed(4)
    other = Dummy(world)
    fully_shard(other, mesh=meshes.one)
    optim2 = torch.optim.Adam(other.parameters(), lr=0.1)
    wrong = [] if len(optim2.state) == 0 else ["Adam has state before its first step"]
    live_model = get_model_state_dict(other)
    mgr.restore(1, targets=InPlaceTargets({"model": live_model}))
    set_model_state_dict(other, live_model)
    live_optim = get_optimizer_state_dict(other, optim2)
    mgr.restore(1, targets=InPlaceTargets({"optim": live_optim}))
    set_optimizer_state_dict(other, optim2, live_optim)
    mgr.close()
    got = [_digest(get_model_state_dict(other)), _digest(get_optimizer_state_dict(other, optim2))]
    if got[0] != expected[0]:
        wrong.append("model differs")
    if got[1] != expected[1]:
        wrong.append("optimizer state differs")
    return wrong


class MLP(nn.Module):
    """torch's test ``MLP``: ``in_proj`` and ``out_proj``."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * 2)
        self.out_proj = nn.Linear(dim * 2, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(torch.relu(self.in_proj(x)))


TP_PLAN: dict[str, Any] = {
    f"{i}.{name}": style()
    for i in range(3)
    for name, style in (("in_proj", ColwiseParallel), ("out_proj", RowwiseParallel))
}


def _base() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(MLP(), MLP(), MLP())


def _fsdp2_tp(meshes: Meshes) -> nn.Module:
    model = parallelize_module(_base(), meshes.two["tp"], TP_PLAN)
    for layer in model:
        fully_shard(layer, mesh=meshes.two["dp"])
    fully_shard(model, mesh=meshes.two["dp"])
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(6)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    msd, osd = get_state_dict(model, optimizer, options=FULL)
    return [_digest(msd), _digest(osd)]


def case_fsdp2_tp_loads_full_and_tp_state(root: Path, meshes: Meshes) -> list[str]:
    """An unsharded model's full state and a tensor-parallel model's (4 ranks) sharded state,
    saved side by side, each loaded into FSDP2 over tensor parallelism on (2, 2): the full
    model and optimizer state then equal the source's, bit for bit."""
    base = _base()
    base_optim = torch.optim.AdamW(base.parameters(), lr=0.1)
    tp = parallelize_module(copy.deepcopy(base), meshes.one, TP_PLAN)
    tp_optim = torch.optim.AdamW(tp.parameters(), lr=0.1)
    _step(base, base_optim)
    _step(tp, tp_optim)
    base_msd, base_osd = get_state_dict(base, base_optim, options=FULL)
    tp_msd, tp_osd = get_state_dict(tp, tp_optim)
    expected = {"full": _full(base, base_optim), "sharded": _full(tp, tp_optim)}
    mgr = _mgr(root, "fsdp2-tp")
    state = {"model_full": base_msd, "optim_full": base_osd}
    mgr.save(1, {**state, "model_sharded": tp_msd, "optim_sharded": tp_osd})
    model = _fsdp2_tp(meshes)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrong = []
    for source in ("full", "sharded"):
        msd, osd = get_state_dict(model, optim)
        live = {f"model_{source}": msd, f"optim_{source}": osd}
        mgr.restore(1, targets=InPlaceTargets(live))
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        got = _full(model, optim)
        if got != expected[source]:
            want = expected[source]
            wrong.append(f"{source}: model {got[0] == want[0]}, optim {got[1] == want[1]} equal")
    mgr.close()
    return wrong


def case_tp_loads_fsdp2_tp_state(root: Path, meshes: Meshes) -> list[str]:
    """FSDP2 over tensor parallelism on (2, 2), a step trained, saved; loaded into a model
    tensor-parallel over the 4 ranks: the full state equals the saved one."""
    model = _fsdp2_tp(meshes)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optim)
    msd, osd = get_state_dict(model, optim)
    expected = _full(model, optim)
    mgr = _mgr(root, "fsdp2-tp-to-tp")
    mgr.save(1, {"model": msd, "optim": osd})
    tp = parallelize_module(_base(), meshes.one, TP_PLAN)
    tp_optim = torch.optim.AdamW(tp.parameters(), lr=0.1)
    tmsd, tosd = get_state_dict(tp, tp_optim)
    mgr.restore(1, targets=InPlaceTargets({"model": tmsd, "optim": tosd}))
    set_state_dict(tp, tp_optim, model_state_dict=tmsd, optim_state_dict=tosd)
    mgr.close()
    got = _full(tp, tp_optim)
    if got == expected:
        return []
    return [f"model {got[0] == expected[0]}, optim {got[1] == expected[1]} equal"]


class _Gather:
    """``load_state_dict`` runs an all_gather (upstream's ``Foo``)."""

    def __init__(self) -> None:
        self.got: list[list[int]] = []

    def load_state_dict(self, state: Any) -> None:
        parts = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.arange(2, dtype=torch.int64) + 1 + 2 * dist.get_rank())
        self.got = [p.tolist() for p in parts]


class _Reduce:
    """``load_state_dict`` runs an all_reduce (upstream's ``Bar``)."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def load_state_dict(self, state: Any) -> None:
        t = torch.arange(2, dtype=torch.int64) + 1 + 2 * dist.get_rank()
        dist.all_reduce(t)
        self.got = t.tolist()


def case_different_ordered_state_dict_keys(root: Path, meshes: Meshes) -> list[str]:
    """``into=`` objects whose ``load_state_dict`` runs collectives, listed in another order on
    rank 0 than on the others: no deadlock, each collective sees every rank."""
    mgr = _mgr(root, "key-order")
    mgr.save(1, {"A": {"a": torch.ones(2)}, "B": {"b": torch.zeros(2)}})
    gather, reduce = _Gather(), _Reduce()
    into: dict[str, Any] = {"A": gather, "B": reduce}
    if dist.get_rank() == 0:
        into = {"B": reduce, "A": gather}
    mgr.restore(1, into=into)
    mgr.close()
    world = dist.get_world_size()
    wrong = []
    if gather.got != [[1 + 2 * r, 2 + 2 * r] for r in range(world)]:
        wrong.append(f"all_gather got {gather.got}")
    if reduce.got != [sum(1 + 2 * r for r in range(world)), sum(2 + 2 * r for r in range(world))]:
        wrong.append(f"all_reduce got {reduce.got}")
    return wrong


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> dict[str, Any]:
    """Upstream's ``_train``: the same inputs on every rank; a train state with a tensor step,
    a tensor loss and the list of losses (upstream keeps the list as a ``torch.save``d
    ``BytesIO``; coci stores a list of floats as it is)."""
    torch.manual_seed(0)
    state: dict[str, Any] = {"step": 0, "current_loss": -1.0, "losses": []}
    for _ in range(steps):
        model(torch.rand(8, 8)).sum().backward()
        state["step"] += 1
        state["current_loss"] = torch.rand(1).item()
        state["losses"].append(state["current_loss"])
        optim.step()
        optim.zero_grad()
    return state


class _TrainState:
    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state = state or {"step": 0, "current_loss": -1.0, "losses": []}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": torch.tensor(self.state["step"], dtype=torch.int32),
            "current_loss": torch.tensor(self.state["current_loss"], dtype=torch.float32),
            "losses": list(self.state["losses"]),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = {
            "step": int(sd["step"].item()),
            "current_loss": float(sd["current_loss"].item()),
            "losses": list(sd["losses"]),
        }


class _Stateful:
    """Upstream's ``TestStatefulObj``: a random tensor, loaded by replacement."""

    def __init__(self) -> None:
        self.data = torch.rand(10, 10)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.data = sd["data"]


class _E2EModel(nn.Module):
    """Upstream's ``TestDummyModel`` of the end-to-end test."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Linear(8, 16)
        self.net2 = nn.Linear(16, 32)
        self.net3 = nn.Linear(32, 64)
        self.net4 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for net in (self.net1, self.net2, self.net3, self.net4):
            x = torch.relu(net(x))
        return x


def _e2e_model(kind: str, meshes: Meshes) -> tuple[nn.Module, torch.optim.Optimizer]:
    model: nn.Module = _E2EModel()
    if kind == "fsdp":
        fully_shard(model, mesh=meshes.one)
    elif kind == "hsdp":  # replicated over "dp", sharded over "tp"
        fully_shard(model, mesh=meshes.two)
    else:  # "ddp"
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def case_e2e(root: Path, meshes: Meshes) -> list[str]:
    """Upstream's ``test_e2e`` for FSDP2, HSDP and DDP: a model trained 2 steps saved with its
    optimizer, a stateful object and a train state; loaded into new ones (the model and
    optimizer in place, the others through ``into=``); one more step on both: the same loss
    and the same state, bit for bit."""
    wrong = []
    for step, kind in enumerate(("fsdp", "hsdp", "ddp"), start=1):
        model, optim = _e2e_model(kind, meshes)
        train_state = _TrainState(_train(model, optim, 2))
        torch.manual_seed(7)
        obj = _Stateful()
        msd, osd = get_state_dict(model, optim)
        mgr = _mgr(root, "e2e")
        state = {"model": msd, "optimizer": osd}
        mgr.save(step, {**state, "s": obj.state_dict(), "train_state": train_state.state_dict()})
        model2, optim2 = _e2e_model(kind, meshes)
        loaded_obj, loaded_train = _Stateful(), _TrainState()
        msd2, osd2 = get_state_dict(model2, optim2)
        mgr.restore(
            step,
            into={"s": loaded_obj, "train_state": loaded_train},
            targets=InPlaceTargets({"model": msd2, "optimizer": osd2}),
        )
        set_state_dict(model2, optim2, model_state_dict=msd2, optim_state_dict=osd2)
        mgr.close()
        if not torch.equal(loaded_obj.data, obj.data):
            wrong.append(f"{kind}: stateful object differs")
        if loaded_train.state != train_state.state:
            wrong.append(f"{kind}: train state {loaded_train.state} != {train_state.state}")
        torch.manual_seed(8)
        x = torch.rand(8, 8)
        losses = []
        for m, o in ((model, optim), (model2, optim2)):
            loss = m(x).sum()
            loss.backward()
            o.step()
            losses.append(loss.item())
        if losses[0] != losses[1]:
            wrong.append(f"{kind}: next step's loss {losses[1]} != {losses[0]}")
        a, b = get_state_dict(model, optim), get_state_dict(model2, optim2)
        if [_digest(a[0]), _digest(a[1])] != [_digest(b[0]), _digest(b[1])]:
            wrong.append(f"{kind}: state after the next step differs")
    return wrong


def case_partial_load(root: Path, meshes: Meshes) -> list[str]:
    """Model and optimizer saved; only the model loaded into a new FSDP2 model (the stored
    optimizer is not asked for). The whole checkpoint, read in one process, is checked by the
    test against the digests printed here."""
    model, optim = _e2e_model("fsdp", meshes)
    _train(model, optim, 2)
    msd, osd = get_state_dict(model, optim)
    mgr = _mgr(root, "partial")
    mgr.save(1, {"model": msd, "optimizer": osd})
    other, _ = _e2e_model("fsdp", meshes)
    live = get_model_state_dict(other)
    mgr.restore(1, targets=InPlaceTargets({"model": live}))
    set_model_state_dict(other, live)
    mgr.close()
    expected = _digest(msd)
    wrong = [] if _digest(get_model_state_dict(other)) == expected else ["model differs"]
    return [*wrong, f"digests {expected} {_digest(osd)}"]


def case_stateful_and_non_stateful_loads(root: Path, meshes: Meshes) -> list[str]:
    """An ``into=`` object is loaded in place (its ``load_state_dict`` called, the object kept);
    a plain nested value comes back as stored (a tensor and a list of ints)."""

    class Foo:
        called = False

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: Any) -> None:
            self.called = True

    torch.manual_seed(9)
    bar = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    mgr = _mgr(root, "stateful")
    mgr.save(1, {"foo": Foo().state_dict(), "bar": bar})
    foo = Foo()
    into = {"foo": foo}
    state = mgr.restore(1, into=into)
    mgr.close()
    wrong = [] if foo.called and into["foo"] is foo else ["the object was not loaded in place"]
    if not torch.equal(state["bar"]["replicated"], bar["replicated"]):
        wrong.append("tensor differs")
    if state["bar"]["bytes"] != [1, 2, 3, 4]:
        wrong.append(f"list {state['bar']['bytes']}")
    return wrong


def case_overwrite(root: Path, meshes: Meshes) -> list[str]:
    """A step saved again with ``overwrite=True`` reads back the second state."""
    torch.manual_seed(10)
    t1, t2 = torch.randn(10), torch.randn(10)
    mgr = _mgr(root, "overwrite")
    mgr.save(1, {"random": t1})
    mgr.save(1, {"random": t2}, overwrite=True)
    got = mgr.restore(1)["random"]
    mgr.close()
    return [] if torch.equal(got, t2) else ["the first state came back"]


CASES: dict[str, Callable[[Path, Meshes], list[str]]] = {
    name[len("case_") :]: fn for name, fn in dict(globals()).items() if name.startswith("case_")
}


def main(root: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    meshes = Meshes()
    for name, case in CASES.items():
        try:
            wrong = case(root, meshes)
            notes = [w for w in wrong if w.startswith("digests ")]
            wrong = [w for w in wrong if not w.startswith("digests ")]
            row = {"ok": not wrong, "detail": "; ".join(wrong), "notes": notes}
        except Exception as e:  # reported, the next case still runs
            row = {"ok": False, "detail": f"{type(e).__name__}: {e}", "notes": []}
            traceback.print_exc()
        print(f"CASE {name} {json.dumps(row)}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)
