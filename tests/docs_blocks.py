"""Fixtures for the Python blocks of README.md and docs/*.md (run by pytest-markdown-docs).

A block names what it takes from here in its info string (```` ```python fixture:model
fixture:opt ````); the plugin puts each fixture's value in the block's globals under the
fixture's name. They stand for what the reader has ("your model", "your optimizer"), small
enough that every block runs in seconds. Every block runs in a fresh temporary directory, with
Accelerate's global state, the codec registry and Lightning's log level put back after it, and
fails if it leaves a coci writer thread running.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from coci_core import CheckpointManager

_WRITER_THREADS = ("coci-persist", "coci-persist-ahead", "coci-telemetry", "coci-lease")
_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric")


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


@functools.cache
def my_model_class() -> type[Any]:
    """``MyModel``, the reader's LightningModule class (Lightning is imported when a block or
    test first asks for it, not by every test run)."""
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    class MyModel(pl.LightningModule):
        """The reader's LightningModule: a small regression (8 features), 400 training samples in
        batches of 8 (50 steps an epoch, Lightning's logging interval) through a stateful loader;
        logs ``loss``, ``val_loss`` and ``test_loss``."""

        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )
            self.seen = 0  # training batches seen by this object

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # type: ignore[no-any-return]

        def _loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen += 1
            loss = self._loss(batch)
            self.log("loss", loss, batch_size=len(batch[0]))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self._loss(batch), batch_size=len(batch[0]))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", self._loss(batch), batch_size=len(batch[0]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])

        def train_dataloader(self) -> Any:
            return StatefulDataLoader(_data(400, 0), batch_size=8, shuffle=True)

        def val_dataloader(self) -> Any:
            return StatefulDataLoader(_data(16, 1), batch_size=8)

        def test_dataloader(self) -> Any:
            return StatefulDataLoader(_data(16, 2), batch_size=8)

    return MyModel


@pytest.fixture(autouse=True)
def _docs_block(request: pytest.FixtureRequest) -> Iterator[None]:
    """Around each Markdown block (only): a fresh working directory and seed, no progress
    bars; afterwards the global state it changed is put back, and no writer thread is left."""
    if request.node.get_closest_marker("markdown-docs") is None:
        yield
        return
    from lightning.pytorch.callbacks import TQDMProgressBar

    from coci_core.codecs import registry

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(request.getfixturevalue("tmp_path"))
    # no progress bars: pytest-markdown-docs shows a block's output as it runs
    monkeypatch.setattr(TQDMProgressBar, "is_enabled", property(lambda self: False))
    levels = {name: logging.getLogger(name).level for name in _LIGHTNING_LOGGERS}
    for name in _LIGHTNING_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    codecs = dict(registry._CODECS)
    threads = {t.ident for t in threading.enumerate()}
    torch.manual_seed(0)
    try:
        yield
    finally:
        monkeypatch.undo()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        registry._CODECS.clear()
        registry._CODECS.update(codecs)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    leaked = [
        t.name
        for t in threading.enumerate()
        if t.ident not in threads and t.name in _WRITER_THREADS and t.is_alive()
    ]
    assert not leaked, f"the block leaves coci writer threads running: {leaked}"


@pytest.fixture(scope="session")
def _docs_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local S3 server (SeaweedFS) with the bucket the blocks name, ``bucket``."""
    from tests.harness.s3 import start_s3_server

    server = start_s3_server(tmp_path_factory.mktemp("docs-s3"))
    try:
        server.filesystem().mkdir("bucket")
        yield server
    finally:
        server.stop()


@pytest.fixture
def options(_docs_block: None, _docs_s3: Any) -> dict[str, Any]:
    """The reader's s3fs options (credentials, endpoint) of a bucket named ``bucket``, empty
    under ``bucket/run``."""
    fs = _docs_s3.filesystem()
    for prefix in ("bucket/run", "bucket/run1"):
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
    return dict(_docs_s3.storage_options)


@pytest.fixture
def storage_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` under the name some blocks give them."""
    return options


@pytest.fixture(name="MyModel")
def my_model_fixture() -> type[Any]:
    """The reader's LightningModule class."""
    return my_model_class()


@pytest.fixture
def model() -> Any:
    """The reader's model (a LightningModule, so also a torch.nn.Module)."""
    return my_model_class()()


@pytest.fixture
def opt(model: Any) -> torch.optim.Optimizer:
    """The reader's optimizer of ``model``."""
    return torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.fixture
def optimizer(model: Any) -> torch.optim.Optimizer:
    """``opt`` under the name Accelerate's examples give it."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture
def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning-rate schedule of ``optimizer``."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=16, gamma=0.5)


@pytest.fixture
def dataset() -> TensorDataset:
    """The reader's data set: 64 samples of (features, target)."""
    return _data(64, 0)


@pytest.fixture
def dataloader(dataset: TensorDataset) -> DataLoader[Any]:
    """Batches of 8 (features, target) pairs: 8 steps an epoch."""
    return DataLoader(dataset, batch_size=8, shuffle=True)


@pytest.fixture
def accelerator(_docs_block: None) -> Any:
    """An ``Accelerator`` on the CPU, whose loaders resume mid-epoch exactly."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=True)
    return Accelerator(cpu=True, dataloader_config=config)


@pytest.fixture
def total() -> int:
    """The optimizer steps of the reader's run."""
    return 300


@pytest.fixture
def step() -> int:
    """The optimizer steps completed when a block saves."""
    return 100


@pytest.fixture
def state(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What the reader saves: the model's and the optimizer's state."""
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.fixture
def manager(_docs_block: None, tmp_path: Path) -> Iterator[CheckpointManager]:
    """A ``CheckpointManager`` of the reader's run (closed after the block)."""
    with CheckpointManager(tmp_path / "manager") as mgr:
        yield mgr


@pytest.fixture
def train_one_step(model: Any, opt: torch.optim.Optimizer) -> Callable[[], tuple[float, float]]:
    """One optimizer step of ``model``, the n-th call on the n-th batch of a fixed stream;
    returns the loss and the step's seconds."""
    calls = [0]

    def train_one_step() -> tuple[float, float]:
        started = time.perf_counter()
        x, y = _data(8, 1000 + calls[0]).tensors
        calls[0] += 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        loss = loss.detach()
        return loss.item(), time.perf_counter() - started

    return train_one_step


@pytest.fixture
def lm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The reader's transformers model: a tiny GPT-2 built from a config (no download)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tests.transformers.run import tiny_model

    return tiny_model()


@pytest.fixture
def train_dataset() -> Any:
    """The reader's training set for ``lm``: dicts of ``input_ids`` and ``labels``."""
    from tests.transformers.run import Tokens

    class Plain(Tokens):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            item = super().__getitem__(i)
            del item["idx"]
            return item

    return Plain()
