"""coci's benchmarks, run from the repository root as ``python -m benchmarks.<name>``.

``benchmarks._lib`` holds what the scripts share (machine sampling, timing and statistics,
files and the page cache, result files); the models and data that the tests build too live in
``tests.harness``.
"""
