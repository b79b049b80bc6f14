"""docs/architecture.md's "A framework adapter" recipe, followed step by step for a toy framework
(a loop with callbacks), and run end to end: planned saves, a stop, a resume bit-identical to a
run never stopped, the declared options. The adapter imports only the public line."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from coci_core import CompressionPolicy
from coci_core.errors import ConfigError
from coci_core.planner import SavePolicy
from coci_core.preemption import NoticeSource, Preemption
from coci_core.training import (
    Checkpointer,
    CheckpointOptions,
    check_bool,
    shared_options,
    signature_drift,
)

logger = logging.getLogger("toy")


class ToyLoop:
    """The "framework": trains ``model`` with ``opt`` on batches that depend only on the step,
    calling each callback's ``on_start(loop)`` and ``on_step_end(loop, step, loss)``."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)
        self.start_step = 0
        self.stop_at: int | None = None  # the "framework" stops after this step (a kill)

    def fit(self, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> int:
        self.model, self.opt = model, opt
        for cb in self.callbacks:
            cb.on_start(self)
        step = self.start_step
        while step < steps:
            step += 1
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            for cb in self.callbacks:
                cb.on_step_end(self, step, float(loss.detach()))
            if self.stop_at == step:
                break
        for cb in self.callbacks:
            cb.on_end(self)
        return step


class ToyCoci:
    """The adapter, by the recipe: (1) the framework's arguments and every shared option,
    keyword-only, as declared; ``CheckpointOptions.check`` once; its own flags by
    ``check_bool``. (2) a ``Checkpointer`` at set-up. (3) observe, should_save/save, warm_up,
    restore on resume, close and log_summary at the end."""

    def __init__(
        self,
        dirpath: str | Path | None = None,
        *,
        resume: bool = True,
        policy: str | SavePolicy = "coci",
        objective: str = "time",
        mtbf_s: float | None = None,
        keep_last: int | None = 3,
        compression: str | CompressionPolicy | None = "auto",
        compression_options: Mapping[str, Any] | None = None,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        block: bool = True,
        planner_options: Mapping[str, Any] | None = None,
        verbose: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | None = None,
        remote_keep_last: int | None = 10,
        remote_storage_options: Mapping[str, Any] | None = None,
        remote_upload_every: int | Literal["auto"] = "auto",
        preemption: str | Sequence[str | NoticeSource] | Preemption | None = "auto",
    ) -> None:
        self.resume = check_bool("resume", resume)
        self.options = CheckpointOptions.check(dirpath=dirpath, **shared_options(locals()))
        self.dirpath = dirpath if dirpath is not None else Path.cwd() / "coci"
        self.saved: list[int] = []
        self.resumed_from: int | None = None

    def _state(self, loop: ToyLoop) -> dict[str, Any]:
        return {"model": loop.model.state_dict(), "optim": loop.opt.state_dict()}

    def on_start(self, loop: ToyLoop) -> None:
        self.checkpointer = Checkpointer(self.dirpath, self.options, log=logger)
        if self.resume and self.checkpointer.latest_step() is not None:
            self.checkpointer.restore(into={"model": loop.model, "optim": loop.opt})
            self.resumed_from = loop.start_step = self.checkpointer.resumed_from or 0

    def on_step_end(self, loop: ToyLoop, step: int, loss: float) -> None:
        ckpt = self.checkpointer
        ckpt.observe(step, loss=loss)
        if ckpt.should_save(step):
            ckpt.save(step, self._state(loop))
            self.saved.append(step)
        elif not ckpt.warmed:
            ckpt.warm_up(self._state(loop))

    def on_end(self, loop: ToyLoop) -> None:
        self.checkpointer.close()
        self.checkpointer.log_summary(logger)


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    tensors = [*model.state_dict().values()]
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [t.detach().numpy().tobytes() for t in tensors]


def test_the_recipes_adapter_saves_as_planned_and_resumes_bit_identical(tmp_path: Path) -> None:
    options: dict[str, Any] = {"policy": "every_n_steps", "every_n_steps": 4, "keep_last": 2}
    never_stopped = _fresh()
    ToyLoop([ToyCoci(tmp_path / "a", **options)]).fit(*never_stopped, 20)

    first = ToyCoci(tmp_path / "b", **options)
    loop = ToyLoop([first])
    loop.stop_at = 14  # the job ends here, past its last planned save (12)
    assert loop.fit(*_fresh(), 20) == 14
    assert first.saved == [4, 8, 12] and first.resumed_from is None

    other = _fresh()
    for p in other[0].parameters():  # what is restored must not be what a fresh start has
        torch.nn.init.zeros_(p)
    second = ToyCoci(tmp_path / "b", **options)
    assert ToyLoop([second]).fit(*other, 20) == 20
    assert second.resumed_from == 12
    assert second.saved == [16, 20]
    assert _bytes(*other) == _bytes(*never_stopped)


def test_the_recipes_adapter_takes_the_declared_options() -> None:
    assert signature_drift(ToyCoci) == []
    with pytest.raises(ConfigError, match="'resume' must be a bool"):
        ToyCoci(resume="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keep_last"):
        ToyCoci(keep_last=0)


def test_the_recipes_adapter_imports_only_the_public_line() -> None:
    from tests.test_layering import _past_the_line

    assert _past_the_line(Path(__file__).read_text()) == []
