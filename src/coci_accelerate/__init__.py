"""coci for Hugging Face Accelerate: ``CociTracker`` and ``CociCheckpointer`` (issue 5)."""

__all__: list[str] = []
