"""coci for PyTorch Lightning: ``Trainer(callbacks=[CociCheckpoint()])`` (in progress, issue 4)."""

__all__: list[str] = []
