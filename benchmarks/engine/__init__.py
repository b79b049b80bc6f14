"""The engine benchmark's parts; its command line is ``python -m benchmarks.engine_bench``.

:mod:`.state` builds the saved state, :mod:`.methods` holds the save and restore methods
compared, :mod:`.measure` the measurement loop and :mod:`.report` the tables."""
